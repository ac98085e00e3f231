"""The driver for `PipeshardParallel`: trace -> split the loss -> layers -> stages (DP over
intra-op ILP costs) -> apply-gradient placement -> plan; then lower and run.

Example:
    >>> method = autopar.PipeshardParallel(num_microbatches=4,
    ...                                    stage_option=autopar.UniformStageOption(num_stages=2))
    >>> step = autopar.parallelize(train_step, mesh=mesh, method=method)
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax

from .cluster import ClusterSpec
from .errors import InvalidArgumentError
from .inter_op.apply_grad import Placement, place
from .inter_op.pipeline import LossGraph, layer_boundaries, split_step
from .inter_op.stages import AXIS_NAMES, InterOpResult, choose_stages
from .options import PipeshardParallel
from .plan import ParallelPlan, StagePlan, graph_fingerprint
from .planner import output_paths, tensor_plans
from .primitives import HEAVY_OPERATORS
from .runtime.schedule import make_schedule
from .spec import replicated
from .trace import _abstract, check_argnums, trace

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class PipelineParts:
    loss: LossGraph
    inter_op: InterOpResult
    placement: Placement


def microbatch_args(args: tuple, batch_argnums: Sequence[int], num_microbatches: int) -> tuple:
    """Abstract arguments with every batch leaf's leading dimension divided by M."""
    batch = check_argnums("batch_argnums", batch_argnums, len(args))
    out = []
    for i, a in enumerate(args):
        if i not in batch:
            out.append(a)
            continue

        def shrink(x):
            x = _abstract(x)
            if not x.shape or x.shape[0] % num_microbatches:
                raise InvalidArgumentError(
                    f"num_microbatches={num_microbatches}: a leaf of batch argument {i} has shape "
                    f"{tuple(x.shape)}, whose leading (batch) dimension is not divisible by "
                    f"{num_microbatches}. Fix: choose num_microbatches dividing the batch size.")
            return jax.ShapeDtypeStruct((x.shape[0] // num_microbatches, *x.shape[1:]), x.dtype)
        out.append(jax.tree_util.tree_map(shrink, a))
    return tuple(out)


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
                  donate_argnums=()) -> tuple[ParallelPlan, PipelineParts, Any]:
    """Plan a pipeline; returns (plan, the parts the lowering needs, the step graph)."""
    t0 = time.perf_counter()
    kw = dict(static_argnums=static_argnums, batch_argnums=batch_argnums,
              donate_argnums=donate_argnums, keep_grad=True)
    step = trace(fun, args, **kw)
    m = method.num_microbatches
    micro = trace(fun, microbatch_args(args, batch_argnums, m), **kw) if m > 1 else step
    loss = split_step(step, micro, m)
    t_trace = time.perf_counter() - t0
    bounds = layer_boundaries(loss.forward, method.layer_option)
    log.info("autopar: loss cut into %d layers (%d forward operators)", len(bounds) - 1,
             len(loss.forward.nodes))
    t1 = time.perf_counter()
    result = choose_stages(loss, tuple(bounds), cluster, tuple(device_ids), method)
    placement = place(loss, result.stages)
    t_stages = time.perf_counter() - t1
    plan = _build_plan(loss, result, placement, method, cluster, device_ids, mesh_shape,
                       {"trace": t_trace, "inter_op": t_stages})
    return plan, PipelineParts(loss=loss, inter_op=result, placement=placement), step


def _build_plan(loss, result: InterOpResult, placement: Placement, method, cluster,
                device_ids, mesh_shape, timings) -> ParallelPlan:
    step = loss.step
    m = method.num_microbatches
    stages = []
    for st in result.stages:
        sol = st.solution
        stages.append(StagePlan(
            index=st.slice.index, device_ids=st.device_ids,
            logical_mesh_shape=sol.logical_shape, axis_names=AXIS_NAMES,
            compute_s=sol.compute_s, comm_s=sol.comm_s, reshard_s=sol.reshard_s,
            peak_memory_bytes=sol.peak_memory_bytes,
            layers=st.layers, submesh=st.submesh, latency_s=sol.latency_s,
            activation_bytes=sol.activation_bytes,
            scopes=_scopes(loss, st.slice.start, st.slice.stop)))
    schedule = make_schedule(method.schedule, len(stages), m)
    in_flight = schedule.in_flight()
    peak = max(s.peak_memory_bytes + (q - 1) * s.activation_bytes
               for s, q in zip(stages, in_flight))
    lat = [s.latency_s for s in stages]
    out_specs = [spec if spec is not None else replicated(step.tensors[tid].rank)
                 for tid, spec in zip(step.outputs, placement.output_spec)]
    pipeline = {
        "schedule": method.schedule.value, "num_microbatches": m,
        "num_layers": len(result.boundaries) - 1, "layer_boundaries": list(result.boundaries),
        "bubble_fraction": schedule.bubble_fraction, "in_flight": list(in_flight),
        "predicted_latency_s": sum(lat) + (m - 1) * max(lat),
        "num_ilps": result.num_ilps, "num_reused": result.num_reused,
        "dp_candidates": result.dp_candidates, "dp_pruned": result.dp_pruned,
        "dp_time_s": result.dp_time_s, "segments": len(placement.segments),
        "stage_option": type(method.stage_option).__name__,
        "layer_option": type(method.layer_option).__name__,
    }
    # The step's compute / communication / resharding split, in the stages' proportions.
    scale = pipeline["predicted_latency_s"] / max(sum(lat), 1e-30)
    return ParallelPlan(
        method=method.kind.value, cluster=cluster.name, mesh_shape=tuple(mesh_shape),
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
        peak_memory_bytes=float(peak),
        memory_budget_bytes=float(method.memory_budget_bytes or cluster.memory_bytes),
        timings_s=timings, pipeline=pipeline)
