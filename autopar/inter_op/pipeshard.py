"""The driver for `PipeshardParallel`: trace -> split the loss -> layers -> stages (DP over
intra-op ILP costs) -> apply-gradient placement -> plan; then lower and run.

Gradient accumulation (`ShardParallel(num_microbatches=M)` and its data / ZeRO variants) runs
through the same machinery as a one-stage pipeline on the whole mesh (`accumulation_method`):
the stage's forward+backward executable accumulates each microbatch's gradient, then the
apply-gradient executable updates the state, as Alpa did it.

Example:
    >>> method = autopar.PipeshardParallel(num_microbatches=4,
    ...                                    stage_option=autopar.UniformStageOption(num_stages=2))
    >>> step = autopar.parallelize(train_step, mesh=mesh, method=method)
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax

from autopar.core.enums import Remat, Schedule
from autopar.core.errors import InvalidArgumentError
from autopar.core.graph import InputRole
from autopar.core.options import (
    AutoLayerOption,
    ManualStageOption,
    MethodKind,
    PipeshardParallel,
    ShardParallel,
)
from autopar.core.plan import (
    ParallelPlan,
    StagePlan,
    graph_fingerprint,
    solution_from_record,
    solution_record,
)
from autopar.core.primitives import HEAVY_OPERATORS
from autopar.core.spec import Spec, replicated
from autopar.cost.cluster import ClusterSpec
from autopar.frontend.checks import arg_label, argnums_text, warn_unmatched_rules
from autopar.frontend.tracer import _abstract, check_argnums, trace
from autopar.inter_op.apply_grad import Placement, place
from autopar.inter_op.local_grads import LocalGrads, stage_local_grads
from autopar.inter_op.pipeline import LossGraph, layer_boundaries, split_step
from autopar.inter_op.schedule import CHUNKED, make_schedule, one_executable
from autopar.inter_op.schedule_choice import choose_schedule, kept_parts
from autopar.inter_op.stages import AXIS_NAMES, InterOpResult, choose_stages
from autopar.intra_op.constraints import method_input_options
from autopar.intra_op.planner import output_paths, tensor_plans

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class PipelineParts:
    loss: LossGraph
    inter_op: InterOpResult
    placement: Placement
    local_grads: tuple[LocalGrads | None, ...]   # per stage (None: one microbatch)
    schedule: Schedule = Schedule.ONE_F_ONE_B    # the schedule the plan runs (AUTO's choice)


def microbatch_args(args: tuple, batch_argnums: Sequence[int], num_microbatches: int,
                    fun: Callable | None = None) -> tuple:
    """Abstract arguments with every batch leaf's leading dimension divided by M (`fun`: the
    step, whose parameter names the error message uses)."""
    batch = check_argnums("batch_argnums", batch_argnums, len(args))
    out = []
    for i, a in enumerate(args):
        if i not in batch:
            out.append(a)
            continue

        def shrink(path, x):
            x = _abstract(x)
            if not x.shape or x.shape[0] % num_microbatches:
                where = arg_label(fun, len(args), i, jax.tree_util.keystr(path))
                raise InvalidArgumentError(
                    f"num_microbatches={num_microbatches}: {where} (in "
                    f"{argnums_text('batch_argnums', batch_argnums)}) has shape "
                    f"{tuple(x.shape)}, whose leading (batch) dimension is not divisible by "
                    f"{num_microbatches}. Fix: choose num_microbatches dividing the batch size "
                    f"({x.shape[0] if x.shape else 'a scalar has none'}), or a batch size "
                    f"that is a multiple of {num_microbatches}.")
            return jax.ShapeDtypeStruct((x.shape[0] // num_microbatches, *x.shape[1:]), x.dtype)
        out.append(jax.tree_util.tree_map_with_path(shrink, a))
    return tuple(out)


def accumulation_method(method: ShardParallel, mesh_shape: Sequence[int],
                        cluster: ClusterSpec) -> PipeshardParallel:
    """The one-stage pipeline that runs `method` with gradient accumulation: one layer, one
    stage on every device, its logical mesh the user's mesh (a 1-D mesh as 1 x n).

    Example:
        >>> accumulation_method(autopar.ShardParallel(num_microbatches=4), (2, 4), cluster)
    """
    shape = tuple(int(d) for d in mesh_shape)
    if len(shape) == 1:
        shape = (1, shape[0])
    if len(shape) != 2:
        raise InvalidArgumentError(
            f"num_microbatches={method.num_microbatches} (gradient accumulation) runs on a 1-D "
            f"or 2-D mesh; this mesh has shape {tuple(mesh_shape)}. Fix: reshape the mesh to "
            "two axes, e.g. jax.make_mesh((2, 4), ('data', 'model')).")
    n = shape[0] * shape[1]
    hosts, per_host = cluster.num_hosts, cluster.devices_per_host
    submesh = (hosts, per_host) if hosts * per_host == n else (1, n)
    return PipeshardParallel(
        memory_budget_bytes=method.memory_budget_bytes, solver=method.solver,
        solver_time_limit_s=method.solver_time_limit_s, layer_reuse=method.layer_reuse,
        num_microbatches=method.num_microbatches, layer_option=AutoLayerOption(num_layers=1),
        remat=method.remat,
        stage_option=ManualStageOption(layer_spans=((0, 0),), submesh_shapes=(submesh,),
                                       logical_shapes=(shape,)))


def _scopes(loss: LossGraph, start: int, stop: int) -> tuple[str, ...]:
    """Model scopes of the heavy operators in a node range, e.g. ('GPT/block_0/attn', ...)."""
    seen = {}
    for node in loss.forward.nodes[start:stop]:
        if node.primitive in HEAVY_OPERATORS:
            scope = node.name_stack.split("/")
            seen.setdefault("/".join(scope[:3]) or node.source.rsplit("/", 1)[-1], None)
    return tuple(seen)


def plan_pipeline(fun: Callable, args: tuple, *, cluster: ClusterSpec,
                  device_ids: tuple[int, ...], mesh_shape: tuple[int, ...],
                  method: PipeshardParallel, static_argnums=(), batch_argnums=(1,),
                  donate_argnums=(), stage_method: ShardParallel | None = None,
                  step_graph=None, stage_solutions: tuple[dict, ...] = (),
                  ) -> tuple[ParallelPlan, PipelineParts, Any]:
    """Plan a pipeline; returns (plan, the parts the lowering needs, the step graph).
    `stage_method` (gradient accumulation) is the user's method: its rules shape the stage's
    ILP and its name is the plan's method. `step_graph`: the step already traced with
    `keep_grad=True` (else it is traced here). `stage_solutions`: a saved plan's (with
    `method.stage_option` its `ManualStageOption`), used instead of solving the stages."""
    t0 = time.perf_counter()
    kw = dict(static_argnums=static_argnums, batch_argnums=batch_argnums,
              donate_argnums=donate_argnums, keep_grad=True)
    step = step_graph if step_graph is not None else trace(fun, args, **kw)
    m = method.num_microbatches
    warn_unmatched_rules((stage_method or method).sharding_rules,
                         [step.tensors[t].path for t in step.inputs])
    micro = trace(fun, microbatch_args(args, batch_argnums, m, fun), **kw) if m > 1 else step
    layers = method.layer_option
    loss = split_step(step, micro, m, scan_pieces=layers.num_layers       # scans can be cut
                      if isinstance(layers, AutoLayerOption) else 1)
    t_trace = time.perf_counter() - t0
    method = forward_only_method(method, loss)
    bounds = layer_boundaries(loss.forward, method.layer_option)
    log.info("autopar: loss cut into %d layers (%d forward operators)", len(bounds) - 1,
             len(loss.forward.nodes))
    t1 = time.perf_counter()
    result = choose_stages(loss, tuple(bounds), cluster, tuple(device_ids), method,
                           stage_method, _readable(stage_solutions))
    placement = place(loss, result.stages, _state_pins(loss, result, stage_method or method))
    t_stages = time.perf_counter() - t1
    local = tuple(stage_local_grads(loss, st) if m > 1 and not loss.forward_only else None
                  for st in result.stages)
    plan = _build_plan(loss, result, placement, method, cluster, device_ids, mesh_shape,
                       {"trace": t_trace, "inter_op": t_stages},
                       (stage_method or method).kind, local)
    return plan, PipelineParts(loss=loss, inter_op=result, placement=placement,
                               local_grads=local,
                               schedule=Schedule(plan.pipeline["schedule"])), step


def forward_only_method(method: PipeshardParallel, loss: LossGraph) -> PipeshardParallel:
    """`method` as a forward-only pipeline runs it: `Schedule.FORWARD` (each forward as soon
    as its input is ready; with no backward every schedule is that one), no recomputation;
    `method` itself for a step with a gradient, which `Schedule.FORWARD` cannot run."""
    if not loss.forward_only:
        if method.schedule is Schedule.FORWARD:
            raise InvalidArgumentError(
                "PipeshardParallel(schedule=Schedule.FORWARD) runs forwards only, but the step "
                "takes a gradient (autopar.value_and_grad). Fix: a training schedule, e.g. "
                "Schedule.ONE_F_ONE_B or Schedule.AUTO.")
        return method
    if method.schedule not in (Schedule.FORWARD, Schedule.AUTO, Schedule.ONE_F_ONE_B):
        log.info("autopar: the step takes no gradient, so it runs as a forward-only pipeline "
                 "(Schedule.FORWARD), not %s", method.schedule.value)
    return dataclasses.replace(method, schedule=Schedule.FORWARD, remat=Remat.NONE)


def _state_pins(loss: LossGraph, result: InterOpResult, method: ShardParallel):
    """`pinned(tid, stage)` for `place`: the sharding the method's own rules give a step
    input that no stage's ILP placed (optimizer state, ...) on that stage's logical mesh:
    ZeRO's sharded optimizer state under gradient accumulation, `sharding_rules` anywhere."""
    if method.kind == MethodKind.PIPESHARD:     # a pipeline's stages follow ShardParallel
        method = ShardParallel(**{f.name: getattr(method, f.name)
                                  for f in dataclasses.fields(ShardParallel)})
    if method.kind == MethodKind.SHARD and not method.sharding_rules:
        return None
    step, options = loss.step, {}

    def pinned(tid: int, stage: int) -> Spec | None:
        shape = result.stages[stage].solution.logical_shape
        if shape not in options:
            options[shape] = method_input_options(step, method, shape, AXIS_NAMES)
        t = step.tensors[tid]
        if t.role == InputRole.BATCH:
            return None
        found = options[shape](tid)
        return found[0] if len(found) == 1 else None
    return pinned


