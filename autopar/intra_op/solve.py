"""The intra-op pass: OpGraph + logical mesh + method -> ShardingAssignment."""
from __future__ import annotations

import contextvars
import dataclasses
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from autopar.core.enums import Annotations
from autopar.core.errors import InfeasiblePlanError, InvalidArgumentError
from autopar.core.graph import InputPos, InputRole, OpGraph, OutputPos, TensorId, TensorKind
from autopar.core.options import LayerReuse, ShardParallel
from autopar.core.plan import IlpStats
from autopar.core.spec import Spec
from autopar.cost.cluster import LogicalMesh
from autopar.cost.model import CostModel
from autopar.intra_op.annotations import annotation_specs, both, pin_rule
from autopar.intra_op.batch_dims import batch_dims
from autopar.intra_op.bounds import lp_bound
from autopar.intra_op.build import Built, Fallback, build_ilp, option_bytes
from autopar.intra_op.constraints import (
    ZERO,
    method_input_options,
    method_tensor_rule,
    update_statistics,
)
from autopar.intra_op.copies import (
    Mover,
    duplicate_moves_s,
    reads_shared,
    settled,
    with_shared_copies,
)
from autopar.intra_op.heuristics import polish_ties
from autopar.intra_op.ilp import (
    IlpSolution,
    SolveStatus,
    evaluate,
    min_peak_memory,
    solve_ilp,
    with_extra_bytes,
)
from autopar.intra_op.layers import find_family, group_keys, tie, tied_problem
from autopar.intra_op.memory import moved_operands, peak_bytes, predicted_peak_bytes
from autopar.intra_op.memory_points import lean_least, point_rows
from autopar.intra_op.phases import deferred_nodes
from autopar.intra_op.rules import RuleContext

log = logging.getLogger(__name__)

# The one seam every ILP solve of this module goes through: `fn(problem, ...)` (an
# `intra_op.ilp` function of numpy arrays), or what `inter_op.batch.run_jobs` sets for its
# jobs (their solves deferred to worker processes).
ILP_CALL: contextvars.ContextVar[Callable | None] = contextvars.ContextVar(
    "autopar_ilp_call", default=None)


def ilp_call(fn: Callable, problem, *args, **kwargs):
    call = ILP_CALL.get()
    return fn(problem, *args, **kwargs) if call is None else call(fn, problem, *args, **kwargs)


# The shared ILP (`copies`: a resharded copy that several operators read charged once) is
# solved after the plain one, from its plan, for at most SHARED_TIME_FACTOR times the plain
# solve's time (at least SHARED_MIN_S, at most the method's limit); its plan is used only
# where it is proven optimal. It is tried where it has at most as many copy groups as the
# plain ILP has groups: beyond that it was never proven within that time, and cost 1.5-3.5 s
# of planning (benchmarks/results/shared_copies.md: GPTs of 2-3 layers with 737-1078 copies,
# the OPT-style decoder of tests/api/test_relu_kink.py with 823); MoE layers have fewer.
SHARED_TIME_FACTOR = 2.0
SHARED_MIN_S = 1.0
# Whether `solve_intra_op` solves the shared ILP: the runner-ups pass, which prices rival
# methods within a share of the search's time, turns it off (their prices still count each
# shared copy once).
SHARE_COPIES: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "autopar_share_copies", default=True)

# The level of the "could not pin" message (`_warn_unmet`): the runner-ups pass prices rival
# methods the user did not ask for, and logs theirs at DEBUG.
UNMET_PINS_LEVEL: contextvars.ContextVar[int] = contextvars.ContextVar(
    "autopar_unmet_pins_level", default=logging.WARNING)


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardingAssignment:
    """One spec per tensor, one strategy per node, and the predicted costs of the choice."""
    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    tensor_specs: tuple[Spec, ...]           # per tensor id
    node_strategy: tuple[str, ...]           # per node id
    node_comm: tuple[str, ...]               # per node id: collective it implies, "" if none
    node_compute_s: tuple[float, ...]
    node_comm_s: tuple[float, ...]
    output_specs: tuple[Spec, ...]           # per flat output: the out_sharding
    compute_s: float
    comm_s: float
    reshard_s: float
    peak_memory_bytes: float
    ilp: IlpStats
    fallbacks: tuple[Fallback, ...]
    constant_tensors: frozenset[int]         # computed from constants: left for XLA to place
    node_in_specs: tuple[tuple[Spec | None, ...], ...] = ()   # per node id: the operand specs
                                             # its strategy wants (None: any)
    node_collective_bytes: tuple[tuple[float, float], ...] = ()   # per node id: its
                                             # collective's buffers (`collective_bytes`)


