"""The inter-op pass: layers -> pipeline stages, each with a submesh, a logical mesh and its
intra-op plan (Alpa §5.2).

`AutoStageOption` solves the intra-op ILP once per (layer, submesh, logical mesh), reusing
the result for layers whose training graphs are identical; a span's cost is the sum of its
layers' costs on one logical mesh (boundary resharding inside a stage is not priced); the DP
in `stage_dp` picks the spans and submeshes. The chosen stages are then solved whole for their
shardings. `UniformStageOption` and `ManualStageOption` skip the DP.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import time
from dataclasses import dataclass

import numpy as np

from ..cluster import ClusterSpec
from ..errors import InfeasiblePlanError, InvalidArgumentError
from ..graph import InputRole, OpGraph
from ..options import (AutoStageOption, ManualStageOption, PipeshardParallel, ShardParallel,
                       UniformStageOption)
from ..plan import graph_fingerprint
from ..runtime.schedule import make_schedule
from .batch import ilp_scope, run_jobs
from .parallel import PlanPool, plan_workers
from .pipeline import LossGraph, StageSlice, slice_range
from .remat import Remat, choices_of, with_remat
from .stage_dp import StageCosts, candidate_submeshes, solve_stage_dp
from .stage_solve import (StageSolution, stage_batch_sources, stage_input_paths, stage_problem,
                          trace_stage)

log = logging.getLogger(__name__)
AXIS_NAMES = ("data", "model")


@dataclass(frozen=True, slots=True, kw_only=True)
class ChosenStage:
    slice: StageSlice
    layers: tuple[int, int]              # first, last layer
    submesh: tuple[int, int]             # hosts, devices per host
    device_ids: tuple[int, ...]
    solution: StageSolution
    graph: OpGraph                       # the stage's training graph (solution's tensor ids)
    peak_bytes: float = 0.0              # per device: state, accumulator, working memory and
                                         # the schedule's in-flight activations
    remat: Remat = Remat.NONE            # what its layers keep for the backward


@dataclass(frozen=True, slots=True, kw_only=True)
class InterOpResult:
    boundaries: tuple[int, ...]          # layer start nodes + end
    stages: tuple[ChosenStage, ...]
    num_ilps: int                        # distinct ILPs solved
    num_reused: int                      # stage/layer solves answered from the cache
    num_replayed: int = 0                # stages whose solution came with a saved plan
    dp_candidates: int
    dp_pruned: int
    dp_time_s: float
    profile_time_s: float


def logical_shapes(n: int, option: str = "all") -> list[tuple[int, int]]:
    """2-D views of n devices: (1, n), (n, 1) for "flat"; every a x b = n for "all"."""
    if option == "flat":
        return list(dict.fromkeys([(1, n), (n, 1)]))
    return [(a, n // a) for a in range(1, n + 1) if n % a == 0]


class _Solver:
    """Solves stage ILPs: each (training graph, submesh, logical shape) is built once (with
    every memory point, so it can be solved at any budget) and its solutions are cached by
    budget. A stage's training graph depends on its rematerialization (`remat`, every
    method below): its layers run under `jax.checkpoint` with that choice's policy."""

    def __init__(self, loss: LossGraph, cluster: ClusterSpec, method: ShardParallel,
                 boundaries: tuple[int, ...]):
        self.loss, self.cluster, self.method = loss, cluster, method
        self.boundaries = boundaries
        self.losses: dict[Remat, LossGraph] = {Remat.NONE: loss}
        self.cache: dict = {}
        self.problems: dict = {}
        self.graphs: dict[tuple, tuple[OpGraph, str]] = {}
        self.num_ilps = self.num_reused = self.num_replayed = 0
        self.pool: PlanPool | None = None     # worker processes for `_layer_options`' ILPs
        self.needed: dict[tuple[int, int], float] = {}  # slice -> least bytes it needed
        self.opt_ratio = _opt_ratio(loss.step)

    def graph(self, sl: StageSlice, remat: Remat = Remat.NONE) -> tuple[OpGraph, str]:
        key = (sl.start, sl.stop, remat)
        if key not in self.graphs:
            if remat not in self.losses:
                layers = len(self.boundaries) - 1
                self.losses[remat] = dataclasses.replace(self.loss, forward=with_remat(
                    self.loss.forward, self.boundaries, (remat,) * layers))
            g = trace_stage(self.losses[remat], sl)
            self.graphs[key] = (g, graph_fingerprint(g))
        return self.graphs[key]

    def problem(self, sl: StageSlice, submesh: tuple[int, int], shape: tuple[int, int],
                remat: Remat = Remat.NONE):
        """The stage's built ILP and its cache key; layers with identical training graphs
        share one."""
        graph, fp = self.graph(sl, remat)
        paths = stage_input_paths(self.loss, sl) if self.method.sharding_rules else ()
        key = (fp, submesh, shape, paths)
        if key not in self.problems:
            sub = self.cluster.with_(num_hosts=submesh[0], devices_per_host=submesh[1])
            self.problems[key] = stage_problem(
                graph, sl, sub, shape, AXIS_NAMES, self.method, paths, points_above=0.0,
                batch_sources=stage_batch_sources(self.loss, sl, graph))
        return self.problems[key], key

    def solve(self, sl: StageSlice, submesh: tuple[int, int], shape: tuple[int, int],
              budget: float | None = None, remat: Remat = Remat.NONE) -> StageSolution | None:
        """The fastest plan of the stage; with `budget`, the fastest whose ILP peak fits it."""
        floor = self.floor(sl, submesh)
        if floor > self.budget:
            self._need(sl, floor)
            return None
        prob, key = self.problem(sl, submesh, shape, remat)
        return self._cached(sl, (key, budget), lambda: prob.solve(budget))

    def fitting(self, sl: StageSlice, submesh: tuple[int, int], shape: tuple[int, int],
                in_flight: int, remat: Remat = Remat.NONE) -> StageSolution | None:
        """The fastest plan whose pipeline peak (one microbatch's peak, the optimizer state of
        its parameters, and `in_flight - 1` more microbatches' activations) fits the budget:
        the DP's memory formula, as an ILP constraint."""
        if self.floor(sl, submesh) > self.budget:
            return self.solve(sl, submesh, shape)     # None, and the need recorded
        prob, key = self.problem(sl, submesh, shape, remat)
        return self._cached(sl, (key, "fitting", in_flight), lambda: prob.solve(
            self.budget, opt_ratio=self.opt_ratio, in_flight=in_flight))

    def _cached(self, sl: StageSlice, key, solve) -> StageSolution | None:
        if key in self.cache:
            self.num_reused += 1
            return self.cache[key]
        try:
            with ilp_scope(key):      # in a batch (batch.run_jobs), its ILPs go to the pool
                sol = solve()
        except InfeasiblePlanError as e:
            sol = None
            self._need(sl, e.needed_bytes)
        self.num_ilps += 1
        self.cache[key] = sol
        return sol

    @property
    def budget(self) -> float:
        return float(self.method.memory_budget_bytes or self.cluster.memory_bytes)

    def _need(self, sl: StageSlice, needed: float) -> None:
        span = (sl.start, sl.stop)
        self.needed[span] = min(self.needed.get(span, float("inf")), needed)

    def floor(self, sl: StageSlice, submesh: tuple[int, int]) -> float:
        """A lower bound of the stage's memory per device on `submesh`: its parameters and
        their optimizer state, split over every device. Above the budget, no plan of it on
        that submesh can be part of a pipeline that fits, so none is built."""
        graph = self.graph(sl)[0]
        params = sum(graph.tensors[t].nbytes for t in graph.inputs[:len(sl.param_inputs)])
        return params * (1 + self.opt_ratio) / (submesh[0] * submesh[1])

    def lean(self, sl: StageSlice, submesh: tuple[int, int], shape: tuple[int, int],
             remat: Remat = Remat.NONE) -> StageSolution | None:
        """The fastest plan within 5% of the least memory the stage can take: the
        memory-lean end of the choice (e.g. every weight split), which the fastest plan of one
        layer alone may not take."""
        if self.floor(sl, submesh) > self.budget:
            return self.solve(sl, submesh, shape)     # None, and the need recorded
        prob, key = self.problem(sl, submesh, shape, remat)
        if (key, "least") not in self.cache:
            with ilp_scope((key, "least")):
                self.cache[(key, "least")] = prob.least_bytes()
        least = self.cache[(key, "least")]
        if least > self.budget:                        # no plan of it fits the device
            self._need(sl, least)
            return None
        fast = self.solve(sl, submesh, shape, remat=remat)
        if fast is not None and fast.peak_memory_bytes <= 1.05 * least:
            return fast                           # the fastest plan is lean already
        return self.solve(sl, submesh, shape, min(1.05 * least, self.budget), remat)

    def best(self, sl: StageSlice, submesh: tuple[int, int], shapes,
             remat: Remat = Remat.NONE) -> StageSolution | None:
        sols = [s for s in (self.solve(sl, submesh, v, remat=remat) for v in shapes)
                if s is not None]
        return min(sols, key=lambda s: s.latency_s) if sols else None

    def stage(self, sl: StageSlice, submesh: tuple[int, int], shapes, in_flight: int,
              remats: tuple[Remat, ...], lean: bool = False) -> tuple[StageSolution | None,
                                                                      Remat]:
        """The fastest plan of the stage on any of `shapes` and `remats` whose peak under the
        pipeline (`in_flight` microbatches, see `fitting`) fits the budget; the fastest plan
        of the least recomputation when it fits already (recomputing only adds time). None
        when no plan fits."""
        def fits(sol):
            return sol is not None and _static_bytes(sol, self.opt_ratio) \
                + in_flight * sol.activation_bytes <= self.budget * (1 + 1e-9)
        found = []
        for n, remat in enumerate(remats):
            sol = None if lean else self.best(sl, submesh, shapes, remat)
            if fits(sol) and n == 0:
                return sol, remat      # the fastest plan of the least recomputation fits
            if not fits(sol):
                sol = min((f for f in (self.fitting(sl, submesh, v, in_flight, remat)
                                       for v in shapes) if f is not None),
                          key=lambda f: f.latency_s, default=None)
            if sol is not None:
                found.append((sol.latency_s, n, sol))
        if found:
            _, n, sol = min(found, key=lambda f: f[:2])
            return sol, remats[n]
        return None, remats[0]

    def least(self, sl: StageSlice, submesh: tuple[int, int], shapes, in_flight: int,
              remats: tuple[Remat, ...]) -> float:
        """The least pipeline peak per device (as `stage` counts it) of any plan of the stage
        on `shapes` under `remats`."""
        return min(self.problem(sl, submesh, v, r)[0].least_bytes(
            in_flight=in_flight, opt_ratio=self.opt_ratio) for v in shapes for r in remats)


