"""Verified memory: a single-mesh plan made under a binding memory budget is compiled and its
`memory_analysis()` checked against the budget, so "fits the budget" holds whatever the
memory model's error and whatever the backend's scheduler does.

The planner predicts the peak per device (`intra_op.memory`); XLA's scheduler and buffer
assignment decide the real one. When the prediction is within `BINDING` of the budget,
`verified_plan` compiles the lowered step (the executable is kept: the first call reuses it)
and reads arguments + outputs + temp - aliased. A budget the user set is searched at
(1 - HEADROOM) of it first, and at the budget itself only where nothing fits below
(`_first`); a plan still predicted within `HEADROOM` of the budget is re-planned below
(1 - HEADROOM) of it, before anything is compiled, when something fits there
(`_with_headroom`): the memory model is within a few percent of XLA, not exact (measured
within 5% on the recomputation plans of an attention LM under both of XLA:CPU's
schedulers), so a plan at the very edge of the budget would often compile just over it. A
plan whose search's rows bind and count it well above its prediction is searched once more
at a search budget raised by the excess (`_loosened`), and the faster plan kept. If
the compiled plan exceeds the budget, it re-plans with the search budget that made it scaled
down by budget / compiled (at most `ROUNDS` times, each logged) and raises
`InfeasiblePlanError` naming the predicted and compiled bytes if none fits. The plan
records what XLA compiled to (`ParallelPlan.measured["compiled_bytes"]`; `autopar.dump` shows
it next to the prediction).

Example (what `parallelize` does for a single-mesh plan):
    >>> made = verified_plan(method, plan_at, compile_plan)     # doctest: +SKIP
    >>> made.plan.measured["compiled_bytes"] <= made.plan.memory_budget_bytes  # doctest: +SKIP
    True
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from autopar.core import progress
from autopar.core.errors import InfeasiblePlanError
from autopar.core.graph import OpGraph
from autopar.core.options import ShardParallel
from autopar.core.plan import ParallelPlan

log = logging.getLogger(__name__)

BINDING = 0.5     # a budget binds when the predicted peak is at least this share of it
ROUNDS = 3        # re-plans at a scaled budget before giving up
HEADROOM = 0.05   # a plan predicted this close to its budget is re-planned this far below it
LOOSEN = 0.05     # rows that count a plan this share of its target above its prediction: loosen


@dataclass(frozen=True, slots=True)
class Verified:
    """A plan, the graph it was made for, and (when it was checked) what compiling it made:
    `built` is whatever `compile_plan` returned (the lowered step and its executable)."""
    plan: ParallelPlan
    graph: OpGraph
    built: Any = None


def compiled_bytes(compiled) -> int | None:
    """arguments + outputs + temp - aliased of a compiled executable, per device; None when
    the backend reports no memory analysis."""
    try:
        m = compiled.memory_analysis()
    except Exception:                   # noqa: BLE001 - some backends do not implement it
        return None
    if m is None:
        return None
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
               - m.alias_size_in_bytes)


def binding(plan: ParallelPlan) -> bool:
    """Whether `plan`'s predicted peak is close enough to its budget to be checked."""
    return plan.peak_memory_bytes >= BINDING * plan.memory_budget_bytes


@dataclass(frozen=True, slots=True)
class Over:
    """A compiled plan over its budget: where (`the plan`, `stage 1 of the pipeline`), what the
    model predicted there, what XLA compiled it to, and the search budget to re-plan at."""
    where: str
    predicted: float
    compiled: int
    next_budget: float


