"""The inter-op pass: layers -> pipeline stages, each with a submesh, a logical mesh and its
intra-op plan (Alpa §5.2).

`AutoStageOption` solves the intra-op ILP once per (layer, submesh, logical mesh), reusing
the result for layers whose training graphs are identical; a span's cost is the sum of its
layers' costs on one logical mesh plus the reshards between consecutive layers whose plans
disagree on what one hands the next (`boundary_costs`); the DP in `stage_dp` picks the spans,
submeshes and (where memory binds) each stage's rematerialization. The DP's choice and its
best alternatives with fewer stages are then solved whole, and the fastest solved layout wins
(`reranked`). `UniformStageOption` and `ManualStageOption` skip the DP.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import time
from dataclasses import dataclass

import numpy as np

from ..cluster import ClusterSpec
from ..cost import CostModel
from ..errors import InfeasiblePlanError, InvalidArgumentError
from ..graph import InputRole, OpGraph
from ..options import (AutoStageOption, ManualStageOption, PipeshardParallel, ShardParallel,
                       UniformStageOption)
from ..plan import graph_fingerprint
from ..runtime.schedule import make_schedule
from .batch import ilp_scope
from .parallel import PlanPool, plan_workers
from .pipeline import LossGraph, StageSlice, slice_range
from .remat import Remat, choices_of, with_remat
from .stage_costs import (boundary_costs, latency, layer_options, reranked, run_dp,
                          static_bytes, try_dp, zero_variant)
from .stage_dp import candidate_submeshes
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
    zero: bool = False                   # its optimizer state split over its data axis


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
                in_flight: int, remat: Remat = Remat.NONE,
                zero: bool = False) -> StageSolution | None:
        """The fastest plan whose pipeline peak (one microbatch's peak, the optimizer state of
        its parameters, and `in_flight - 1` more microbatches' activations) fits the budget:
        the DP's memory formula, as an ILP constraint. With `zero`, the optimizer state counts
        split over the data axis (ZeRO; see `StageSolution.optimizer_bytes`)."""
        if self.floor(sl, submesh) > self.budget:
            return self.solve(sl, submesh, shape)     # None, and the need recorded
        prob, key = self.problem(sl, submesh, shape, remat)
        return self._cached(sl, (key, "fitting", in_flight, zero), lambda: prob.solve(
            self.budget, opt_ratio=self._opt_ratio(shape, zero), in_flight=in_flight))

    def _opt_ratio(self, shape: tuple[int, int], zero: bool) -> float:
        """Optimizer bytes per parameter byte as the ILP counts them (ZeRO: all split)."""
        return self.opt_ratio / shape[0] if zero else self.opt_ratio

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
              remats: tuple[Remat, ...], lean: bool = False, zeros: tuple[bool, ...] = (False,),
              ) -> tuple[StageSolution | None, Remat, bool]:
        """(solution, remat, zero): the fastest plan of the stage on any of `shapes`, `remats`
        and `zeros` (ZeRO on its data axis or not) whose peak under the pipeline (`in_flight`
        microbatches, see `fitting`) fits the budget, its ZeRO all-gather counted per
        microbatch (`_latency`); the fastest plan of the first choices when it fits already
        (recomputing or gathering only adds time). None when no plan fits."""
        def fits(sol, zero):
            return sol is not None and static_bytes(sol, self.opt_ratio, zero) \
                + in_flight * sol.activation_bytes <= self.budget * (1 + 1e-9)
        found = []
        for n, remat in enumerate(remats):
            best = None if lean else self.best(sl, submesh, shapes, remat)
            if n == 0 and fits(best, zeros[0]):
                return best, remat, zeros[0]
            for zero in zeros:
                sol = best if fits(best, zero) else min(
                    (f for f in (self.fitting(sl, submesh, v, in_flight, remat, zero)
                                 for v in shapes) if f is not None),
                    key=lambda f: f.latency_s, default=None)
                if sol is not None:
                    found.append((latency(sol, zero, self.method.num_microbatches), n, zero,
                                  sol))
        if found:
            _, n, zero, sol = min(found, key=lambda f: f[:3])
            return sol, remats[n], zero
        return None, remats[0], zeros[0]

    def least(self, sl: StageSlice, submesh: tuple[int, int], shapes, in_flight: int,
              remats: tuple[Remat, ...], zeros: tuple[bool, ...] = (False,)) -> float:
        """The least pipeline peak per device (as `stage` counts it) of any plan of the stage
        on `shapes` under `remats` and `zeros`."""
        return min(self.problem(sl, submesh, v, r)[0].least_bytes(
            in_flight=in_flight, opt_ratio=self._opt_ratio(v, z))
            for v in shapes for r in remats for z in zeros)


def _opt_ratio(step: OpGraph) -> float:
    """Optimizer-state bytes per parameter byte (Adam: 2), to size a stage's static memory."""
    by_role = {r: 0 for r in InputRole}
    for t in step.inputs:
        by_role[step.tensors[t].role] += step.tensors[t].nbytes
    return by_role[InputRole.OPT_STATE] / max(by_role[InputRole.PARAM], 1)


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
                     budget, remats, zeros, lean=None, given=()):
    """Solve each span on its submesh; `shapes` holds, per stage, the logical shapes to try,
    `remats[p]` the rematerializations and `zeros[p]` whether ZeRO may split its optimizer
    state (`_Solver.stage`: the fastest plan that fits with its optimizer state and the
    activations its schedule keeps in flight; `lean[p]`: the DP chose it from memory-lean
    layer plans, so only plans solved to fit are taken).
    `given[p]`, (stage graph fingerprint, solution) from a saved plan, is taken as stage p's
    solution when the stage's graph and logical shape are the ones it was solved for."""
    stages = []
    lean = lean or [False] * len(spans)
    in_flight = make_schedule(method.schedule, len(spans), method.num_microbatches).in_flight()
    for p, ((i, j), sub, shape, devs) in enumerate(
            zip(spans, submeshes, shapes, _place(submeshes, device_ids))):
        sl = slice_range(loss, boundaries[i], boundaries[j + 1], p)
        chosen = lambda sol, r, z: ChosenStage(slice=sl, layers=(i, j), submesh=tuple(sub),
                                               device_ids=devs, solution=sol,
                                               graph=solver.graph(sl, r)[0], remat=r, zero=z)
        if p < len(given):
            replay = next((r for r in remats[p] if given[p][1] is not None
                           and given[p][0] == solver.graph(sl, r)[1]
                           and tuple(given[p][1].logical_shape) in map(tuple, shape)), None)
            if replay is not None:
                solver.num_replayed += 1
                stages.append(chosen(given[p][1], replay, zeros[p][0]))
                continue
            log.warning("autopar: stage %d of the saved plan was solved for another stage "
                        "graph or logical mesh; solving it again", p)
        sol, remat, zero = solver.stage(sl, sub, shape, in_flight[p], remats[p], lean[p],
                                        zeros[p])
        if sol is None:
            raise _infeasible(
                f"stage {p} (layers {i}..{j}) on submesh {sub} with its optimizer state and "
                f"{in_flight[p]} microbatch(es) of activations in flight "
                f"(rematerialization tried: {', '.join(r.value for r in remats[p])}; ZeRO "
                f"tried: {'yes' if True in zeros[p] else 'no'})", budget,
                _least_pipeline(loss, boundaries, spans, submeshes, shapes, solver, in_flight,
                                remats, zeros),
                what_needs="every stage of this layout needs at least")
        stages.append(chosen(sol, remat, zero))
    return stages


