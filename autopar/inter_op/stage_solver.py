"""The stage search's ILP solver: each (stage training graph, submesh, logical view) ILP is
built once and solved at any budget, its answers cached; layers whose forward slices are
identical share one traced training graph (`slice_key`), so the search traces each distinct
layer once per rematerialization.

    >>> solver = StageSolver(loss, cluster, method, boundaries)
    >>> sol = solver.solve(slice_range(loss, 0, 10), (1, 8), (2, 4))   # fastest plan, or None
"""
from __future__ import annotations

import hashlib
import logging
import math
import time

from autopar.core import _compat
from autopar.core.enums import Annotations, Remat
from autopar.core.errors import InfeasiblePlanError
from autopar.core.graph import InputRole, OpGraph, TensorKind
from autopar.core.options import MethodKind, ShardParallel

# The fingerprint's own digests of equation parameters and literals (same in every run).
from autopar.core.plan import StageSolution, _scalar, _Seen, _stable, graph_fingerprint
from autopar.core.spec import enumerate_specs, num_shards
from autopar.cost.cluster import ClusterSpec
from autopar.inter_op.batch import ilp_scope
from autopar.inter_op.parallel import PlanPool
from autopar.inter_op.pipeline import LossGraph, StageSlice, slice_range
from autopar.inter_op.stage_costs import latency, static_bytes
from autopar.inter_op.stage_solve import (
    forward_batch_dims,
    mirrored,
    stage_batch_sources,
    stage_input_paths,
    stage_problem,
    trace_stage,
)
from autopar.inter_op.step_remat import (
    StepRemat,
    forward_layers,
    forward_nodes,
    rematerialize,
    user_remats,
)

log = logging.getLogger(__name__)
AXIS_NAMES = ("data", "model")
LEAN_SLACK = 1.05          # a memory-lean plan: within 5% of the least memory
LEANEST_SLACK = 1 + 1e-6  # the leanest: at the least memory (the DP's last resort)


def slice_key(loss: LossGraph, sl: StageSlice, act_dims=None) -> str:
    """A digest of the stage's forward nodes with tensors named by their place in the slice
    (which parameter, data input or activation input, or which node output), their
    parameters, shapes, dtypes, literal constants and `jax.checkpoint` regions, and of what
    the slice hands on (`act_dims`: the batch dimension of each forward tensor, see
    `intra_op.batch_dims`, counted for its activation inputs): two slices with the same key
    trace to the same training graph (`trace_stage`), as the repeated layers of a transformer
    do. A slice that reads a non-scalar constant or holds a loop gets a key of its own (never
    shared)."""
    fwd = loss.forward
    position = {tid: pos for pos, tid in enumerate(fwd.inputs)}
    params = {p: n for n, p in enumerate(sl.param_inputs)}
    data = {p: n for n, p in enumerate(sl.data_inputs)}
    acts = {t: n for n, t in enumerate(sl.act_inputs)}
    h, memo, local, regions = hashlib.sha256(), _Seen(), {}, {}
    if any(r.start < sl.stop and sl.start < r.stop for r in fwd.regions):
        h.update(f"loop slice {sl.start}:{sl.stop}".encode())

    def name(t: int) -> str:
        ten = fwd.tensors[t]
        if t in local:
            return local[t]
        if ten.kind == TensorKind.INPUT:
            pos = position[t]
            where = f"p{params[pos]}" if pos in params else f"d{data[pos]}"
        elif ten.kind == TensorKind.CONST:
            where = (f"c={_scalar(fwd.const_values[t], ten.dtype)}"
                     if ten.rank == 0 and t in fwd.const_values else f"const{t}")
        else:
            where = f"a{acts[t]}b{None if act_dims is None else act_dims[t]}"
        return f"{where}{ten.shape}{ten.dtype}"
    for node in fwd.nodes[sl.start:sl.stop]:
        ins = ",".join(name(t) for t in node.inputs)
        for o in node.outputs:
            local[o] = f"t{len(local)}{fwd.tensors[o].shape}{fwd.tensors[o].dtype}"
        params_text = ",".join(f"{k}={_stable(v, memo)}"
                               for k, v in sorted(node.eqn.params.items()))
        region = ("" if node.remat is None else
                  f"r{regions.setdefault(node.remat.id, len(regions))}:"
                  f"{id(node.remat.policy)}:{node.remat.prevent_cse}")
        h.update(f"{node.primitive}[{params_text}]{region}({ins});".encode())
    h.update(("->" + ",".join(local[t] for t in sl.outputs)).encode())
    h.update(f"{len(sl.param_inputs)},{len(sl.data_inputs)},{len(sl.act_inputs)}".encode())
    if sl.forward_only:          # traced without a backward
        h.update(b"forward-only")
    return h.hexdigest()[:16]