def _readable(records: tuple[dict, ...]) -> tuple:
    """A saved plan's stage solutions; one that cannot be read (a hand-edited plan, another
    format) is reported and left to be solved again."""
    out = []
    for p, record in enumerate(records):
        try:
            out.append(solution_from_record(record))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            log.warning("autopar: the saved plan's solution of stage %d cannot be read (%s: "
                        "%s); solving the stage again", p, type(e).__name__, e)
            out.append(("", None))
    return tuple(out)


def _build_plan(loss, result: InterOpResult, placement: Placement, method, cluster,
                device_ids, mesh_shape, timings, kind: MethodKind,
                local: tuple[LocalGrads | None, ...]) -> ParallelPlan:
    step = loss.step
    m = method.num_microbatches
    budget = float(method.memory_budget_bytes or cluster.memory_bytes)
    # a chunk layout (AUTO's pick of a chunked schedule) runs under its own: its stages share
    # device groups, which no other table places
    chunked = result.schedule if result.schedule in CHUNKED else None
    choice = choose_schedule(loss, result.stages, chunked or method.schedule, m, budget,
                             CHUNKED if chunked and method.schedule is Schedule.AUTO else ())
    stages = []
    for st, (peak_bytes, _) in zip(result.stages, choice.peaks):
        sol = st.solution
        stages.append(StagePlan(
            index=st.slice.index, device_ids=st.device_ids,
            logical_mesh_shape=sol.logical_shape, axis_names=AXIS_NAMES,
            compute_s=sol.compute_s, comm_s=sol.comm_s, reshard_s=sol.reshard_s,
            peak_memory_bytes=peak_bytes,
            layers=st.layers, submesh=st.submesh, latency_s=sol.latency_s,
            activation_bytes=sol.activation_bytes,
            activation_bytes_without_remat=st.activation_bytes_without_remat,
            scopes=_scopes(loss, st.slice.start, st.slice.stop), remat=st.remat.value,
            zero=st.zero))
    schedule = choice.table or make_schedule(choice.schedule, len(stages), m)
    parts = kept_parts(result.stages, loss, schedule)
    peak = max(choice.devices)       # per device: a group's stage chunks together
    lat = [s.latency_s for s in stages]
    out_specs = [spec if spec is not None else replicated(step.tensors[tid].rank)
                 for tid, spec in zip(step.outputs, placement.output_spec)]
    pipeline = {
        "schedule": choice.schedule.value, "num_microbatches": m,
        # Schedule.AUTO: every schedule priced for these stages (the chosen one is above)
        "schedule_search": list(choice.candidates),
        "num_layers": len(result.boundaries) - 1, "layer_boundaries": list(result.boundaries),
        "bubble_fraction": schedule.bubble_fraction, "in_flight": [q for _, q in choice.peaks],
        # per stage: (microbatches in flight, W's deferred) at its peak, and one microbatch's
        # bytes of the step's results it keeps to the end (`schedule_choice.kept_parts`)
        "kept_at_peak": [[q, d] for q, d, _ in parts], "result_bytes": [r for _, _, r in parts],
        # per stage: its devices' peak (stage chunks sharing a group together)
        "device_peak_bytes": [float(b) for b in choice.devices],
        "predicted_latency_s": choice.latency_s,
        "num_ilps": result.num_ilps, "num_reused": result.num_reused,
        "num_replayed": result.num_replayed,
        "dp_candidates": result.dp_candidates, "dp_pruned": result.dp_pruned,
        "dp_time_s": result.dp_time_s, "segments": len(placement.segments),
        "stage_option": type(method.stage_option).__name__,
        "layer_option": type(method.layer_option).__name__,
        "gradient_accumulation": kind != MethodKind.PIPESHARD,
        # one stage: the microbatches loop inside one executable (lowering.accumulate)
        "one_executable": one_executable(len(stages), m),
        "forward_only": loss.forward_only,
        # per stage: gradients accumulated as partial sums and reduced once per step
        "local_gradients": [sum(lg.grad_outputs) if lg else 0 for lg in local],
        "num_gradients": [len(st.slice.param_inputs) for st in result.stages],
        # per loss output (the loss first): how microbatch values combine (inter_op.reduction)
        "microbatch_combine": [o.combine.value for o in loss.reduction.outputs]
        if loss.reduction is not None else [],
    }
    # The step's compute / communication / resharding / call-overhead split, in the stages'
    # proportions; the apply-gradient executables add one call each (gradient accumulation on
    # one mesh: the whole step is one call).
    scale = pipeline["predicted_latency_s"] / max(sum(lat), 1e-30)
    overhead = scale * sum(st.solution.overhead_s for st in result.stages) \
        + len(placement.segments) * cluster.call_overhead_s
    if pipeline["one_executable"]:     # one call per step, not one per task and segment
        tasks = scale * sum(st.solution.overhead_s for st in result.stages)
        pipeline["predicted_latency_s"] += cluster.call_overhead_s - tasks
        overhead = cluster.call_overhead_s
    shift = scale * sum(s.compute_s + s.comm_s + s.reshard_s for s in stages) + overhead \
        - result.chosen_latency_s
    return ParallelPlan(
        method=kind.value, cluster=cluster.name, mesh_shape=tuple(mesh_shape),
        axis_names=AXIS_NAMES, device_ids=tuple(device_ids),
        graph_fingerprint=graph_fingerprint(step),
        inputs=tensor_plans(step, step.inputs, placement.input_spec,
                            stages=placement.input_stage),
        outputs=tensor_plans(step, step.outputs, out_specs, output_paths(step),
                             placement.output_stage),
        constraints=(), operators=(), collectives=(), fallbacks=(), stages=tuple(stages),
        predicted_compute_s=scale * sum(s.compute_s for s in stages),
        predicted_comm_s=scale * sum(s.comm_s for s in stages),
        predicted_reshard_s=scale * sum(s.reshard_s for s in stages),
        predicted_overhead_s=overhead,
        peak_memory_bytes=float(peak),
        memory_budget_bytes=budget,
        timings_s=timings, pipeline=pipeline,
        # the runner-up layouts, on the plan's step time scale (its apply-gradient calls)
        alternatives=tuple({**a, "predicted_step_s": a["predicted_step_s"] + shift}
            if a["predicted_step_s"] is not None else a for a in result.runner_ups),
        stage_solutions=tuple(solution_record(st.solution, graph_fingerprint(st.graph))
                              for st in result.stages))


def with_search_record(plan: ParallelPlan, searched: ParallelPlan, origin: str,
                       lookup_s: float) -> ParallelPlan:
    """`plan`, replayed from `searched` (a cached or saved plan: its stages solved again from
    the saved solutions), with `searched`'s record of the search that produced it: when it
    ran, its timings, its ILP and stage-DP counts, the runner-ups and the compiled checks."""
    kept = ("num_ilps", "num_reused", "dp_candidates", "dp_pruned", "dp_time_s")   # not
    # num_replayed: the stage solutions this replay took from the saved plan
    return dataclasses.replace(
        plan, origin=origin, searched_at=searched.searched_at or plan.searched_at,
        timings_s={**{k: v for k, v in searched.timings_s.items() if k != "plan_lookup"},
                   "plan_lookup": lookup_s},
        pipeline={**plan.pipeline, **{k: searched.pipeline[k] for k in kept
                                      if k in searched.pipeline}},
        alternatives=searched.alternatives or plan.alternatives,
        measured={**searched.measured, **plan.measured})
