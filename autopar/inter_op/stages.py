"""The inter-op pass: layers -> pipeline stages, each with a submesh, a logical mesh and its
intra-op plan (Alpa §5.2).

`AutoStageOption` solves the intra-op ILP once per (layer, submesh, logical mesh), reusing
the result for layers whose training graphs are identical and for a view that mirrors
another (`stage_solver.StageSolver`); a span's cost is the sum of its
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

from autopar.core import progress
from autopar.core.enums import Remat, Schedule
from autopar.core.errors import InfeasiblePlanError, InvalidArgumentError
from autopar.core.graph import OpGraph
from autopar.core.options import (
    AutoStageOption,
    ManualStageOption,
    PipeshardParallel,
    ShardParallel,
    UniformStageOption,
)
from autopar.core.plan import StageSolution
from autopar.core.plan import alternative_record as record
from autopar.cost.cluster import ClusterSpec
from autopar.cost.model import CostModel
from autopar.inter_op.chunks import chunk_devices
from autopar.inter_op.lazy_options import (
    KindOptions,
    OptionContext,
    exact_dp,
    kept_without_remat,
)
from autopar.inter_op.parallel import PlanPool, plan_workers
from autopar.inter_op.pipeline import LossGraph, StageSlice, slice_range
from autopar.inter_op.schedule import CHUNKED, make_schedule, placement_of, planned
from autopar.inter_op.schedule_choice import device_peaks, stage_peaks
from autopar.inter_op.schedule_search import Tables, joint, kept_of
from autopar.inter_op.stage_costs import (
    reranked,
    run_dp,
    try_dp,
)
from autopar.inter_op.stage_dp import candidate_submeshes
from autopar.inter_op.stage_solver import (
    AXIS_NAMES,
    LEAN_SLACK,
    LEANEST_SLACK,
    StageSolver,
)
from autopar.inter_op.step_remat import choices_of, stage_remats

log = logging.getLogger(__name__)
# Layer plans across hosts priced by lower bounds until a DP choice uses them
# (`lazy_options`); False solves every one up front (the same choices, more ILPs).
LAZY_ACROSS_HOSTS = True


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
    # Per device, per in-flight microbatch: what its layers would keep without recomputation,
    # the stage DP's sum of their fastest plans' activations (None: not priced by the search)
    activation_bytes_without_remat: float | None = None


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
    # The stage layouts solved whole and not taken (`ParallelPlan.alternatives` entries, their
    # predicted_step_s the pipeline latency sum t_i + (B - 1) max t_i), and the chosen one's.
    runner_ups: tuple[dict, ...] = ()
    chosen_latency_s: float = 0.0
    # The schedule the stages were chosen for (`Schedule.AUTO`'s pick); None: the method's
    schedule: Schedule | None = None


def logical_shapes(n: int, option: str = "all") -> list[tuple[int, int]]:
    """2-D views of n devices: (1, n), (n, 1) for "flat"; every a x b = n for "all"."""
    if option == "flat":
        return list(dict.fromkeys([(1, n), (n, 1)]))
    return [(a, n // a) for a in range(1, n + 1) if n % a == 0]


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
                     budget, remats, zeros, lean=None, given=(), placed=None, schedule=None):
    """Solve each span on its submesh; `shapes` holds, per stage, the logical shapes to try,
    `remats[p]` the rematerializations and `zeros[p]` whether ZeRO may split its optimizer
    state (`StageSolver.stage`: the fastest plan that fits with its optimizer state and the
    activations its schedule keeps in flight; `lean[p]`: the DP chose it from memory-lean
    layer plans, so only plans solved to fit are taken).
    `given[p]`, (stage graph fingerprint, solution) from a saved plan, is taken as stage p's
    solution when the stage's graph and logical shape are the ones it was solved for.
    `schedule`: the one whose in-flight microbatches each stage must fit (default: the
    method's; 1F1B's for `Schedule.AUTO`)."""
    stages = []
    lean = lean or [False] * len(spans)
    in_flight = make_schedule(schedule or planned(method.schedule), len(spans),
                              method.num_microbatches).held()
    for p, ((i, j), sub, shape, devs) in progress.each(enumerate(
            zip(spans, submeshes, shapes, placed or _place(submeshes, device_ids))), len(spans),
            "stages solved whole"):
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
            raise _StageDoesNotFit(p, (i, j), _infeasible(
                f"stage {p} (layers {i}..{j}) on submesh {sub} {_holding(sl, in_flight[p])} "
                f"(rematerialization tried: {', '.join(r.value for r in remats[p])}; ZeRO "
                f"tried: {'yes' if True in zeros[p] else 'no'})", budget,
                solver.least_pipeline(spans, submeshes, shapes, in_flight, remats, zeros),
                what_needs="every stage of this layout needs at least"))
        stages.append(chosen(sol, remat, zero))
    return stages


def _holding(sl: StageSlice, in_flight: int) -> str:
    """What a stage's memory holds, for an error: a forward-only stage its parameters alone."""
    return ("with its parameters and one microbatch's forward" if sl.forward_only else
            f"with its optimizer state, gradient accumulator and {in_flight} microbatch(es) "
            "of activations in flight")


