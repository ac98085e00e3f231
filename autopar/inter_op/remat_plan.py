"""Rematerialization on one mesh (ShardParallel and its data / ZeRO variants): when the fastest
plan does not fit the memory budget, rewrite the traced step to recompute some of its forward
layers in the backward pass (`step_remat`) and plan it again, recomputing as little as fits.

Any gradient the step takes will do: `jax.value_and_grad`, `jax.grad`, `nnx.value_and_grad`,
`eqx.filter_value_and_grad` or `autopar.value_and_grad` (the rewrite reads the backward pass
JAX traced). The forward is cut at the user's `mark_stage_boundary` calls, else into as many
layers as the model repeats blocks (else `DEFAULT_LAYERS`); `step_remat.candidates` orders the
per-layer choices from the least recomputation to the most; memory falls along it, so bisection
finds the first that fits in about log2(2L) + 1 ILP solves. The plan keeps the fingerprint of
the step as the user wrote it (a saved plan matches the same call) and records the choice and
the fingerprint of the rewritten step (`ParallelPlan.remat`), which `traced_for` re-creates for
lowering.

Example:
    >>> plan, graph = plan_step(graph, plan_of, method)
"""
from __future__ import annotations

import bisect
import dataclasses
import logging
import time
from collections.abc import Callable

from autopar.core import progress
from autopar.core.enums import Remat
from autopar.core.errors import InfeasiblePlanError, PlanMismatchError, UnsupportedError
from autopar.core.graph import OpGraph
from autopar.core.options import ShardParallel
from autopar.core.plan import ParallelPlan, graph_fingerprint
from autopar.inter_op.step_remat import (
    StepRemat,
    candidates,
    forward_layers,
    forward_nodes,
    rematerialize,
    user_remats,
)
from autopar.intra_op.layers import find_family

log = logging.getLogger(__name__)

DEFAULT_LAYERS = 4        # layers of a forward with no repeated blocks

PlanOf = Callable[[OpGraph], ParallelPlan]


def step_layers(graph: OpGraph) -> tuple[int, ...] | None:
    """The layer boundaries of the step's forward pass (positions in
    `step_remat.forward_nodes`): at the user's `mark_stage_boundary` calls where there are
    some, else one layer per repeated block, else `DEFAULT_LAYERS`; None when the step takes
    no gradient."""
    fwd = forward_nodes(graph)
    if not fwd:
        return None
    marked = sorted({bisect.bisect_left(fwd, m.position) for m in graph.stage_markers
                     if not m.backward} - {0, len(fwd)})
    if marked:
        return (0, *marked, len(fwd))
    family = find_family(graph)
    return forward_layers(graph, family[1] if family else DEFAULT_LAYERS)


def _no_gradient(method: ShardParallel) -> UnsupportedError:
    return UnsupportedError(
        f"{type(method).__name__}(remat={method.remat.value!r}): this step takes no gradient "
        "(no backward pass in its trace), so there is no activation to recompute. Fix: use "
        "remat='none', or take the gradient inside the step (jax.value_and_grad, jax.grad, "
        "nnx.value_and_grad or autopar.value_and_grad).")


