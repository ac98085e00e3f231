"""The costs the stage search weighs: a stage's static memory and latency as the DP counts
them (optimizer state with or without ZeRO, its per-step all-gather), the per-layer option
arrays, the reshards between consecutive layers of a stage, and the DP over them with the
re-ranking of its best layouts by whole-stage solves. Pure functions of stage solutions and
numpy arrays; `stages._auto` drives them.
"""
from __future__ import annotations

import logging

import numpy as np

from autopar.core.errors import InfeasiblePlanError, InvalidArgumentError
from autopar.core.plan import StageSolution
from autopar.inter_op.batch import run_jobs
from autopar.inter_op.pipeline import slice_range
from autopar.inter_op.stage_dp import StageCosts, solve_stage_dp
from autopar.inter_op.stage_solve import is_float, stage_io

log = logging.getLogger(__name__)


def held_bytes(sol: StageSolution, opt_ratio: float, zero: bool = False) -> float:
    """Params, gradient accumulator and optimizer state (split over the data axis with ZeRO):
    held for the whole step; none in a forward-only stage (its parameters are resident)."""
    if not sol.trains:
        return 0.0
    return sol.param_bytes + sol.optimizer_bytes(opt_ratio, zero)


def resident_bytes(sol: StageSolution) -> float:
    """Bytes of one microbatch's peak that stay live to the end of the stage's step: its
    parameters (inputs) and their gradients (outputs, live from their backward on). In a span
    of layers every layer's are live at its first layer's backward, so a span sums them."""
    return sol.param_bytes + sol.grad_bytes


def working_bytes(sol: StageSolution) -> float:
    """The working memory of one microbatch beyond its kept activations and its resident
    bytes (transient: the layers of a stage run one at a time, so a span needs its layers'
    largest, not their sum); what a later layer's weight-gradient tail reads
    (`StageSolution.deferred_bytes`) is still live during an earlier layer's backward (see
    `span_static_bytes`)."""
    return max(sol.peak_memory_bytes - sol.activation_bytes - resident_bytes(sol), 0.0)


def span_static_bytes(held: np.ndarray, work: np.ndarray, deferred: np.ndarray) -> np.ndarray:
    """[L, ...] from per-layer [L, ...] arrays: the static bytes of the span of layers 0..j,
    for every j: its layers' held and resident bytes summed (`span_held_bytes`, as `held`),
    plus the most any layer l's backward needs, its working memory with the deferred bytes
    of the layers after it (their backward ran first; their weight gradients run at the
    stage's end): max over l <= j of work[l] + sum(deferred[l + 1..j]).

        >>> span_static_bytes(np.zeros(3), np.array([5.0, 1.0, 1.0]), np.array([1.0, 1.0, 1.0]))
        array([5., 6., 7.])
    """
    after = np.cumsum(deferred, axis=0)           # deferred[0..j]
    return (np.cumsum(held, axis=0) + after
            + np.maximum.accumulate(work - after, axis=0))


def span_held_bytes(sol: StageSolution, opt_ratio: float, zero: bool = False) -> float:
    """What a layer adds to every span holding it whole: `held_bytes` and `resident_bytes`."""
    return held_bytes(sol, opt_ratio, zero) + resident_bytes(sol)


def static_bytes(sol: StageSolution, opt_ratio: float, zero: bool = False) -> float:
    """`span_held_bytes` plus `working_bytes`: a stage's memory besides its in-flight
    activations."""
    return working_bytes(sol) + span_held_bytes(sol, opt_ratio, zero)


def latency(sol: StageSolution, zero: bool, num_microbatches: int) -> float:
    """A stage's microbatch latency as the DP counts it: ZeRO's per-step all-gather of the
    updated parameters is spread over the step's microbatches."""
    return sol.latency_s + (sol.zero_gather_s / num_microbatches if zero else 0.0)


RERANK = 3      # the DP's best candidates re-ranked by their whole-stage solves
# An alternative layout whose DP latency is above RERANK_WITHIN x the choice's is not worth
# solving layer plans for (`lazy_options.exact_dp`'s `within`): a layout solved whole is at
# most its layers' sum, and was never seen to win by such a margin.
RERANK_WITHIN = 2.0