def _least_pipeline(loss, boundaries, spans, submeshes, shapes, solver, in_flight,
                    remats, zeros) -> float:
    """The least per-device peak any plan of these stages needs: the max over stages of the
    least each can take on its submesh (exact ILP memory minima)."""
    return max(solver.least(slice_range(loss, boundaries[i], boundaries[j + 1], p), sub,
                            shape, in_flight[p], remats[p], zeros[p])
               for p, ((i, j), sub, shape) in enumerate(zip(spans, submeshes, shapes)))


def _stage_remats(method: ShardParallel, option, num_stages: int) -> list[tuple[Remat, ...]]:
    """Per stage, the rematerializations to try: a `ManualStageOption`'s own, else the
    method's (all of them for "auto")."""
    given = getattr(option, "remat", ()) or (method.remat,) * num_stages
    return [choices_of(r) for r in given]


def _stage_zeros(option, num_stages: int, pipeline: bool) -> list[tuple[bool, ...]]:
    """Per stage, whether ZeRO may split its optimizer state: a `ManualStageOption`'s own
    choice, else the search's (without first, with where memory needs it) in a pipeline;
    gradient accumulation keeps its method's state placement (DataParallel's replicated
    state, ZeRO-2's split)."""
    given = getattr(option, "zero", ())
    if given:
        return [(bool(z),) for z in given]
    return [(False, True) if pipeline else (False,)] * num_stages


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
    pipeline = stage_method is None          # not gradient accumulation
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
                                  _stage_zeros(option, len(option.layer_spans), pipeline),
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
                                  budget, _stage_remats(method, option, s),
                                  _stage_zeros(option, s, pipeline))
    else:
        with PlanPool(plan_workers(option.workers)) as solver.pool:
            stages, dp = _auto(loss, boundaries, cluster, device_ids, method, option, solver,
                               budget, pipeline)
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
        peak = static_bytes(st.solution, opt_ratio, st.zero) + q * st.solution.activation_bytes
        if peak > budget * (1 + 1e-9):
            raise _infeasible(
                f"stage {st.slice.index} (layers {st.layers[0]}..{st.layers[1]}) on submesh "
                f"{st.submesh} with its optimizer state, gradient accumulator and {q} "
                "microbatch(es) of activations in flight", budget, peak, any_mesh=False)
        out.append(dataclasses.replace(st, peak_bytes=peak))
    return out