def _opt_ratio(step: OpGraph) -> float:
    """Optimizer-state bytes per parameter byte (Adam: 2), to size a stage's static memory."""
    by_role = {r: 0 for r in InputRole}
    for t in step.inputs:
        by_role[step.tensors[t].role] += step.tensors[t].nbytes
    return by_role[InputRole.OPT_STATE] / max(by_role[InputRole.PARAM], 1)


def _static_bytes(sol: StageSolution, opt_ratio: float) -> float:
    """Params, gradient accumulator and optimizer state, plus the working memory of one
    microbatch beyond its kept activations."""
    working = max(sol.peak_memory_bytes - sol.activation_bytes, 0.0)
    return working + sol.param_bytes * (1 + opt_ratio)


def _infeasible(what: str, budget: float, needed: float, *, any_mesh: bool = True,
                what_needs: str = "the least any tried needs is") -> InfeasiblePlanError:
    need = (f"under any logical mesh ({what_needs} {needed:,.0f} bytes)"
            if any_mesh else f"(it needs {needed:,.0f} bytes)")
    return InfeasiblePlanError(
        f"memory: {what} does not fit memory_budget_bytes={budget:,.0f} per device {need}. "
        "Fix: more devices per stage, more stages, more microbatches (smaller ones), fewer in "
        "flight (1F1B), recomputation (remat='auto' or 'full'), or a larger budget.",
        needed_bytes=int(needed), budget_bytes=int(budget))