def reranked(choice, dp, options, budget, solved, num_microbatches, seen=None):
    """The DP's choice and its best alternatives with fewer stages (the DP rerun with
    `max_stages` = 1 .. S - 1), `RERANK` in all by the DP's latency, each solved whole: the
    one whose solved stages give the shortest pipeline wins (the DP sums separately solved
    layers; a stage solved whole shares shardings across them). Ties keep the DP's order.
    `seen` (a list) receives (stages or None, pipeline latency or None, error or None) per
    candidate solved, for the plan's runner-ups."""
    cands = {(choice.layer_spans, choice.submeshes): choice}
    for k in range(1, choice.num_stages):
        alt = try_dp(dp, options, budget, max_stages=k,
                     within=RERANK_WITHIN * choice.total_latency_s)
        if alt is not None:
            cands.setdefault((alt.layer_spans, alt.submeshes), alt)
    ranked = sorted(cands.values(), key=lambda c: c.total_latency_s)[:RERANK]
    best, best_t, error = None, np.inf, None
    for cand in ranked:
        try:
            stages = solved(cand)
        except InfeasiblePlanError as e:
            error = error or e
            if seen is not None:
                seen.append((None, None, e))
            continue
        lat = [latency(st.solution, st.zero, num_microbatches) for st in stages]
        t = sum(lat) + (num_microbatches - 1) * max(lat)
        if seen is not None:
            seen.append((stages, t, None))
        if t < best_t * (1 - 1e-9):
            best, best_t = stages, t
    if best is None:
        raise error
    if len(ranked) > 1:
        log.info("autopar: %d stage layouts re-ranked by whole-stage solves; %d stage(s) "
                 "chosen (%.4g s per step predicted)", len(ranked), len(best), best_t)
    return best


def zero_variant(sols, lat, held, opt_ratio: float, num_microbatches: int):
    """(latency, held bytes) of the layer plans `sols` with ZeRO (see `span_held_bytes`,
    `latency`), or None where ZeRO would split nothing."""
    zlat, zheld, split = lat.copy(), held.copy(), False
    for l, row in enumerate(sols):
        for p, sol in enumerate(row):
            if sol is not None and sol.zero_split_bytes > 0:
                split = True
                zlat[l, p] = latency(sol, True, num_microbatches)
                zheld[l, p] = span_held_bytes(sol, opt_ratio, True)
    return (zlat, zheld) if split else None


def boundary_costs(loss, boundaries, sols, meshes) -> np.ndarray:
    """[L, P]: per microbatch, the seconds to reshard what layer l hands layer l + 1 when both
    sit in one stage on option p: each tensor from layer l's output spec to layer l + 1's
    input spec, and its cotangent back (what the DP's summed layer plans leave unpriced)."""
    num, width = len(sols), len(meshes)
    out = np.zeros((num, width))
    fwd = loss.forward
    ios = [stage_io(loss, slice_range(loss, boundaries[l], boundaries[l + 1], l))
           for l in range(num)]
    for l in range(num - 1):
        made, used = ios[l], ios[l + 1]
        for p in range(width):
            a, b = sols[l][p], sols[l + 1][p]
            if a is None or b is None:
                continue
            outs = dict(zip((*made.float_outputs, *made.int_outputs), a.out_specs))
            acts = dict(zip((*used.float_acts, *used.int_acts), b.act_specs))
            for t in sorted(outs.keys() & acts.keys()):
                ten, cost = fwd.tensors[t], meshes[p]
                out[l, p] += cost.reshard_s(ten.shape, ten.itemsize, outs[t], acts[t])
                if is_float(ten.dtype):
                    out[l, p] += cost.reshard_s(ten.shape, ten.itemsize, acts[t], outs[t])
    return out


def try_dp(dp, options, budget, **kw):
    """The DP's choice, or None where no assignment fits `budget` (or a layer has no plan of
    this kind at all, which the DP reports as an invalid cost array, or none beats an
    `incumbent=` price)."""
    try:
        return dp(options, budget=budget, **kw)
    except (InfeasiblePlanError, InvalidArgumentError):
        return None


def layer_values(sol: StageSolution | None, opt_ratio: float) -> tuple[float, ...]:
    """(latency, held, activation, working, deferred, weight bytes) of a layer plan as the DP
    prices it (`span_held_bytes`, `working_bytes`; weight: what a microbatch keeps from its B
    to its W, `StageSolution.weight_bytes`); inf latency where there is none."""
    if sol is None:
        return np.inf, 0.0, 0.0, 0.0, 0.0, 0.0
    return (sol.latency_s, span_held_bytes(sol, opt_ratio), sol.activation_bytes,
            working_bytes(sol), sol.deferred_bytes, sol.weight_bytes)