def peak_memory(graph: OpGraph, specs, mesh_shape, collective=None) -> float:
    """Max over the schedule (node order) of the bytes per device of live buffers: the
    arguments and results throughout, the temporaries XLA writes from their producer to the
    last kernel reading them, the partial sums of the gradient collectives (`collective`, see
    `memory.peak_bytes`; the ILP's memory points walk the same events)."""
    return peak_bytes(graph, specs, mesh_shape, collective)


def collective_bytes(strategies) -> tuple[tuple[float, float], ...]:
    """Per node, (partial_bytes, collective_out_bytes) of its strategy (`memory.peak_bytes`)."""
    return tuple((s.partial_bytes, s.collective_out_bytes) if s is not None else (0.0, 0.0)
                 for s in strategies)


def _chosen(built, choice) -> tuple[list, list]:
    """(spec per tensor, strategy per node or None) of the plan that picks `choice[g]` in
    every ILP group `g`."""
    specs = [built.tensor_specs[t][choice[g]] for t, g in enumerate(built.tensor_group)]
    strat = [built.node_strategies[n][choice[g]] if g >= 0 else None
             for n, g in enumerate(built.node_group)]
    return specs, strat


def choice_peak(graph: OpGraph, built, choice, mesh_shape) -> float:
    """`peak_memory` of the plan that picks `choice[g]` in every ILP group `g`."""
    specs, strat = _chosen(built, choice)
    return peak_memory(graph, specs, mesh_shape, collective_bytes(strat))


def _solve(graph: OpGraph, built, method: ShardParallel, budget: float) -> tuple[IlpSolution, str]:
    """Solve the ILP, with repeated layers tied when that applies (see `layers`)."""
    kw = dict(backend=method.solver, time_limit_s=method.solver_time_limit_s)
    family = find_family(graph) if method.layer_reuse != LayerReuse.NEVER else None
    big = sum(1 for k in built.group_size if k > 1) >= 300
    if family is None or (method.layer_reuse == LayerReuse.AUTO and not big):
        return ilp_call(solve_ilp, built.problem, **kw), ""
    keys = group_keys(graph, built.owners, family[0], built.signatures())
    # Period 2 lets consecutive layers alternate (Megatron pairs) and contains every
    # period-1 plan, so one solve suffices.
    tying = tie(keys, 2, *family)
    sol = ilp_call(solve_ilp, tied_problem(built.problem, tying), **kw)
    if sol.status == SolveStatus.INFEASIBLE:  # the untied ILP decides (and reports)
        return ilp_call(solve_ilp, built.problem, **kw), "tied layers infeasible; solved untied"
    choice = tuple(int(sol.choice[r]) for r in tying.rep)
    note = (f"{tying.num_layers} x {tying.family}_* solved once (period {tying.period}), "
            f"{tying.num_tied} variables tied")
    return IlpSolution(choice=choice, objective=float(evaluate(built.problem, choice)),
                       status=sol.status, backend=sol.backend, solve_time_s=sol.solve_time_s,
                       num_variables=sol.num_variables, num_constraints=sol.num_constraints,
                       message=sol.message), note


@dataclass(frozen=True, slots=True, kw_only=True)
class IntraOpProblem:
    """A built intra-op ILP, solvable at any memory budget (`solve_built`) without rebuilding
    its costs: the stage search asks one layer for its fastest plan and its memory-lean one."""
    graph: OpGraph
    mesh: LogicalMesh
    method: ShardParallel
    built: Built
    output_targets: dict[OutputPos, TensorId]   # carried output -> tensor id of its input
    build_time_s: float
    output_pins: dict[OutputPos, Spec] = dataclasses.field(default_factory=dict)
    # the last `held` and its problem (`held_problem`): a stage is asked for its least memory
    # and then solved with the same held tensors; one entry, as a whole stage's points take
    # hundreds of MB
    held_memo: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @property
    def budget(self) -> float:
        """The method's memory budget (the mesh's memory when it sets none)."""
        return float(self.method.memory_budget_bytes or self.mesh.memory_bytes)

    def held_problem(self, held: dict[int, float]):
        """The ILP with `held`'s extra copies live at every memory point (`with_extra_bytes`,
        `_held_bytes`)."""
        key = tuple(sorted(held.items()))
        if key not in self.held_memo:
            self.held_memo.clear()
            self.held_memo[key] = with_extra_bytes(self.built.problem, _held_bytes(
                self.graph, self.built, self.mesh.shape, held))
        return self.held_memo[key]