def _auto(loss, boundaries, cluster, device_ids, method, option: AutoStageOption, solver,
          budget, pipeline: bool):
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
    # The DP's options: per (remat, lean, zero) kind, every layer on every (k, v) pair. The
    # fastest plans of the least recomputation first, each also with ZeRO in a pipeline (no
    # new ILP: the same plans with the optimizer state split over the data axis); the other
    # rematerializations join when memory binds (no assignment fits, or one would be faster
    # with more memory), then the memory-lean plans of every layer if still nothing fits.
    kinds, options = [], []

    meshes = [CostModel(mesh=cluster.with_(
        num_hosts=submeshes[k].num_hosts, devices_per_host=submeshes[k].devices_per_host,
    ).logical_mesh(tuple(shapes_per_k[k][v]), AXIS_NAMES)) for k, v in pairs]

    def add(remat: Remat, lean: bool):
        solve = functools.partial(solver.lean if lean else solver.solve, remat=remat)
        lat, static, act, sols = layer_options(loss, boundaries, submeshes, shapes_per_k,
                                                pairs, solve, solver.opt_ratio, solver.pool)
        bound = boundary_costs(loss, boundaries, sols, meshes)
        kinds.append((remat, lean, False))
        options.append((lat, static, act, bound))
        zero = zero_variant(sols, lat, static, solver.opt_ratio, method.num_microbatches)
        if pipeline and zero is not None:
            kinds.append((remat, lean, True))
            options.append((*zero, act, bound))

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
    dp = functools.partial(run_dp, submeshes=submeshes, ks=ks, device_ids=device_ids,
                           method=method, option=option)
    choice = try_dp(dp, options, budget)
    free = try_dp(dp, options, np.inf) if choice is not None and len(remats) > 1 else None
    if len(remats) > 1 and (choice is None or (
            free is not None and choice.total_latency_s > free.total_latency_s * (1 + 1e-9))):
        for remat in remats[1:]:
            add(remat, False)
        choice = try_dp(dp, options, budget)
    if choice is None:
        for remat in remats:
            add(remat, True)
        check_layers()
        choice = dp(options, budget=budget)      # raises the DP's InfeasiblePlanError
    n = len(pairs)

    def solved(choice):
        """The stages of a DP choice, each solved whole on its submesh and view."""
        subs = [(submeshes[ks[p % n]].num_hosts, submeshes[ks[p % n]].devices_per_host)
                for p in choice.submeshes]
        shapes = [[shapes_per_k[ks[p % n]][vs[p % n]]] for p in choice.submeshes]
        stage_kinds = [kinds[p // n] for p in choice.submeshes]
        return _spans_to_stages(loss, boundaries, choice.layer_spans, subs, shapes,
                                device_ids, solver, method, budget,
                                [(r,) for r, _, _ in stage_kinds],
                                [(z,) for _, _, z in stage_kinds],
                                [lean for _, lean, _ in stage_kinds])
    stages = reranked(choice, dp, options, budget, solved, method.num_microbatches)
    return stages, (choice.num_candidates, choice.num_pruned, choice.search_time_s)