def replan_until_it_fits(planned, budget: float, measure: Callable, replan: Callable,
                         fix: str):
    """The compiled check's rounds, for one mesh and for pipelines alike:
    `measure(planned, round_)` compiles `planned` and returns (`planned` with what XLA compiled
    recorded, what was built, an `Over` or None where it fits); `replan(next_budget)` plans
    again. Returns (planned, built) of the first that fits, each re-plan logged.

    Raises:
      InfeasiblePlanError: still over the budget after `ROUNDS` re-plans, or a re-plan finds
        no plan; it names where, the predicted and the compiled bytes, and `fix`.
    """
    for round_ in range(ROUNDS + 1):
        with progress.phase("memory check", "compiles the plan to read its memory use") as ph:
            planned, built, over = measure(planned, round_)
            ph.done("fits the budget" if over is None else "over the budget")
        if over is None:
            return planned, built
        if round_ == ROUNDS:
            break
        log.warning("autopar: %s predicted %s bytes per device but XLA compiled it to %s, "
                    "over the budget %s; re-planning at a budget of %s (round %d of %d)",
                    over.where, f"{over.predicted:,.0f}", f"{over.compiled:,}",
                    f"{budget:,.0f}", f"{over.next_budget:,.0f}", round_ + 1, ROUNDS)
        try:
            planned = replan(over.next_budget)
        except InfeasiblePlanError as e:
            raise InfeasiblePlanError(
                f"memory: {over.where} predicted {over.predicted:,.0f} bytes per device, but "
                f"XLA compiled it to {over.compiled:,} bytes, over the budget of {budget:,.0f}; "
                f"re-planning at {over.next_budget:,.0f} bytes found no plan ({e}). {fix}",
                needed_bytes=over.compiled, budget_bytes=int(budget)) from None
    raise InfeasiblePlanError(
        f"memory: after {ROUNDS} re-plans at scaled budgets, {over.where} predicted "
        f"{over.predicted:,.0f} bytes per device, but XLA compiled it to {over.compiled:,} "
        f"bytes, over the budget of {budget:,.0f}. {fix}", needed_bytes=over.compiled,
        budget_bytes=int(budget))


def search_peak(plan: ParallelPlan) -> float:
    """The plan's peak per device as the search's memory rows count it (`IlpStats.
    peak_bytes`; the prediction where the plan does not record it): a search budget must go
    below it to change the plan."""
    return float(plan.ilp.get("peak_bytes") or plan.peak_memory_bytes)


def _first(budget: int | None, search) -> tuple[ParallelPlan, OpGraph, float, bool]:
    """(plan, graph, the search budget that made it, whether a plan may fit (1 - HEADROOM) of
    the budget) of `search` (`search(None)`: at the user's `budget`, which may be None);
    where the user set one, made at (1 - HEADROOM) of it first (where a plan predicted near
    the budget would be re-planned to, so that such a plan costs no second search), and at the
    budget itself where nothing fits below (then no headroom re-plan can find one either: each
    searches at most that). The plan carries the user's budget."""
    if budget is None:
        plan, graph = search(None)
        return plan, graph, float(plan.memory_budget_bytes), True
    target = int((1 - HEADROOM) * budget)
    try:
        plan, graph = search(target)
    except InfeasiblePlanError:
        log.info("autopar: nothing fits %.0f%% of the budget %s; re-planning at the budget",
                 100 * (1 - HEADROOM), f"{budget:,}")
        plan, graph = search(None)
        return plan, graph, float(budget), False
    return dataclasses.replace(plan, memory_budget_bytes=budget), graph, float(target), True


def _with_headroom(search, plan, graph, budget: float, ilp_budget: float):
    """(plan, graph, the search budget that made it): a plan predicted above (1 - HEADROOM)
    of `budget` re-planned, at most `ROUNDS` times, before anything is compiled, at a search
    budget scaled by target / predicted (the first time at most the target itself) and below
    the plan's own search peak by what the prediction exceeds the target (at most by half).
    The prediction counts what the search's memory rows do not (resharded copies), so a
    plan the search made for its budget can be predicted above it, and a plan well inside its
    search budget would come back unchanged from a budget cut less than that slack (the
    attention LM under `jax.grad` at 70%: three re-plans, the same plan). Where a re-plan
    finds nothing, the last plan is kept (its compile check decides)."""
    target = (1 - HEADROOM) * budget
    for _ in range(ROUNDS):
        if plan.peak_memory_bytes <= target:
            break
        peak = search_peak(plan)         # cut by the excess, at most by half
        scaled = min(ilp_budget * target / plan.peak_memory_bytes, target,
                     max(peak - (plan.peak_memory_bytes - target), peak / 2))
        log.info("autopar: the plan is predicted at %s bytes per device, above %.0f%% of the "
                 "budget %s; re-planning at a search budget of %s before compiling",
                 f"{plan.peak_memory_bytes:,.0f}", 100 * (1 - HEADROOM), f"{budget:,.0f}",
                 f"{scaled:,.0f}")
        try:
            plan, graph = search(scaled)
        except InfeasiblePlanError:
            log.info("autopar: nothing fits a search budget of %s bytes; the plan predicted at "
                     "%s is compiled and checked", f"{scaled:,.0f}",
                     f"{plan.peak_memory_bytes:,.0f}")
            break
        ilp_budget = scaled
    return plan, graph, ilp_budget