class _StageDoesNotFit(InfeasiblePlanError):
    """A stage of a DP layout that does not fit when solved whole: which one (its index and
    layer span), so the search can rule the span out and ask the DP again."""

    def __init__(self, stage: int, span: tuple[int, int], error: InfeasiblePlanError):
        super().__init__(str(error), needed_bytes=error.needed_bytes,
                         budget_bytes=error.budget_bytes)
        self.stage, self.span = stage, span


REDO_DP = 1      # times the DP is asked again after its layout's stage did not fit whole (each
                # retry re-solves whole stages: on GPT-39B about 100-200 s; 3 found nothing more)


def _stage_zeros(option, num_stages: int, pipeline: bool) -> list[tuple[bool, ...]]:
    """Per stage, whether ZeRO may split its optimizer state: a `ManualStageOption`'s own
    choice, else the search's (without first, with where memory needs it) in a pipeline;
    gradient accumulation keeps its method's state placement (DataParallel's replicated
    state, ZeRO-2's split)."""
    given = getattr(option, "zero", ())
    if given:
        return [(bool(z),) for z in given]
    return [(False, True) if pipeline else (False,)] * num_stages


@progress.timed("stage search", lambda r: f"{len(r.stages)} stage(s), {r.num_ilps} ILPs "
                f"solved, {r.num_reused} reused, {r.num_replayed} replayed")
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
    solver = StageSolver(loss, cluster, stage_method or method, tuple(boundaries))
    pipeline = stage_method is None          # not gradient accumulation
    zeros = pipeline and not loss.forward_only     # ZeRO searched where there is an update
    dp, others, chosen, schedule = (0, 0, 0.0), (), 0.0, None
    dph = cluster.devices_per_host
    chunked = pipeline and method.schedule in CHUNKED
    if isinstance(option, ManualStageOption):
        if option.layer_spans[-1][1] != num_layers - 1:
            raise InvalidArgumentError(
                f"ManualStageOption.layer_spans={option.layer_spans} ends at layer "
                f"{option.layer_spans[-1][1]} but the model has {num_layers} layers (0.."
                f"{num_layers - 1}). Fix: cover every layer, or change the layer option.")
        stages = _spans_to_stages(loss, boundaries, option.layer_spans, option.submesh_shapes,
                                  [[tuple(v)] for v in option.logical_shapes], device_ids,
                                  solver, method, budget,
                                  stage_remats(method, option, len(option.layer_spans)),
                                  _stage_zeros(option, len(option.layer_spans), zeros),
                                  given=solutions, placed=chunk_devices(
                                      method.schedule, len(option.layer_spans), device_ids)
                                  if chunked else None)
    elif isinstance(option, UniformStageOption):
        s = option.num_stages
        if s > num_layers or n % s:
            raise InvalidArgumentError(
                f"UniformStageOption(num_stages={s}) needs at least {s} layers (have "
                f"{num_layers}) and a device count divisible by {s} (have {n}). Fix: change "
                "num_stages or the layer option.")
        placed = chunk_devices(method.schedule, s, device_ids) if chunked else None
        per = len(placed[0]) if placed else n // s
        sub = (per // dph, dph) if per >= dph and per % dph == 0 else (1, per)
        cuts = np.array_split(np.arange(num_layers), s)
        spans = [(int(c[0]), int(c[-1])) for c in cuts]
        chunks = s // (max(placement_of(method.schedule, s)) + 1) if chunked else 1
        stages = _spans_to_stages(loss, boundaries, spans, [sub] * s,
                                  [logical_shapes(per)] * s, device_ids, solver, method,
                                  budget / chunks, stage_remats(method, option, s),
                                  _stage_zeros(option, s, zeros), placed=placed)
    else:
        with PlanPool(plan_workers(option.workers)) as solver.pool:
            stages, dp, seen, schedule = _auto(loss, boundaries, cluster, device_ids, method,
                                               option, solver, budget, zeros)
        chosen = next(c[1] for c in seen if c[0] is stages)     # reranked's pick
        others = _layout_records([c for c in seen if c[0] is not stages], loss, method, budget,
                                 schedule)
    stages = _with_peaks(stages, loss, method, budget, schedule)
    log.info("autopar: %d stage(s) chosen; %d ILPs solved, %d reused, %d replayed from the "
             "saved plan, in %.2f s", len(stages), solver.num_ilps, solver.num_reused,
             solver.num_replayed, time.perf_counter() - start)
    return InterOpResult(boundaries=tuple(boundaries), stages=tuple(stages),
                         num_ilps=solver.num_ilps, num_reused=solver.num_reused,
                         num_replayed=solver.num_replayed,
                         dp_candidates=dp[0], dp_pruned=dp[1], dp_time_s=dp[2],
                         profile_time_s=time.perf_counter() - start,
                         runner_ups=others, chosen_latency_s=chosen, schedule=schedule)


def _peaks(stages, loss: LossGraph, method: PipeshardParallel, schedule: Schedule | None):
    """(table, each stage's (peak, microbatches held), each stage's devices' peak: stage
    chunks on one group add) under `schedule`, default the method's planned one."""
    table = make_schedule(schedule or planned(method.schedule), len(stages),
                          method.num_microbatches)
    peaks = stage_peaks(stages, loss, table)
    return table, peaks, device_peaks(stages, loss, table, peaks)


def _with_peaks(stages, loss: LossGraph, method: PipeshardParallel, budget: float,
                schedule: Schedule | None = None) -> list:
    """Each stage's peak memory under the schedule (the DP's formula); a manual or uniform
    choice that does not fit raises here, as the DP never picks one."""
    out = []
    table, peaks, shared = _peaks(stages, loss, method, schedule)
    groups = [table.group_of(k) for k in range(len(stages))]
    for st, (peak, q), total in zip(stages, peaks, shared):
        if total > budget * (1 + 1e-9):
            chunks = groups.count(groups[st.slice.index])
            raise _infeasible(
                f"stage {st.slice.index} (layers {st.layers[0]}..{st.layers[1]}) on submesh "
                f"{st.submesh} {_holding(st.slice, q)}" + (
                    f", with the {chunks - 1} other stage chunk(s) on its devices"
                    if chunks > 1 else ""), budget, total, any_mesh=False)
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

    ctx = OptionContext(loss=loss, boundaries=boundaries, submeshes=submeshes,
                        shapes_per_k=shapes_per_k, pairs=pairs, meshes=meshes,
                        opt_ratio=solver.opt_ratio, num_microbatches=method.num_microbatches,
                        pipeline=pipeline, pool=solver.pool, layer_keys=tuple(
                            solver.layer_key(slice_range(loss, boundaries[l], boundaries[l + 1],
                                                         l))
                            for l in range(len(boundaries) - 1)))
    # A layer across hosts is priced by lower bounds first, and solved only where a DP
    # choice uses it (`lazy_options`): its ILP is the costly, memory-bound kind.
    lazy = frozenset(p for p, (k, _) in enumerate(pairs)
                     if LAZY_ACROSS_HOSTS and submeshes[k].num_hosts > 1)
    groups: list[KindOptions] = []

    def add(remat: Remat, lean: bool, slack: float = LEAN_SLACK):
        solve = functools.partial(solver.lean, remat=remat, slack=slack) if lean else \
            functools.partial(solver.solve, remat=remat)
        kind = KindOptions(ctx, solve, functools.partial(solver.bound, remat=remat), lazy)
        groups.append(kind)
        for entry, zero in kind.entries():
            kinds.append((remat, lean, zero))
            options.append(entry)

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
    # A schedule other than 1F1B (or AUTO's first search, 1F1B's) has stages fit its own
    # table's (in flight, deferred) states in the DP.
    fixed = planned(method.schedule)        # (a chunked one: 1F1B's first, then its chunks)
    kept = None if fixed in (Schedule.ONE_F_ONE_B, *CHUNKED) else kept_of(
        fixed, method.num_microbatches, Tables())
    dp = exact_dp(functools.partial(run_dp, submeshes=submeshes, ks=ks, kept=kept,
                                    device_ids=device_ids, method=method, option=option),
                  groups, len(pairs))
    # Where only layer plans across hosts (not solved yet) could make the least recomputation
    # fit, the other recomputations join first: their plans on one host usually fit, and
    # then those across hosts need no solving (GPT-39B K=8 M=1024: 37 s less). The DP then
    # chooses over more options, never a slower layout.
    lazy_only = len(remats) > 1 and bool(lazy) and try_dp(
        dp, options, budget, solved_only=True) is None
    choice = None if lazy_only else try_dp(dp, options, budget)
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
        choice = try_dp(dp, options, budget)
    if choice is None:       # the leanest plans, where 5% above the least is still too much
        for remat in remats:
            add(remat, True, LEANEST_SLACK)
        choice = dp(options, budget=budget)      # raises the DP's InfeasiblePlanError
    n = len(pairs)

    def solved(choice, schedule=None):
        """The stages of a DP choice, each solved whole on its submesh and view (to fit the
        in-flight microbatches of `schedule`, default the method's). A stage the DP gave
        recomputation may take less of it where a plan solved to fit its schedule's memory
        (`StageSolver.stage`) is faster: the DP prices a layer's fastest or leanest plans
        only, not the fastest that fits (GPT-39B, 8 one-layer stages on 1x8: the DP's full
        recomputation on the first two stages, where selective fits, cost 8%)."""
        subs = [(submeshes[ks[p % n]].num_hosts, submeshes[ks[p % n]].devices_per_host)
                for p in choice.submeshes]
        shapes = [[shapes_per_k[ks[p % n]][vs[p % n]]] for p in choice.submeshes]
        stage_kinds = [kinds[p // n] for p in choice.submeshes]
        schedule = schedule or (Schedule.ONE_F_ONE_B if fixed in CHUNKED else None)
        chunked = schedule in CHUNKED      # 2 chunks a group: each fits half the budget
        stages = _spans_to_stages(loss, boundaries, choice.layer_spans, subs, shapes,
                                  device_ids, solver, method, budget / (2 if chunked else 1),
                                  [remats[:remats.index(r) + 1] for r, _, _ in stage_kinds],
                                  [(z,) for _, _, z in stage_kinds],
                                  [lean for _, lean, _ in stage_kinds], schedule=schedule,
                                  placed=chunk_devices(schedule, len(subs), device_ids)
                                  if chunked else None)
        return [dataclasses.replace(st, activation_bytes_without_remat=kept_without_remat(
            kinds, options, span, p % n)) for st, span, p in zip(
                stages, choice.layer_spans, choice.submeshes)]
    banned: list[tuple[int, int, int]] = []
    for redo in range(REDO_DP + 1):
        seen = []
        try:
            stages = reranked(choice, dp, options, budget, solved, method.num_microbatches,
                              seen)
            break
        except _StageDoesNotFit as e:
            # The DP's layer sums missed what the stage needs whole: no span holding these
            # layers fits on that (submesh, view) pair, or its mirror view (the same ILP),
            # under any kind of layer plan.
            pair = int(choice.submeshes[e.stage]) % n
            k, view = ks[pair], tuple(shapes_per_k[ks[pair]][vs[pair]])
            mirror = solver.mirror_of((submeshes[k].num_hosts, submeshes[k].devices_per_host),
                                       max(view, view[::-1]))
            banned += [(*e.span, q) for q in range(n) if ks[q] == k and (
                q == pair or (mirror is not None
                              and tuple(shapes_per_k[k][vs[q]]) == view[::-1]))]
            log.info("autopar: stage layers %d..%d on %s as %s does not fit when solved "
                     "whole (needs %.4g bytes); the stage DP is asked again without it, pricing "
                     "the deferred bytes of later layers",
                     *e.span, submeshes[ks[pair]], shapes_per_k[ks[pair]][vs[pair]],
                     e.needed_bytes)
            # ... and with each span priced with its later layers' deferred bytes (live
            # through its earlier layers' backward, `span_static_bytes`): the summed layer
            # plans' price that missed them is what let the DP choose this layout.
            dp = functools.partial(dp, banned=tuple(banned), deferred=True)
            again = try_dp(dp, options, budget)
            if again is None or redo == REDO_DP:
                raise
            choice = again
    schedule = None
    if pipeline and (method.schedule is Schedule.AUTO or fixed in CHUNKED):
        sizes = [s.num_devices for s in submeshes]      # each schedule's own DP, priced
        stages, schedule, seen = joint(loss, stages, seen, dp, options, budget, solved,
                                       method.num_microbatches, ks, sizes,
                                       fixed if fixed in CHUNKED else None)
    return (stages, (choice.num_candidates, choice.num_pruned, choice.search_time_s), seen,
            schedule)


def _layout_text(stages) -> str:
    return f"{len(stages)} stage(s): " + "; ".join(
        f"layers {st.layers[0]}..{st.layers[1]} on {st.submesh[0]}x{st.submesh[1]} as "
        f"{'x'.join(map(str, st.solution.logical_shape))}" for st in stages)


def _layout_records(seen, loss, method, budget, schedule=None) -> tuple[dict, ...]:
    """`ParallelPlan.alternatives` entries for the layouts in `seen` (see `reranked`; a
    fourth entry: the schedule it was priced under, `schedule_search.joint`)."""
    out = []
    for stages, t, error, *priced in seen:
        if error is not None:
            out.append(record(f"stage layout ({error.needed_bytes:.4g} B needed)",
                              "stage layout", None, error.needed_bytes, budget,
                              "a layout the DP ranked high; when solved whole a stage did not "
                              "fit"))
            continue
        under = priced[0] if priced else schedule
        devices = _peaks(stages, loss, method, under)[2]
        out.append(record(_layout_text(stages) + (f" under {under.value}" if priced else ""),
                          "stage layout", t, max(devices),
                          budget, "solved whole; slower than the chosen layout"))
    return tuple(sorted(out, key=lambda a: (a["predicted_step_s"] is None,
                                            a["predicted_step_s"] or 0.0)))