def build_intra_op(graph: OpGraph, cost: CostModel, method: ShardParallel,
                   carried_outputs: dict[OutputPos, InputPos],
                   input_paths: tuple[str, ...] | None = None,
                   *, points_above: float | None = None,
                   batch_sources: dict[int, int] | None = None,
                   output_pins: dict[OutputPos, Spec] | None = None) -> IntraOpProblem:
    """Build the ILP (strategies, costs, memory points). `carried_outputs` pairs result
    positions with the input positions they replace next step (`OpGraph.carried_outputs`).
    Memory points are kept where the live bytes could exceed `points_above` (default: the
    method's budget); pass 0 to solve it later at budgets below that, or for its least memory
    (`least_memory`). `batch_sources` maps tensor ids to their batch dimension (default: the
    batch inputs' leading one), where the method pins the batch path. `output_pins` fixes
    results' shardings (`parallelize(out_shardings=...)`)."""
    mesh = cost.mesh
    budget = float(method.memory_budget_bytes or mesh.memory_bytes)
    t0 = time.perf_counter()
    ctx = RuleContext(graph=graph, cost=cost, deferred=deferred_nodes(graph))
    # ZeRO where a reduce-scatter is an all-reduce and a slice (XLA:CPU): the update's
    # statistics whole, computed from the summed gradient, where their operator can (unmet
    # where it follows a state leaf pinned to its shard: not reported). With a real
    # reduce-scatter the gradient stays split and the statistics' all-reduces are combined.
    zero_whole = method.kind in ZERO and mesh.reduce_scatter_is_all_reduce
    whole, unpinned = update_statistics(graph, batch_dims(graph, batch_sources)) \
        if zero_whole else (frozenset(), frozenset())
    allowed = method_tensor_rule(graph, method, mesh.shape, mesh.axis_names, batch_sources,
                                 whole)
    marked = {} if method.annotations == Annotations.IGNORE else annotation_specs(
        graph, mesh.axis_names, mesh.shape, strict=input_paths is None)
    if method.annotations == Annotations.PIN:
        allowed = both(allowed, pin_rule(marked))
    output_targets = graph.carried_tensors(carried_outputs)
    built = build_ilp(graph, ctx, method_input_options(graph, method, mesh.shape,
                                                     mesh.axis_names, input_paths),
                      output_targets, budget if points_above is None else float(points_above),
                      allowed, output_pins,
                      hints=marked if method.annotations == Annotations.HINT else None,
                      unpinned=unpinned)
    unmet = tuple(t for t in built.unmet_pins if t not in whole)
    if unmet:
        _warn_unmet(graph, method, unmet,
                    annotated=bool(marked) and method.annotations == Annotations.PIN)
    built.problem = dataclasses.replace(built.problem, memory_budget_bytes=budget)
    return IntraOpProblem(graph=graph, mesh=mesh, method=method, built=built,
                          output_targets=output_targets, build_time_s=time.perf_counter() - t0,
                          output_pins=dict(output_pins or {}))


def _warn_unmet(graph: OpGraph, method: ShardParallel, unmet: tuple[int, ...],
                annotated: bool = False) -> None:
    """Say which values the method could not keep on its sharding (no strategy of the
    operator making them can), with where they are made."""
    where = []
    for tid in unmet[:4]:
        t = graph.tensors[tid]
        made = graph.nodes[t.producer] if t.producer is not None else None
        where.append(f"{t.path or 'value'} {t.shape} from {made.primitive} at {made.source}"
                     if made is not None else f"{t.path or 'value'} {t.shape}")
    log.log(UNMET_PINS_LEVEL.get(),
            "autopar: %s could not pin the sharding of %d value(s) (no strategy of the "
            "operator making them keeps the batch split as the method says%s): %s%s",
            type(method).__name__, len(unmet),
            ", together with the code's sharding annotations (plan them as hints with "
            "annotations='hint')" if annotated else "", "; ".join(where),
            " ..." if len(unmet) > 4 else "")


def _predicted(graph: OpGraph, built, choice, mesh_shape) -> float:
    """`memory.predicted_peak_bytes` of the plan that picks `choice`, its resharded copies
    included (what the plan would report)."""
    specs, strat = _chosen(built, choice)
    in_specs = [s.in_specs if s is not None else () for s in strat]
    copies = [(t, n, want) for t, n, _, want in moved_operands(
        graph, specs, in_specs, mesh_shape, built.constant_tensors)]
    return predicted_peak_bytes(graph, specs, mesh_shape, collective_bytes(strat), copies)


