"""Verified memory: a single-mesh plan made under a binding memory budget is compiled and its
`memory_analysis()` checked against the budget, so "fits the budget" holds whatever the
memory model's error and whatever the backend's scheduler does.

The planner predicts the peak per device (`intra_op.memory`); XLA's scheduler and buffer
assignment decide the real one. When the prediction is within `BINDING` of the budget,
`verified_plan` compiles the lowered step (the executable is kept: the first call reuses it)
and reads arguments + outputs + temp - aliased. If that exceeds the budget, it re-plans with
the ILP's budget scaled down by budget / compiled (at most `ROUNDS` times, each logged) and
raises `InfeasiblePlanError` naming the predicted and compiled bytes if none fits. The plan
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
from dataclasses import dataclass
from typing import Any, Callable

from .errors import InfeasiblePlanError
from .graph import OpGraph
from .options import ShardParallel
from .plan import ParallelPlan

log = logging.getLogger(__name__)

BINDING = 0.5     # a budget binds when the predicted peak is at least this share of it
ROUNDS = 3        # re-plans at a scaled budget before giving up


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
    plan, graph = plan_at(method)
    if not binding(plan):
        return Verified(plan, graph)
    budget = float(plan.memory_budget_bytes)
    ilp_budget = budget
    for round_ in range(ROUNDS + 1):
        built, executable = compile_plan(plan, graph)
        got = compiled_bytes(executable)
        plan = dataclasses.replace(plan, memory_budget_bytes=budget, measured={
            **plan.measured, "compiled_bytes": got, "memory_check_rounds": round_})
        if got is None or got <= budget:
            return Verified(plan, graph, built)
        if round_ == ROUNDS:
            break
        ilp_budget *= budget / got
        log.warning("autopar: the plan predicted %s bytes per device but XLA compiled it to "
                    "%s, over the budget %s; re-planning at an ILP budget of %s (round %d of "
                    "%d)", f"{plan.peak_memory_bytes:,.0f}", f"{got:,}", f"{budget:,.0f}",
                    f"{ilp_budget:,.0f}", round_ + 1, ROUNDS)
        predicted = plan.peak_memory_bytes
        try:
            plan, graph = plan_at(dataclasses.replace(method,
                                                      memory_budget_bytes=int(ilp_budget)))
        except InfeasiblePlanError as e:
            raise InfeasiblePlanError(
                f"memory: the plan predicted {predicted:,.0f} bytes per device, but XLA "
                f"compiled it to {got:,} bytes, over the budget of {budget:,.0f}; re-planning "
                f"at {ilp_budget:,.0f} bytes found no plan ({e}). Fix: raise "
                "memory_budget_bytes, use more devices, a smaller batch, or remat='full'.",
                needed_bytes=got, budget_bytes=int(budget)) from None
    raise InfeasiblePlanError(
        f"memory: after {ROUNDS} re-plans at scaled budgets the plan predicted "
        f"{plan.peak_memory_bytes:,.0f} bytes per device, but XLA compiled it to {got:,} "
        f"bytes, over the budget of {budget:,.0f}. Fix: raise memory_budget_bytes, use more "
        "devices, a smaller batch, or remat='full'.", needed_bytes=got,
        budget_bytes=int(budget))