def layer_options(loss, boundaries, submeshes, shapes_per_k, pairs, solve, opt_ratio,
                  pool=None, bound=None, lazy_pairs=frozenset()):
    """Per layer and (submesh, view) pair: the latency, held, activation, working, deferred
    and weight bytes (`layer_values`) of the plan `solve(slice, submesh, shape)` gives
    (`StageSolver.solve`: fastest; `.lean`: memory-lean; under one rematerialization), the
    plans, and which cells are pending; inf latency where it gives none. The pairs in
    `lazy_pairs` are priced by `bound(slice, submesh, shape)` ((latency, parameter bytes,
    peak bytes) lower bounds, `StageSolver.bound`) and left pending (see `lazy_options`):
    held = the parameter bytes, working = the peak, no activations or deferred bytes, which
    bound every span's memory as the DP counts it from below. The other jobs' ILPs are solved
    in `pool`'s worker processes (`batch.run_jobs`; the same plans with any number)."""
    shape = (len(boundaries) - 1, len(pairs))
    lat = np.full(shape, np.inf)
    held, act, work, deferred, weight = (np.zeros(shape) for _ in range(5))
    pending = np.zeros(shape, dtype=bool)
    sols = [[None] * shape[1] for _ in range(shape[0])]
    slices = [slice_range(loss, boundaries[l], boundaries[l + 1], l) for l in range(shape[0])]
    jobs = [(l, p) for l in range(shape[0]) for p in range(len(pairs)) if p not in lazy_pairs]
    for l in range(shape[0]):
        for p in sorted(lazy_pairs):
            lat[l, p], held[l, p], work[l, p] = bound(slices[l], *cell_place(
                submeshes, shapes_per_k, pairs, p))
            pending[l, p] = bool(np.isfinite(lat[l, p]))
    for (l, p), sol in zip(jobs, solve_cells(loss, boundaries, submeshes, shapes_per_k, pairs,
                                             solve, jobs, pool, slices)):
        sols[l][p] = sol
        (lat[l, p], held[l, p], act[l, p], work[l, p], deferred[l, p],
         weight[l, p]) = layer_values(sol, opt_ratio)
    return lat, held, act, work, deferred, weight, sols, pending


def cell_place(submeshes, shapes_per_k, pairs, p: int):
    """(submesh (hosts, devices per host), logical view) of (submesh, view) pair p."""
    k, v = pairs[p]
    return (submeshes[k].num_hosts, submeshes[k].devices_per_host), shapes_per_k[k][v]


def solve_cells(loss, boundaries, submeshes, shapes_per_k, pairs, solve, cells, pool,
                slices=None) -> list:
    """`solve(slice, submesh, view)` of every (layer, pair) in `cells`, their ILPs in `pool`'s
    workers (`batch.run_jobs`)."""
    def job(lp):
        l, p = lp
        sl = slices[l] if slices is not None else slice_range(loss, boundaries[l],
                                                              boundaries[l + 1], l)
        return solve(sl, *cell_place(submeshes, shapes_per_k, pairs, p))
    return run_jobs(cells, job, pool, "layer plans")


def run_dp(options, *, submeshes, ks, device_ids, method, option, budget, max_stages=None,
           banned=(), deferred=False, kept=None, bubble=1.0, incumbent=np.inf,
           t_max_below=np.inf):
    """The stage DP over spans of layers on every option (a (submesh, view) pair per kind of
    layer plan: fast or lean, under one rematerialization), each (latency, held, activation,
    boundary, working, deferred, pending, weight) arrays; a span's costs are its layers'
    summed, except the working memory: its largest layer's, with `deferred` the deferred bytes
    of the layers after it added (`span_static_bytes`: what the span needs with each layer's
    own plan; a plan of the span solved whole may shard them further, so this prices some
    spans above what they need whole). `banned` (first layer, last layer, pair): no span
    holding those layers is offered on that pair (of any kind). `kept` and `bubble`: the
    schedule's memory and objective (`solve_stage_dp`; default 1F1B's); `incumbent` and
    `t_max_below`: only a layout priced below the one, its slowest stage below the other, is
    wanted (None where there is none)."""
    lat, held, act, bound, work, later = (np.concatenate([o[i] for o in options], axis=1)
                                          for i in range(6))
    weight = np.concatenate([o[7] for o in options], axis=1) if kept is not None else None
    if not deferred:
        later = np.zeros_like(later)
    num_layers = lat.shape[0]
    span_lat = np.full((num_layers, num_layers, lat.shape[1]), np.inf)
    span_static, span_act, span_weight = (np.zeros_like(span_lat) for _ in range(3))
    for i in range(num_layers):
        # layers i..j: their latencies, and the reshards between consecutive ones
        inner = np.concatenate([np.zeros((1, lat.shape[1])), np.cumsum(bound[i:-1], axis=0)])
        span_lat[i, i:] = np.cumsum(lat[i:], axis=0) + inner
        span_static[i, i:] = span_static_bytes(held[i:], work[i:], later[i:])
        span_act[i, i:] = np.cumsum(act[i:], axis=0)
        if weight is not None:       # priced only where a schedule's states defer W's
            span_weight[i, i:] = np.cumsum(weight[i:], axis=0)
    width = len(ks)
    for i, j, pair in banned:
        span_lat[:i + 1, j:, pair::width] = np.inf
    finite = np.isfinite(span_lat)
    costs = StageCosts(latency_s=span_lat, static_bytes=np.where(finite, span_static, 0.0),
                       activation_bytes=np.where(finite, span_act, 0.0),
                       weight_bytes=np.where(finite, span_weight, 0.0),
                       memory_budget_bytes=budget)
    subs = [submeshes[k] for k in ks] * len(options)
    caps = [c for c in (option.max_stages, max_stages) if c is not None]
    return solve_stage_dp(costs, subs, len(device_ids), method.num_microbatches,
                          max_stages=min(caps) if caps else None, kept=kept, bubble=bubble,
                          incumbent=incumbent, t_max_below=t_max_below)