def least_memory(p: IntraOpProblem, held: dict[int, float] | None = None) -> float:
    """The least peak bytes per device any plan of the problem needs (a min-peak MIP; exact
    where the problem was built with `points_above=0`), with `held` counted as `solve_built`
    counts it: without folding `held` into the points where `lean_least` can tell."""
    problem = p.built.problem
    if held:
        points = problem.memory_points
        if points and all(q.folded for q in points):    # the held points need not be built
            hit = lean_least(point_rows(points), len(problem.num_strategies), _held_bytes(
                p.graph, p.built, p.mesh.shape, held))
            if hit is not None:
                return hit[0]
        problem = p.held_problem(held)
    return ilp_call(min_peak_memory, problem, backend=p.method.solver,
                           time_limit_s=p.method.solver_time_limit_s)[0]


def _shared(built, sol: IlpSolution, method: ShardParallel, budget: float,
            reshard) -> IlpSolution:
    """`sol` (the plain ILP's optimum), or the shared ILP's plan (`copies`, built here) where
    it proves one faster within its time (`SHARED_TIME_FACTOR`); the message says which.
    `reshard(tid, src, dst)`: seconds to move (`copies.Mover`)."""
    shared, copies = with_shared_copies(
        dataclasses.replace(built.problem, memory_budget_bytes=budget), list(built.reads),
        built.tensor_group, built.tensor_specs, reshard)
    if not copies:
        return sol
    n = len(copies)
    if n > len(built.group_size):
        return dataclasses.replace(sol, message=(
            f"{sol.message}; {n} shared resharded copies, more than the ILP's "
            f"{len(built.group_size)} groups: the plan that charges every read kept, untried"))
    cap = min(method.solver_time_limit_s,
              max(SHARED_MIN_S, SHARED_TIME_FACTOR * sol.solve_time_s))
    start = settled(copies, sol.choice)
    res = ilp_call(solve_ilp, shared, backend=method.solver, time_limit_s=cap, hint=start)
    before = evaluate(shared, start)
    took = sol.solve_time_s + res.solve_time_s
    if res.status != SolveStatus.OPTIMAL:
        return dataclasses.replace(sol, solve_time_s=took, message=(
            f"{sol.message}; {n} shared resharded copies: not proven within {cap:.3g} s "
            f"({res.status.value}), the plan that charges every read kept"))
    if res.objective < before * (1 - 1e-9):
        return dataclasses.replace(res, choice=res.choice[:len(built.group_size)],
                                   solve_time_s=took, message=(
            f"{sol.message}; {n} shared resharded copies: {before - res.objective:.3g} s "
            f"faster with them ({res.message})"))
    return dataclasses.replace(sol, solve_time_s=took, message=(
        f"{sol.message}; {n} shared resharded copies: the plan stays optimal with them"))