class StageSolver:
    """Solves stage ILPs: each (training graph, submesh, logical shape) is built once (with
    every memory point, so it can be solved at any budget) and its solutions are cached by
    budget. A stage's training graph depends on its rematerialization (`remat`, every
    method below): its layers are recomputed in its backward pass (`step_remat`)."""

    def __init__(self, loss: LossGraph, cluster: ClusterSpec, method: ShardParallel,
                 boundaries: tuple[int, ...]):
        self.loss, self.cluster, self.method = loss, cluster, method
        self.boundaries = boundaries
        self.cache: dict = {}
        self.problems: dict = {}
        self.graphs: dict[tuple, tuple[OpGraph, str]] = {}
        self.traces: dict[tuple[int, int], OpGraph] = {}    # (start, stop) -> as traced
        self.shared: dict[tuple, tuple[OpGraph, str, StageSlice]] = {}  # (slice_key, remat)
        self.act_dims = None
        self.keys: dict[tuple[int, int], str] = {}      # (start, stop) -> slice_key
        self.num_ilps = self.num_reused = self.num_replayed = 0
        self.pool: PlanPool | None = None     # worker processes for `_layer_options`' ILPs
        self.needed: dict[tuple[int, int], float] = {}  # slice -> least bytes it needed
        self.opt_ratio = opt_ratio_of(loss)
        self.mirror_ok = _axis_blind(method, loss.forward)
        self.mirrors: dict = {}
        self._shards: dict = {}       # (tensor shape, view) -> the most pieces it splits into

    def graph(self, sl: StageSlice, remat: Remat = Remat.NONE) -> tuple[OpGraph, str]:
        """The stage's training graph; with `remat`, each of its layers recomputed in its
        backward pass (`step_remat`, as a single-mesh step is). Where the backend would run a
        recomputation early (`hoists_recomputation`), the user's own checkpoints in it are
        tied to the backward pass even without `remat` (`step_remat.user_remats`)."""
        key = (sl.start, sl.stop, remat)
        if key not in self.graphs:
            g = self.traces.get(key[:2])
            if g is None:
                g = self.traces[key[:2]] = trace_stage(self.loss, sl)
            tied = self.cluster is not None and self.cluster.hoists_recomputation()
            if sl.forward_only:          # no backward: nothing to recompute in one
                pass
            elif remat != Remat.NONE:
                layers = sum(sl.start <= b < sl.stop for b in self.boundaries)
                bounds = forward_layers(g, max(1, layers))
                if bounds is not None:
                    g = rematerialize(g, StepRemat(
                        boundaries=bounds, choices=(remat,) * (len(bounds) - 1), tied=tied),
                        forward_apart=True)
            elif tied and user_remats(g) and forward_nodes(g):
                g = rematerialize(g, StepRemat(boundaries=(0, len(forward_nodes(g))),
                                               choices=(Remat.NONE,)), forward_apart=True)
            self.graphs[key] = (g, graph_fingerprint(g))
        return self.graphs[key]

    def layer_key(self, sl: StageSlice) -> str:
        """`slice_key` of the slice (cached): equal for slices whose training graphs, and so
        whose ILPs on one view, are the same."""
        if self.act_dims is None:
            self.act_dims = forward_batch_dims(self.loss)
        span = (sl.start, sl.stop)
        if span not in self.keys:
            self.keys[span] = slice_key(self.loss, sl, self.act_dims)
        return self.keys[span]

    def search_graph(self, sl: StageSlice, remat: Remat = Remat.NONE):
        """(graph, fingerprint, slice) of the first slice traced with the same `slice_key`:
        its training graph is this slice's (the search traces each distinct layer once; a
        chosen stage gets its own trace, `graph`)."""
        key = (self.layer_key(sl), remat)
        if key not in self.shared:
            self.shared[key] = (*self.graph(sl, remat), sl)
        return self.shared[key]

    def problem(self, sl: StageSlice, submesh: tuple[int, int], shape: tuple[int, int],
                remat: Remat = Remat.NONE):
        """The stage's built ILP and its cache key; layers with identical training graphs
        share one."""
        graph, fp, first = self.search_graph(sl, remat)
        paths = stage_input_paths(self.loss, sl) if self.method.sharding_rules else ()
        # which inputs are parameters, data and activations: a forward-only stage reading a
        # [batch, d] activation and one reading [batch, d] data trace to equal graphs
        layout = (len(sl.param_inputs), len(sl.data_inputs), len(sl.act_inputs))
        key = (fp, submesh, shape, paths, layout)
        if key not in self.problems:
            t0 = time.perf_counter()
            sub = self.cluster.with_(num_hosts=submesh[0], devices_per_host=submesh[1])
            self.problems[key] = stage_problem(
                graph, first, sub, shape, AXIS_NAMES, self.method, paths, points_above=0.0,
                batch_sources=stage_batch_sources(self.loss, first, graph, self.act_dims))
            log.debug("stage ILP of nodes %d:%d (%s) on %s as %s built in %.2f s", sl.start,
                      sl.stop, remat.value, submesh, shape, time.perf_counter() - t0)
        return self.problems[key], key

    def least_of(self, prob, key, in_flight: int | None = None, opt_ratio: float = 0.0,
                 ) -> float:
        """The least peak bytes per device of any plan of `prob` (cached): of one microbatch,
        or with `in_flight` the pipeline's peak as `fitting` counts it (`least_bytes`)."""
        at = (key, "least", in_flight, opt_ratio)
        if at not in self.cache:
            t0 = time.perf_counter()
            with ilp_scope(at):
                self.cache[at] = prob.least_bytes(in_flight=in_flight, opt_ratio=opt_ratio)
            log.debug("least memory of %s at %s: %.4g bytes, %.2f s", key[1:3], at[2:],
                      self.cache[at], time.perf_counter() - t0)
        return self.cache[at]

    def _cannot_fit(self, sl: StageSlice, prob, key, budget: float,
                    in_flight: int | None = None, opt_ratio: float = 0.0) -> bool:
        """Whether no plan of `prob` fits `budget` (one microbatch, or with `in_flight` the
        pipeline's peak as `fitting` counts it): decided by its least memory where some plan
        could exceed the budget, and recorded. An infeasible ILP runs its lazy memory rounds
        to infeasibility first (3-28 s per stage of GPT-39B, K=8, M=128); the least-memory
        MIP (a fraction of a second) says the same."""
        points = prob.ilp.built.problem.memory_points
        if in_flight is None and all(p.folded and p.max_bytes <= budget for p in points):
            return False
        least = self.least_of(prob, key, in_flight, opt_ratio)
        if least > budget:
            self._need(sl, least)
            return True
        return False

    def mirror_of(self, submesh: tuple[int, int], shape: tuple[int, int]):
        """(b, a) for a view (a, b) with a > b whose ILP is (b, a)'s with the mesh axes
        swapped (an axis-blind method, axes that cost the same swapped); else None."""
        if not self.mirror_ok or len(shape) != 2 or shape[0] <= shape[1]:
            return None
        sub = self.cluster.with_(num_hosts=submesh[0], devices_per_host=submesh[1])
        mesh, other = sub.logical_mesh(shape), sub.logical_mesh(shape[::-1])
        same = (mesh.alpha_s == other.alpha_s[::-1]
                and mesh.beta_s_per_byte == other.beta_s_per_byte[::-1])
        return tuple(shape[::-1]) if same else None

    def _mirrored(self, sl, submesh, shape, remat, sol) -> StageSolution | None:
        """`sol` (solved on the mirror view of `shape`) as a plan on `shape` (cached)."""
        if sol is None:
            return None
        key = (id(sol), submesh, tuple(shape))
        if key not in self.mirrors:
            sub = self.cluster.with_(num_hosts=submesh[0], devices_per_host=submesh[1])
            self.mirrors[key] = (sol, mirrored(sol, self.search_graph(sl, remat)[0],
                                               sub.logical_mesh(tuple(shape), AXIS_NAMES)))
        return self.mirrors[key][1]

    def solve(self, sl: StageSlice, submesh: tuple[int, int], shape: tuple[int, int],
              budget: float | None = None, remat: Remat = Remat.NONE) -> StageSolution | None:
        """The fastest plan of the stage; with `budget`, the fastest whose ILP peak fits it."""
        floor = self.floor(sl, submesh, shape)
        if floor > self.budget:
            self._need(sl, floor)
            return None
        mirror = self.mirror_of(submesh, shape)
        if mirror is not None:
            return self._mirrored(sl, submesh, shape, remat,
                                  self.solve(sl, submesh, mirror, budget, remat))
        prob, key = self.problem(sl, submesh, shape, remat)
        return self._cached(sl, (key, budget), lambda: prob.solve(budget), lambda: (
            self._cannot_fit(sl, prob, key, self.budget if budget is None else budget)))

    def bound(self, sl: StageSlice, submesh: tuple[int, int], shape: tuple[int, int],
              remat: Remat = Remat.NONE, rows: bool = False) -> tuple[float, float, float]:
        """(latency, parameter bytes, peak bytes): lower bounds of the plan `solve` (or `lean`)
        gives at the solver's budget or below: `StageProblem.latency_bound` (with `rows`, its
        LP with the memory rows at that budget: a second, slower LP, several times tighter
        where memory binds), the parameters split as far as they can be (`floor` without the
        optimizer state), the largest of its memory points' least bytes (each group at its
        leanest there; at most the least peak). inf latency where that is over the budget.
        Cached; costs the ILP's build and one LP, not the ILP's solve (nor a least-memory
        MIP)."""
        floor = self.floor(sl, submesh, shape)
        if floor > self.budget:
            self._need(sl, floor)
            return math.inf, 0.0, 0.0
        mirror = self.mirror_of(submesh, shape)
        if mirror is not None:
            return self.bound(sl, submesh, mirror, remat, rows)
        prob, key = self.problem(sl, submesh, shape, remat)
        at = (key, "bound", rows)
        if at not in self.cache:
            peak = max(map(_least_at, prob.ilp.built.problem.memory_points), default=0.0)
            if peak > self.budget:
                self._need(sl, peak)
                self.cache[at] = (math.inf, 0.0, 0.0)
            else:
                self.cache[at] = (prob.latency_bound(self.budget if rows else None),
                                  floor / (1 + self.opt_ratio), peak)
        return self.cache[at]

    def fitting(self, sl: StageSlice, submesh: tuple[int, int], shape: tuple[int, int],
                in_flight: int, remat: Remat = Remat.NONE,
                zero: bool = False) -> StageSolution | None:
        """The fastest plan whose pipeline peak (one microbatch's peak, the optimizer state of
        its parameters, and `in_flight - 1` more microbatches' activations) fits the budget:
        the DP's memory formula, as an ILP constraint. With `zero`, the optimizer state counts
        split over the data axis (ZeRO; see `StageSolution.optimizer_bytes`)."""
        if self.floor(sl, submesh, shape) > self.budget:
            return self.solve(sl, submesh, shape)     # None, and the need recorded
        mirror = self.mirror_of(submesh, shape)
        if mirror is not None and not zero:           # ZeRO splits over axis 0: not mirrored
            return self._mirrored(sl, submesh, shape, remat,
                                  self.fitting(sl, submesh, mirror, in_flight, remat))
        prob, key = self.problem(sl, submesh, shape, remat)
        at, opt_ratio = (key, "fitting", in_flight, zero), self._opt_ratio(shape, zero)
        return self._cached(sl, at, lambda: prob.solve(
            self.budget, opt_ratio=opt_ratio, in_flight=in_flight), lambda: self._cannot_fit(
                sl, prob, key, self.budget, in_flight, opt_ratio))

    def _opt_ratio(self, shape: tuple[int, int], zero: bool) -> float:
        """Optimizer bytes per parameter byte as the ILP counts them (ZeRO: all split)."""
        return self.opt_ratio / shape[0] if zero else self.opt_ratio

    def _cached(self, sl: StageSlice, key, solve, cannot_fit) -> StageSolution | None:
        """`solve()` (cached at `key`), or None without solving where `cannot_fit()` says no
        plan fits (`_cannot_fit`)."""
        if key in self.cache:
            self.num_reused += 1
            return self.cache[key]
        if cannot_fit():
            self.cache[key] = None
            return None
        t0 = time.perf_counter()
        try:
            with ilp_scope(key):      # in a batch (batch.run_jobs), its ILPs go to the pool
                sol = solve()
        except InfeasiblePlanError as e:
            sol = None
            self._need(sl, e.needed_bytes)
        self.num_ilps += 1
        log.debug("stage ILP %s at %s: %s in %.2f s", key[0][1:3], key[1:], "infeasible"
                  if sol is None else sol.ilp.status, time.perf_counter() - t0)
        self.cache[key] = sol
        return sol

    @property
    def budget(self) -> float:
        return float(self.method.memory_budget_bytes or self.cluster.memory_bytes)

    def _need(self, sl: StageSlice, needed: float) -> None:
        span = (sl.start, sl.stop)
        self.needed[span] = min(self.needed.get(span, float("inf")), needed)

    def floor(self, sl: StageSlice, submesh: tuple[int, int],
              shape: tuple[int, int] | None = None) -> float:
        """A lower bound of the stage's memory per device on `submesh` (as the logical view
        `shape`): its parameters and their optimizer state, each split as far as any of its
        shardings on that view can (over every device without a view). Above the budget, no
        plan of it there can be part of a pipeline that fits, so none is built: e.g. a view of
        24 devices, which splits no power-of-two dimension, holds its parameters whole."""
        fwd = self.loss.forward
        mesh = (submesh[0] * submesh[1],) if shape is None else tuple(shape)
        total = 0.0
        for p in sl.param_inputs:
            t = fwd.tensors[fwd.inputs[p]]
            key = (t.shape, mesh)
            if key not in self._shards:
                self._shards[key] = max(num_shards(s, mesh)
                                        for s in enumerate_specs(t.shape, mesh))
            total += t.nbytes / self._shards[key]
        return total * (1 + self.opt_ratio)

    def lean(self, sl: StageSlice, submesh: tuple[int, int], shape: tuple[int, int],
             remat: Remat = Remat.NONE, slack: float = LEAN_SLACK) -> StageSolution | None:
        """The fastest plan within `slack` of the least memory the stage can take (5%; 1 +
        1e-6 for the leanest): the memory-lean end of the choice (e.g. every weight split),
        which the fastest plan of one layer alone may not take. The fastest plan, where it is
        solved already and lean, is the answer; it is not solved for this: where memory binds
        it is the costly solve (GPT-39B's layers across hosts: 1-26 s, against about 1 s at
        the lean budget), and where it is lean, the solve at the lean budget finds it."""
        if self.floor(sl, submesh, shape) > self.budget:
            return self.solve(sl, submesh, shape)     # None, and the need recorded
        mirror = self.mirror_of(submesh, shape)
        if mirror is not None:
            return self._mirrored(sl, submesh, shape, remat,
                                  self.lean(sl, submesh, mirror, remat, slack))
        prob, key = self.problem(sl, submesh, shape, remat)
        least = self.least_of(prob, key)
        if least > self.budget:                        # no plan of it fits the device
            self._need(sl, least)
            return None
        fast = self.cache.get((key, None))          # `solve`'s, where it ran
        if fast is not None and fast.peak_memory_bytes <= slack * least:
            self.num_reused += 1
            return fast                           # the fastest plan is lean already
        return self.solve(sl, submesh, shape, min(slack * least, self.budget), remat)

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
                                 for v in shapes) if fits(f, zero)),
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
        def view(v, zero):       # without ZeRO, a mirror view's least is its mirror's
            return (None if zero else self.mirror_of(submesh, v)) or v
        return min(self.least_of(*self.problem(sl, submesh, view(v, z), r), in_flight,
                                 self._opt_ratio(v, z))
                   for v in shapes for r in remats for z in zeros)

    def least_pipeline(self, spans, submeshes, shapes, in_flight, remats, zeros) -> float:
        """The least per-device peak any plan of these stages (layer spans) needs: the max
        over stages of the least each can take on its submesh (exact ILP memory minima)."""
        return max(self.least(slice_range(self.loss, self.boundaries[i],
                                          self.boundaries[j + 1], p), sub, shape,
                              in_flight[p], remats[p], zeros[p])
                   for p, ((i, j), sub, shape) in enumerate(zip(spans, submeshes, shapes)))