def _loosened(search, plan, graph, budget: float, ilp_budget: float):
    """(plan, graph, the search budget that made it): where the search's memory rows bound the
    plan (its search peak within `LOOSEN` of the search budget) and count it more than
    `LOOSEN` of the target above its prediction, one more search at the search budget raised
    by that excess; its plan is taken where it is predicted within the target and is faster.
    The rows count every temporary in a buffer of its own, while XLA places many in the
    buffers of the step's results (`intra_op.memory.hosted_temporaries`: which ones depends on
    the sizes of both, which linear rows cannot express), so a budget the rows find binding
    can leave the prediction far below it (a 2-layer GPT at 1.05 times the free plan's
    predicted peak: rows 704 KB, predicted 543 KB, a plan 1.39 times the free plan's time)."""
    target = (1 - HEADROOM) * budget
    peak = search_peak(plan)
    excess = peak - plan.peak_memory_bytes
    if excess <= LOOSEN * target or peak < (1 - LOOSEN) * ilp_budget:
        return plan, graph, ilp_budget
    looser = ilp_budget + excess
    log.info("autopar: the search's memory rows count the plan at %s bytes per device, %s above "
             "its prediction; searching once more at a search budget of %s",
             f"{peak:,.0f}", f"{excess:,.0f}", f"{looser:,.0f}")
    try:
        again, again_graph = search(looser)
    except InfeasiblePlanError:
        return plan, graph, ilp_budget
    if again.peak_memory_bytes <= target and again.predicted_step_s < plan.predicted_step_s:
        log.info("autopar: taken: predicted %s bytes per device, %.3gx the step time",
                 f"{again.peak_memory_bytes:,.0f}",
                 again.predicted_step_s / plan.predicted_step_s)
        return again, again_graph, looser
    log.info("autopar: not taken: predicted %s bytes per device (target %s), %.3gx the step "
             "time", f"{again.peak_memory_bytes:,.0f}", f"{target:,.0f}",
             again.predicted_step_s / plan.predicted_step_s)
    return plan, graph, ilp_budget


def verified_plan(method: ShardParallel,
                  plan_at: Callable[[ShardParallel], tuple[ParallelPlan, OpGraph]],
                  compile_plan: Callable[[ParallelPlan, OpGraph], tuple[Any, Any]],
                  ) -> Verified:
    """`plan_at(method)`, checked against XLA when its budget binds (see the module
    docstring). `compile_plan(plan, graph) -> (built, executable)` lowers and compiles.

    Raises:
      InfeasiblePlanError: no plan compiles within the budget after `ROUNDS` re-plans (or the
        scaled budget leaves no plan at all); it names the predicted and compiled bytes.
    """
    def search(at):       # `plan_at` at the search budget `at` (None: the method's own)
        return plan_at(method if at is None else
                       dataclasses.replace(method, memory_budget_bytes=int(at)))

    plan, graph, ilp_budget, room = _first(method.memory_budget_bytes, search)
    if not binding(plan):
        return Verified(plan, graph)
    budget = float(plan.memory_budget_bytes)
    if room:
        plan, graph, ilp_budget = _with_headroom(search, plan, graph, budget, ilp_budget)
        plan, graph, ilp_budget = _loosened(search, plan, graph, budget, ilp_budget)

    def measure(planned, round_):
        nonlocal ilp_budget
        plan, graph = planned
        built, executable = compile_plan(plan, graph)
        got = compiled_bytes(executable)
        plan = dataclasses.replace(plan, memory_budget_bytes=budget, measured={
            **plan.measured, "compiled_bytes": got, "memory_check_rounds": round_})
        if got is None or got <= budget:
            return (plan, graph), built, None
        ilp_budget = min(ilp_budget, search_peak(plan)) * budget / got
        return (plan, graph), built, Over("the plan", plan.peak_memory_bytes, got, ilp_budget)

    (plan, graph), built = replan_until_it_fits(
        (plan, graph), budget, measure, search,
        "Fix: raise memory_budget_bytes, use more devices, a smaller batch, or remat='full'.")
    return Verified(plan, graph, built)