def _place(submeshes: list[tuple[int, int]], device_ids: tuple[int, ...]) -> list[tuple[int, ...]]:
    out, start = [], 0
    for h, d in submeshes:
        out.append(tuple(device_ids[start:start + h * d]))
        start += h * d
    if start != len(device_ids):
        raise InvalidArgumentError(
            f"the stages' submeshes {submeshes} use {start} devices but the mesh has "
            f"{len(device_ids)}. Fix: choose submeshes whose device counts add up to the mesh.")
    return out


def _spans_to_stages(loss, boundaries, spans, submeshes, shapes, device_ids, solver, method,
                     budget, remats, lean=None, given=()):
    """Solve each span on its submesh; `shapes` holds, per stage, the logical shapes to try
    and `remats[p]` the rematerializations (`_Solver.stage`: the fastest plan that fits with
    its optimizer state and the activations its schedule keeps in flight; `lean[p]`: the DP
    chose it from memory-lean layer plans, so only plans solved to fit are taken).
    `given[p]`, (stage graph fingerprint, solution) from a saved plan, is taken as stage p's
    solution when the stage's graph and logical shape are the ones it was solved for."""
    stages = []
    lean = lean or [False] * len(spans)
    in_flight = make_schedule(method.schedule, len(spans), method.num_microbatches).in_flight()
    for p, ((i, j), sub, shape, devs) in enumerate(
            zip(spans, submeshes, shapes, _place(submeshes, device_ids))):
        sl = slice_range(loss, boundaries[i], boundaries[j + 1], p)
        chosen = lambda sol, r: ChosenStage(slice=sl, layers=(i, j), submesh=tuple(sub),
                                            device_ids=devs, solution=sol,
                                            graph=solver.graph(sl, r)[0], remat=r)
        if p < len(given):
            replay = next((r for r in remats[p] if given[p][1] is not None
                           and given[p][0] == solver.graph(sl, r)[1]
                           and tuple(given[p][1].logical_shape) in map(tuple, shape)), None)
            if replay is not None:
                solver.num_replayed += 1
                stages.append(chosen(given[p][1], replay))
                continue
            log.warning("autopar: stage %d of the saved plan was solved for another stage "
                        "graph or logical mesh; solving it again", p)
        sol, remat = solver.stage(sl, sub, shape, in_flight[p], remats[p], lean[p])
        if sol is None:
            raise _infeasible(
                f"stage {p} (layers {i}..{j}) on submesh {sub} with its optimizer state and "
                f"{in_flight[p]} microbatch(es) of activations in flight "
                f"(rematerialization tried: {', '.join(r.value for r in remats[p])})", budget,
                _least_pipeline(loss, boundaries, spans, submeshes, shapes, solver, in_flight,
                                remats), what_needs="every stage of this layout needs at least")
        stages.append(chosen(sol, remat))
    return stages