def plan_step(graph: OpGraph, plan_of: PlanOf, method: ShardParallel, *,
              tied: bool = True) -> tuple[ParallelPlan, OpGraph]:
    """(plan, the graph it was made for): `plan_of(graph)` when it fits or `method.remat` is
    "none"; otherwise the step rewritten (`step_remat.rematerialize`) with the least
    recomputation that fits; `tied`: `StepRemat.tied` (the cluster's
    `hoists_recomputation()`).

    Raises:
      InfeasiblePlanError: nothing fits, even recomputing every layer from its input (its
        `needed_bytes` is what that plan needs).
      UnsupportedError: remat is "selective" / "full" but the step takes no gradient.
    """
    t0 = time.perf_counter()
    first_error = None
    if method.remat in (Remat.NONE, Remat.AUTO):
        try:
            return _as_written(graph, plan_of, tied)
        except InfeasiblePlanError as e:
            if method.remat == Remat.NONE:
                raise
            first_error = e
    bounds = step_layers(graph)
    if bounds is None:
        if first_error is not None:
            raise first_error
        raise _no_gradient(method)
    num = len(bounds) - 1
    cands = candidates(num) if method.remat == Remat.AUTO else [(method.remat,) * num]
    tried: dict[int, tuple[ParallelPlan, OpGraph] | InfeasiblePlanError] = {}

    def attempt(i: int):
        if i not in tried:
            remat = StepRemat(boundaries=bounds, choices=cands[i], tied=tied)
            g = rematerialize(graph, remat)
            try:
                tried[i] = (_recorded(plan_of(g), graph, g, remat), g)
            except InfeasiblePlanError as e:
                tried[i] = e
        return tried[i]

    last = attempt(len(cands) - 1)
    if isinstance(last, InfeasiblePlanError):
        raise InfeasiblePlanError(
            f"{last} Recomputation does not help enough: with every one of the step's {num} "
            f"layer(s) recomputed from its input (remat='full') the least plan needs "
            f"{last.needed_bytes:,} bytes per device.", needed_bytes=last.needed_bytes,
            budget_bytes=last.budget_bytes) from None
    lo, hi = 0, len(cands) - 1        # cands[hi] fits; find the first that does
    while lo < hi:
        mid = (lo + hi) // 2
        if isinstance(attempt(mid), InfeasiblePlanError):
            lo = mid + 1
        else:
            hi = mid
    plan, g = attempt(hi)
    progress.note("rematerialization search", f"{'/'.join(c.value for c in cands[hi])} "
                  f"after {len(tried)} plan(s)", time.perf_counter() - t0)
    log.info("autopar: rematerialization %s chosen for the forward's %d layers after %d plan(s) "
             "in %.2f s", "/".join(c.value for c in cands[hi]), num, len(tried),
             time.perf_counter() - t0)
    return dataclasses.replace(plan, timings_s={**plan.timings_s, "remat_search":
                                                time.perf_counter() - t0}), g


def _as_written(graph: OpGraph, plan_of: PlanOf, tied: bool) -> tuple[ParallelPlan, OpGraph]:
    """The plan recomputing nothing but what the user's own `jax.checkpoint`s do; where the
    backend would run their recomputation early (`tied`), they are tied to the backward pass
    (`step_remat.user_remats`): the plan records that rewrite (one layer, "none")."""
    fwd = forward_nodes(graph)
    if not (tied and fwd and user_remats(graph)):
        return plan_of(graph), graph
    remat = StepRemat(boundaries=(0, len(fwd)), choices=(Remat.NONE,), tied=True)
    g = rematerialize(graph, remat)
    return _recorded(plan_of(g), graph, g, remat), g


def _recorded(plan: ParallelPlan, graph: OpGraph, traced: OpGraph,
              remat: StepRemat) -> ParallelPlan:
    """`plan` (made for `traced`) named by the user's step `graph`, with the remat record."""
    return dataclasses.replace(plan, graph_fingerprint=graph_fingerprint(graph), remat={
        **remat.to_json(), "graph_fingerprint": graph_fingerprint(traced)})


def traced_for(plan: ParallelPlan, graph: OpGraph) -> OpGraph:
    """The graph `plan` was made for: `graph` itself, or the step rewritten with the plan's
    rematerialization (checked against the fingerprint the plan recorded)."""
    if not plan.remat:
        return graph
    traced = rematerialize(graph, StepRemat.from_json(plan.remat))
    if graph_fingerprint(traced) != plan.remat.get("graph_fingerprint"):
        raise PlanMismatchError(
            "the plan's rematerialization was made for a different step: rewriting with it "
            f"gives fingerprint {graph_fingerprint(traced)}, the plan recorded "
            f"{plan.remat.get('graph_fingerprint')}. Fix: re-plan.")
    return traced
