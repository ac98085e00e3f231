"""Rematerialization on one mesh (ShardParallel and its data / ZeRO variants): when the fastest
plan does not fit the memory budget, re-trace the step with the loss's layers under
`jax.checkpoint` and plan it again, recomputing as little as fits.

The loss is the jaxpr of the step's `autopar.value_and_grad` marker; its forward graph is cut
into layers (at `mark_stage_boundary` calls, else by the layer clustering into as many layers
as the model repeats blocks). `remat.candidates` orders the per-layer choices from the least
recomputation to the most; memory falls along it, so bisection finds the first that fits in
about log2(2L) + 1 ILP solves. The plan keeps the fingerprint of the step as the user wrote it
(a saved plan matches the same call) and records the choice and the fingerprint of the step
traced with it (`ParallelPlan.remat`), which `traced_for` re-creates for lowering.

Example:
    >>> plan, graph = plan_step(graph, retrace, plan_of, method)
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

from autopar.core import progress
from autopar.core.enums import Remat
from autopar.core.errors import InfeasiblePlanError, PlanMismatchError, UnsupportedError
from autopar.core.graph import OpGraph
from autopar.core.options import AutoLayerOption, ManualLayerOption, ShardParallel
from autopar.core.plan import ParallelPlan, graph_fingerprint
from autopar.frontend.grad import VALUE_AND_GRAD
from autopar.inter_op.pipeline import layer_boundaries
from autopar.inter_op.remat import LossRemat, candidates, loss_forward, remat_expand
from autopar.intra_op.layers import find_family

log = logging.getLogger(__name__)

DEFAULT_LAYERS = 4        # layers of a loss with no repeated blocks and no markers

Retrace = Callable[..., OpGraph]          # retrace(expand=None | keep_grad=True) -> OpGraph
PlanOf = Callable[[OpGraph], ParallelPlan]


def loss_layers(step_with_marker: OpGraph) -> tuple[int, ...] | None:
    """The layer boundaries of the step's loss (node indices of its forward graph), or None
    when the step has not exactly one `autopar.value_and_grad` marker."""
    marks = [n for n in step_with_marker.nodes if n.primitive == VALUE_AND_GRAD]
    if len(marks) != 1:
        return None
    forward = loss_forward(marks[0].eqn.params["jaxpr"])
    if any(not m.backward for m in forward.stage_markers):
        return tuple(layer_boundaries(forward, ManualLayerOption()))
    family = find_family(forward)
    num = family[1] if family else DEFAULT_LAYERS
    return tuple(layer_boundaries(forward, AutoLayerOption(num_layers=num)))


def _no_marker(method: ShardParallel) -> UnsupportedError:
    return UnsupportedError(
        f"{type(method).__name__}(remat={method.remat.value!r}): on one mesh autopar "
        "rematerializes the loss of an `autopar.value_and_grad` / `autopar.grad` call, and "
        "this step has none (or several); with jax.grad the loss cannot be told apart. Fix: "
        "take the gradient with `autopar.value_and_grad(loss_fn)(params, ...)` once per step, "
        "or wrap the layers in `jax.checkpoint` yourself and use remat='none'.")


def plan_step(graph: OpGraph, retrace: Retrace, plan_of: PlanOf,
              method: ShardParallel) -> tuple[ParallelPlan, OpGraph]:
    """(plan, the graph it was made for): `plan_of(graph)` when it fits or `method.remat` is
    "none"; otherwise the step re-traced (`retrace(expand=...)`) with the least
    recomputation that fits.

    Raises:
      InfeasiblePlanError: nothing fits, even recomputing every layer from its input (its
        `needed_bytes` is what that plan needs).
      UnsupportedError: remat is "selective" / "full" but the step has no
        `autopar.value_and_grad` marker.
    """
    t0 = time.perf_counter()
    first_error = None
    if method.remat in (Remat.NONE, Remat.AUTO):
        try:
            return plan_of(graph), graph
        except InfeasiblePlanError as e:
            if method.remat == Remat.NONE:
                raise
            first_error = e
    bounds = loss_layers(retrace(keep_grad=True))
    if bounds is None:
        if first_error is not None:
            raise InfeasiblePlanError(
                f"{first_error} (autopar could not rematerialize: the step takes no "
                "`autopar.value_and_grad`; with it, remat='auto' recomputes activations to "
                "fit.)", needed_bytes=first_error.needed_bytes,
                budget_bytes=first_error.budget_bytes) from None
        raise _no_marker(method)
    num = len(bounds) - 1
    cands = candidates(num) if method.remat == Remat.AUTO else [(method.remat,) * num]
    tried: dict[int, tuple[ParallelPlan, OpGraph] | InfeasiblePlanError] = {}

    def attempt(i: int):
        if i not in tried:
            remat = LossRemat(boundaries=bounds, choices=cands[i])
            g = retrace(expand=remat_expand(remat))
            try:
                tried[i] = (_recorded(plan_of(g), graph, g, remat), g)
            except InfeasiblePlanError as e:
                tried[i] = e
        return tried[i]

    last = attempt(len(cands) - 1)
    if isinstance(last, InfeasiblePlanError):
        raise InfeasiblePlanError(
            f"{last} Recomputation does not help enough: with every one of the loss's {num} "
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
    log.info("autopar: rematerialization %s chosen for the loss's %d layers after %d plan(s) "
             "in %.2f s", "/".join(c.value for c in cands[hi]), num, len(tried),
             time.perf_counter() - t0)
    return dataclasses.replace(plan, timings_s={**plan.timings_s, "remat_search":
                                                time.perf_counter() - t0}), g


def _recorded(plan: ParallelPlan, graph: OpGraph, traced: OpGraph,
              remat: LossRemat) -> ParallelPlan:
    """`plan` (made for `traced`) named by the user's step `graph`, with the remat record."""
    return dataclasses.replace(plan, graph_fingerprint=graph_fingerprint(graph), remat={
        **remat.to_json(), "graph_fingerprint": graph_fingerprint(traced)})


def traced_for(plan: ParallelPlan, graph: OpGraph, retrace: Retrace) -> OpGraph:
    """The graph `plan` was made for: `graph` itself, or the step re-traced with the plan's
    rematerialization (checked against the fingerprint the plan recorded)."""
    if not plan.remat:
        return graph
    traced = retrace(expand=remat_expand(LossRemat.from_json(plan.remat)))
    if graph_fingerprint(traced) != plan.remat.get("graph_fingerprint"):
        raise PlanMismatchError(
            "the plan's rematerialization was made for a different step: re-tracing with it "
            f"gives fingerprint {graph_fingerprint(traced)}, the plan recorded "
            f"{plan.remat.get('graph_fingerprint')}. Fix: re-plan.")
    return traced