def _least_at(point) -> float:
    """The fewest bytes a memory point can hold (each group at its leanest there)."""
    return point.constant_bytes if point.folded else (
        point.constant_bytes + sum(float(b.min()) for _, b in point.terms))


def _axis_blind(method: ShardParallel, forward: OpGraph) -> bool:
    """Whether a stage ILP treats the two mesh axes alike (so a view's mirror image is the
    same problem): the method pins no batch axis and names no axis in `sharding_rules`, and
    the user's code annotates no sharding (or the method ignores annotations)."""
    if method.kind not in (MethodKind.SHARD, MethodKind.PIPESHARD) or method.batch_axis \
            is not None or method.sharding_rules:
        return False
    return method.annotations == Annotations.IGNORE or not any(
        hasattr(n.eqn, "primitive") and _compat.annotation_of(n.eqn) is not None
        for n in forward.nodes)


def opt_ratio_of(loss: LossGraph) -> float:
    """Optimizer-state bytes per parameter byte (Adam: 2), to size a stage's static memory;
    0 in a forward-only pipeline (no update runs, whatever state the step is handed)."""
    if loss.forward_only:
        return 0.0
    step = loss.step
    by_role = {r: 0 for r in InputRole}
    for t in step.inputs:
        by_role[step.tensors[t].role] += step.tensors[t].nbytes
    return by_role[InputRole.OPT_STATE] / max(by_role[InputRole.PARAM], 1)