def solve_built(p: IntraOpProblem, budget: float | None = None,
                perturb: tuple[int, float] | None = None,
                held: dict[int, float] | None = None,
                share: bool = False) -> ShardingAssignment:
    """Solve a built ILP at `budget` bytes per device (default: the method's). `held` maps
    tensor ids to a factor: that many more copies of the tensor (as sharded) count at every
    memory point, e.g. a parameter's optimizer state, or the activations of microbatches a
    pipeline keeps in flight. `share`: then solve the shared ILP (`copies`) from the plan
    (untied problems without `held`, `perturb` or memory rows: the copies' bytes are not in
    the rows, so a budget that can bind keeps the plan that charges every read).

    Raises:
      InfeasiblePlanError: no sharding fits; it says what the least-memory plan needs.
    """
    graph, built, mesh = p.graph, p.built, p.mesh
    budget = p.budget if budget is None else float(budget)
    problem = built.problem
    if held:
        problem = p.held_problem(held)
    if budget != problem.memory_budget_bytes or problem is not built.problem:
        built = dataclasses.replace(built, problem=dataclasses.replace(
            problem, memory_budget_bytes=budget))
    sol, reuse = _solve(graph, built, p.method, budget)
    if sol.status == SolveStatus.INFEASIBLE:
        needed = max(choice_peak(graph, built, sol.choice, mesh.shape),
                     _predicted(graph, built, sol.choice, mesh.shape))
        raise InfeasiblePlanError(
            f"memory: no sharding of this step fits {budget:,.0f} bytes per device on mesh "
            f"{mesh.shape}; the plan with the least memory needs {needed:,.0f} bytes per "
            f"device (its resharded copies included). Fix: raise memory_budget_bytes, use "
            f"more devices, a smaller batch, or a sharded method (Zero3Parallel).",
            needed_bytes=int(needed), budget_bytes=int(budget))
    if sol.status in (SolveStatus.FEASIBLE, SolveStatus.FALLBACK):
        log.warning("autopar intra-op ILP: %s", sol.message)
    reshard, plain = Mover(graph, CostModel(mesh=mesh)), sol.choice
    if share and built.reads and not held and perturb is None and not reuse \
            and sol.status == SolveStatus.OPTIMAL and not built.problem.memory_points:
        sol = _shared(built, sol, p.method, budget, reshard)
    if perturb is not None:
        sol = _perturbed(graph, built, sol, mesh.shape, budget, *perturb)
    elif sol.choice == plain:   # between equally fast plans, the one whose inputs take less
        # memory (ties of the plain ILP; a plan of the shared ILP is left as it is)
        ties = {built.tensor_group[t]: option_bytes(graph, built.tensor_specs, t, mesh.shape)
                for t in graph.inputs if len(built.tensor_specs[t]) > 1}
        sol = dataclasses.replace(sol, choice=polish_ties(built.problem, sol.choice, ties))
    dup = duplicate_moves_s(built.reads, built.tensor_group, built.tensor_specs, sol.choice,
                            reshard)      # what the edges charge twice (`copies`)
    stats = IlpStats(
        num_groups=len(built.group_size), num_edges=len(built.edges),
        num_memory_points=len(built.problem.memory_points), num_variables=sol.num_variables,
        num_constraints=sol.num_constraints, build_time_s=p.build_time_s,
        solve_time_s=sol.solve_time_s, status=sol.status.value,
        backend=sol.backend.value if sol.backend else "none", message=sol.message,
        objective_s=float(evaluate(built.problem, sol.choice) - dup), layer_reuse=reuse)
    return assignment_of(graph, built, sol.choice, mesh, p.output_targets, stats,
                         p.output_pins, duplicate_s=dup)


def latency_bound(p: IntraOpProblem, budget: float | None = None) -> float:
    """A lower bound of the compute, collective and resharding seconds (`ShardingAssignment`)
    of any plan `solve_built` may return from `p` (without `held`) at `budget` bytes per
    device or less (None: at any budget): the LP bound of its ILP, with its memory rows at
    `budget`, each edge charged as if its tensors' reads shared one move
    (`copies.reads_shared`: this covers what the plan's accounting subtracts for copies moved
    once), less the most the objective charges for writing the batch to the devices (not
    part of a plan's time). A fraction of a second where the exact solve of a memory-bound
    ILP takes seconds to minutes; the memory rows make it several times tighter there
    (a plan that fits must split its weights and pay for it)."""
    graph, built = p.graph, p.built
    bw = p.mesh.hbm_bandwidth_bytes_per_s
    batch = sum(graph.tensors[t].nbytes / bw for t in graph.inputs
                if graph.tensors[t].role == InputRole.BATCH)
    problem = reads_shared(built.problem, built.reads, built.tensor_group)
    # Rows at a budget only bound the plans that fit it; the free bound where none does. The
    # bound with rows starts from the LP without them (its first round), and rows only raise
    # an LP's value, so it is the bound wherever a fractional plan fits.
    bound = -math.inf
    if budget is not None and problem.memory_points:
        bound = lp_bound(dataclasses.replace(problem, memory_budget_bytes=budget), memory=True)
    if bound == -math.inf:
        bound = lp_bound(problem)
    return max(bound - batch, 0.0)


def _held_bytes(graph: OpGraph, built: Built, mesh_shape, held: dict[int, float],
                ) -> dict[int, np.ndarray]:
    """Per ILP group, the bytes per device of `held`'s extra copies under each strategy."""
    out: dict[int, np.ndarray] = {}
    for t, factor in held.items():
        if factor == 0 or graph.tensors[t].kind == TensorKind.CONST:
            continue
        g = built.tensor_group[t]
        vec = factor * option_bytes(graph, built.tensor_specs, t, mesh_shape)
        out[g] = out[g] + vec if g in out else vec
    return out