def _least_pipeline(loss, boundaries, spans, submeshes, shapes, solver, in_flight,
                    remats) -> float:
    """The least per-device peak any plan of these stages needs: the max over stages of the
    least each can take on its submesh (exact ILP memory minima)."""
    return max(solver.least(slice_range(loss, boundaries[i], boundaries[j + 1], p), sub,
                            shape, in_flight[p], remats[p])
               for p, ((i, j), sub, shape) in enumerate(zip(spans, submeshes, shapes)))


def _stage_remats(method: ShardParallel, option, num_stages: int) -> list[tuple[Remat, ...]]:
    """Per stage, the rematerializations to try: a `ManualStageOption`'s own, else the
    method's (all of them for "auto")."""
    given = getattr(option, "remat", ()) or (method.remat,) * num_stages
    return [choices_of(r) for r in given]


def choose_stages(loss: LossGraph, boundaries: tuple[int, ...], cluster: ClusterSpec,
                  device_ids: tuple[int, ...], method: PipeshardParallel,
                  stage_method: ShardParallel | None = None,
                  solutions: tuple[tuple[str, StageSolution], ...] = ()) -> InterOpResult:
    """Run the stage option of `method` over the layers given by `boundaries`; each stage's
    ILP follows `stage_method` (default: `method`'s solver settings, free shardings).
    `solutions` (a saved plan's, with `ManualStageOption`) replace the stages' ILPs.

    Raises:
      InfeasiblePlanError: a stage does not fit the memory budget with its optimizer state,
        gradient accumulator and the activations its schedule keeps in flight.
    """
    start = time.perf_counter()
    option = method.stage_option
    num_layers = len(boundaries) - 1
    n = len(device_ids)
    budget = float(method.memory_budget_bytes or cluster.memory_bytes)
    solver = _Solver(loss, cluster, stage_method or method, tuple(boundaries))
    dp = (0, 0, 0.0)
    dph = cluster.devices_per_host
    if isinstance(option, ManualStageOption):
        if option.layer_spans[-1][1] != num_layers - 1:
            raise InvalidArgumentError(
                f"ManualStageOption.layer_spans={option.layer_spans} ends at layer "
                f"{option.layer_spans[-1][1]} but the model has {num_layers} layers (0.."
                f"{num_layers - 1}). Fix: cover every layer, or change the layer option.")
        stages = _spans_to_stages(loss, boundaries, option.layer_spans, option.submesh_shapes,
                                  [[tuple(v)] for v in option.logical_shapes], device_ids,
                                  solver, method, budget,
                                  _stage_remats(method, option, len(option.layer_spans)),
                                  given=solutions)
    elif isinstance(option, UniformStageOption):
        s = option.num_stages
        if s > num_layers or n % s:
            raise InvalidArgumentError(
                f"UniformStageOption(num_stages={s}) needs at least {s} layers (have "
                f"{num_layers}) and a device count divisible by {s} (have {n}). Fix: change "
                "num_stages or the layer option.")
        per = n // s
        sub = (per // dph, dph) if per >= dph and per % dph == 0 else (1, per)
        cuts = np.array_split(np.arange(num_layers), s)
        spans = [(int(c[0]), int(c[-1])) for c in cuts]
        stages = _spans_to_stages(loss, boundaries, spans, [sub] * s,
                                  [logical_shapes(per)] * s, device_ids, solver, method,
                                  budget, _stage_remats(method, option, s))
    else:
        with PlanPool(plan_workers(option.workers)) as solver.pool:
            stages, dp = _auto(loss, boundaries, cluster, device_ids, method, option, solver,
                               budget)
    stages = _with_peaks(stages, loss, method, budget)
    log.info("autopar: %d stage(s) chosen; %d ILPs solved, %d reused, %d replayed from the "
             "saved plan, in %.2f s", len(stages), solver.num_ilps, solver.num_reused,
             solver.num_replayed, time.perf_counter() - start)
    return InterOpResult(boundaries=tuple(boundaries), stages=tuple(stages),
                         num_ilps=solver.num_ilps, num_reused=solver.num_reused,
                         num_replayed=solver.num_replayed,
                         dp_candidates=dp[0], dp_pruned=dp[1], dp_time_s=dp[2],
                         profile_time_s=time.perf_counter() - start)


def _with_peaks(stages, loss: LossGraph, method: PipeshardParallel, budget: float) -> list:
    """Each stage's peak memory under the schedule (the DP's formula); a manual or uniform
    choice that does not fit raises here, as the DP never picks one."""
    in_flight = make_schedule(method.schedule, len(stages), method.num_microbatches).in_flight()
    opt_ratio = _opt_ratio(loss.step)
    out = []
    for st, q in zip(stages, in_flight):
        peak = _static_bytes(st.solution, opt_ratio) + q * st.solution.activation_bytes
        if peak > budget * (1 + 1e-9):
            raise _infeasible(
                f"stage {st.slice.index} (layers {st.layers[0]}..{st.layers[1]}) on submesh "
                f"{st.submesh} with its optimizer state, gradient accumulator and {q} "
                "microbatch(es) of activations in flight", budget, peak, any_mesh=False)
        out.append(dataclasses.replace(st, peak_bytes=peak))
    return out


def _auto(loss, boundaries, cluster, device_ids, method, option: AutoStageOption, solver,
          budget):
    hosts = max(1, len(device_ids) // cluster.devices_per_host)
    dph = min(cluster.devices_per_host, len(device_ids))
    submeshes = candidate_submeshes(hosts, dph)
    shapes_per_k = [logical_shapes(s.num_devices, option.logical_shapes) for s in submeshes]
    # Span (i..j) on (submesh k, logical view v): the summed layer costs. Every (k, v) pair is
    # its own option of the DP, so a leaner view that fits memory competes with a faster one
    # that does not (the DP weighs each with its in-flight activations).
    pairs = [(k, v) for k in range(len(submeshes)) for v in range(len(shapes_per_k[k]))]
    ks, vs = np.array([k for k, _ in pairs]), np.array([v for _, v in pairs])
    remats = choices_of(solver.method.remat)
    # The DP's options: per (remat, lean) kind, every layer on every (k, v) pair. The fastest
    # plans of the least recomputation first; the other rematerializations join when memory
    # binds (no assignment fits, or one would be faster with more memory), then the
    # memory-lean plans of every layer if still nothing fits.
    kinds, options = [], []

    def add(remat: Remat, lean: bool):
        solve = functools.partial(solver.lean if lean else solver.solve, remat=remat)
        kinds.append((remat, lean))
        options.append(_layer_options(loss, boundaries, submeshes, shapes_per_k, pairs,
                                      solve, solver.opt_ratio, solver.pool))

    def check_layers():
        """Raise for a layer with no plan at all (alone on every device) under any kind."""
        ok = np.any([np.isfinite(o[0]).any(axis=1) for o in options], axis=0)
        if not ok.all():
            layer = int(np.argmin(ok))
            raise _infeasible(f"layer {layer}, even alone on all {len(device_ids)} devices,",
                              budget, solver.needed[(boundaries[layer], boundaries[layer + 1])])

    add(remats[0], False)
    if len(remats) == 1:
        check_layers()
    dp = functools.partial(_run_dp, submeshes=submeshes, ks=ks, device_ids=device_ids,
                           method=method, option=option)
    choice = _try_dp(dp, options, budget)
    free = _try_dp(dp, options, np.inf) if choice is not None and len(remats) > 1 else None
    if len(remats) > 1 and (choice is None or (
            free is not None and choice.total_latency_s > free.total_latency_s * (1 + 1e-9))):
        for remat in remats[1:]:
            add(remat, False)
        choice = _try_dp(dp, options, budget)
    if choice is None:
        for remat in remats:
            add(remat, True)
        check_layers()
        choice = dp(options, budget=budget)      # raises the DP's InfeasiblePlanError
    n = len(pairs)
    subs = [(submeshes[ks[p % n]].num_hosts, submeshes[ks[p % n]].devices_per_host)
            for p in choice.submeshes]
    shapes = [[shapes_per_k[ks[p % n]][vs[p % n]]] for p in choice.submeshes]
    stage_kinds = [kinds[p // n] for p in choice.submeshes]
    stages = _spans_to_stages(loss, boundaries, choice.layer_spans, subs, shapes, device_ids,
                              solver, method, budget, [(r,) for r, _ in stage_kinds],
                              [lean for _, lean in stage_kinds])
    return stages, (choice.num_candidates, choice.num_pruned, choice.search_time_s)


def _try_dp(dp, options, budget):
    """The DP's choice, or None where no assignment fits `budget` (or a layer has no plan of
    this kind at all, which the DP reports as an invalid cost array)."""
    try:
        return dp(options, budget=budget)
    except (InfeasiblePlanError, InvalidArgumentError):
        return None


def _layer_options(loss, boundaries, submeshes, shapes_per_k, pairs, solve, opt_ratio,
                   pool=None):
    """Per layer and (submesh, view) pair: the latency, static and activation bytes of the
    plan `solve(slice, submesh, shape)` gives (`_Solver.solve`: fastest; `.lean`: memory-lean;
    under one rematerialization); inf latency where it gives none. The jobs' ILPs are solved
    in `pool`'s worker processes (`batch.run_jobs`; the same plans with any number)."""
    shape = (len(boundaries) - 1, len(pairs))
    lat, static, act = np.full(shape, np.inf), np.zeros(shape), np.zeros(shape)
    slices = [slice_range(loss, boundaries[l], boundaries[l + 1], l) for l in range(shape[0])]
    jobs = [(l, p) for l in range(shape[0]) for p in range(len(pairs))]

    def job(lp):
        k, v = pairs[lp[1]]
        sub = (submeshes[k].num_hosts, submeshes[k].devices_per_host)
        return solve(slices[lp[0]], sub, shapes_per_k[k][v])
    for (l, p), sol in zip(jobs, run_jobs(jobs, job, pool, "layer plans")):
        if sol is not None:
            lat[l, p], static[l, p] = sol.latency_s, _static_bytes(sol, opt_ratio)
            act[l, p] = sol.activation_bytes
    return lat, static, act


def _run_dp(options, *, submeshes, ks, device_ids, method, option, budget):
    """The stage DP over spans of layers on every option (a (submesh, view) pair per kind of
    layer plan: fast or lean, under one rematerialization); span costs are the summed layer
    costs."""
    lat = np.concatenate([o[0] for o in options], axis=1)
    static = np.concatenate([o[1] for o in options], axis=1)
    act = np.concatenate([o[2] for o in options], axis=1)
    num_layers = lat.shape[0]
    span_lat = np.full((num_layers, num_layers, lat.shape[1]), np.inf)
    span_static, span_act = np.zeros_like(span_lat), np.zeros_like(span_lat)
    for i in range(num_layers):
        span_lat[i, i:] = np.cumsum(lat[i:], axis=0)
        span_static[i, i:] = np.cumsum(static[i:], axis=0)
        span_act[i, i:] = np.cumsum(act[i:], axis=0)
    finite = np.isfinite(span_lat)
    costs = StageCosts(latency_s=span_lat, static_bytes=np.where(finite, span_static, 0.0),
                       activation_bytes=np.where(finite, span_act, 0.0),
                       memory_budget_bytes=budget)
    subs = [submeshes[k] for k in ks] * len(options)
    return solve_stage_dp(costs, subs, len(device_ids), method.num_microbatches,
                          max_stages=option.max_stages)