def solve_intra_op(graph: OpGraph, cost: CostModel, method: ShardParallel,
                   carried_outputs: dict[OutputPos, InputPos],
                   input_paths: tuple[str, ...] | None = None,
                   perturb: tuple[int, float] | None = None,
                   output_pins: dict[OutputPos, Spec] | None = None) -> ShardingAssignment:
    """Build and solve the ILP. `input_paths` names the graph's inputs for
    `method.sharding_rules` where the graph's own paths are not the user's (a pipeline stage's
    graph). `perturb=(seed, fraction)` then replaces the choice of each ILP group, with
    probability `fraction`, by one of its strategies drawn at random (a random feasible plan,
    to check the cost model against; see `autopar.sample_plan`). `output_pins` fixes the
    shardings of results (`parallelize(out_shardings=...)`)."""
    return solve_built(build_intra_op(graph, cost, method, carried_outputs, input_paths,
                                      output_pins=output_pins), perturb=perturb,
                       share=SHARE_COPIES.get())


def _perturbed(graph: OpGraph, built, sol: IlpSolution, mesh_shape, budget: float, seed: int,
               fraction: float, tries: int = 100) -> IlpSolution:
    """`sol` with each group's choice redrawn with probability `fraction` (seeded), the first
    draw of `tries` whose peak memory fits `budget`."""
    if not 0.0 <= fraction <= 1.0:
        raise InvalidArgumentError(f"perturb fraction={fraction!r} must be in [0, 1].")
    rng = np.random.default_rng(seed)
    sizes = np.asarray(built.group_size)
    for _ in range(tries):
        redraw = rng.random(len(sizes)) < fraction
        choice = np.where(redraw, (rng.random(len(sizes)) * sizes).astype(int),
                          np.asarray(sol.choice))
        if choice_peak(graph, built, choice, mesh_shape) <= budget:
            return dataclasses.replace(
                sol, choice=tuple(int(c) for c in choice), status=SolveStatus.FEASIBLE,
                message=f"random plan: seed {seed}, {int(redraw.sum())} of {len(sizes)} "
                        f"groups redrawn (fraction {fraction:g})")
    raise InfeasiblePlanError(
        f"memory: none of {tries} random plans (seed {seed}, fraction {fraction:g}) fits "
        f"{budget:,.0f} bytes per device. Fix: a smaller fraction or a larger budget.",
        needed_bytes=0, budget_bytes=int(budget))


def assignment_of(graph: OpGraph, built, choice, mesh,
                  output_targets: dict[OutputPos, TensorId],
                  stats: IlpStats, output_pins: dict[OutputPos, Spec] | None = None,
                  duplicate_s: float = 0.0) -> ShardingAssignment:
    """The assignment that picks strategy `choice[g]` in every ILP group `g`; `duplicate_s`:
    the seconds of moves its edges charge twice (`copies.duplicate_moves_s`)."""
    specs = tuple(built.tensor_specs[t][choice[g]] for t, g in enumerate(built.tensor_group))
    strat = [built.node_strategies[n][choice[g]] for n, g in enumerate(built.node_group)]
    diag = sum(float(d[choice[g]]) for g, d in enumerate(built.reshard_diag))
    edges = sum(float(e.cost[choice[e.u], choice[e.v]]) for e in built.edges)
    coll = collective_bytes(strat)
    peak = peak_memory(graph, specs, mesh.shape, coll)
    out_specs = []
    for pos, tid in enumerate(graph.outputs):
        target = output_targets.get(pos)
        pinned = (output_pins or {}).get(pos)
        out_specs.append(pinned if pinned is not None else
                         specs[target] if target is not None else specs[tid])
    return ShardingAssignment(
        mesh_shape=tuple(mesh.shape), axis_names=tuple(mesh.axis_names), tensor_specs=specs,
        node_strategy=tuple(s.name for s in strat), node_comm=tuple(s.comm for s in strat),
        node_compute_s=tuple(s.compute_s for s in strat),
        node_comm_s=tuple(s.comm_s for s in strat), output_specs=tuple(out_specs),
        compute_s=float(np.sum([s.compute_s for s in strat])),
        comm_s=float(np.sum([s.comm_s for s in strat])), reshard_s=diag + edges - duplicate_s,
        peak_memory_bytes=peak, node_collective_bytes=coll,
        ilp=dataclasses.replace(stats, peak_bytes=peak),
        fallbacks=tuple(built.fallbacks), constant_tensors=built.constant_tensors,
        node_in_specs=tuple(s.in_specs for s in strat))
