"""Plan pass: a traced graph and its sharding assignment -> `ParallelPlan`."""
from __future__ import annotations

import math

from autopar.core.graph import OpGraph
from autopar.core.plan import (
    FallbackPlan,
    OperatorPlan,
    ParallelPlan,
    StagePlan,
    TensorPlan,
    constrained_tensors,
    graph_fingerprint,
)
from autopar.core.primitives import HEAVY_OPERATORS
from autopar.frontend.interpret import RESULT
from autopar.frontend.labels import operator_labels
from autopar.intra_op import ShardingAssignment
from autopar.intra_op.memory import predicted_peak_bytes
from autopar.intra_op.predict import implied_reshards, predict_collectives


def tensor_plans(graph: OpGraph, ids, specs, paths=None, stages=None) -> tuple[TensorPlan, ...]:
    """One TensorPlan per tensor id (an argument or result leaf), with its spec and, in a
    pipeline plan, the stage holding it."""
    out = []
    for pos, tid in enumerate(ids):
        t = graph.tensors[tid]
        out.append(TensorPlan(index=pos, path=paths[pos] if paths else t.path,
                              role=t.role.value if t.role else "result", shape=t.shape,
                              dtype=t.dtype, spec=specs[pos],
                              stage=stages[pos] if stages else 0))
    return tuple(out)


def output_paths(graph: OpGraph) -> list[str]:
    """Names of the results, e.g. "result[3] (next state.params['w'])" for new state."""
    out = []
    for pos in range(len(graph.outputs)):
        src = graph.carried_outputs.get(pos)
        out.append(f"result[{pos}]" + (f" (next {graph.tensors[graph.inputs[src]].path})"
                                       if src is not None else ""))
    return out


def operator_plans(graph: OpGraph, assignment: ShardingAssignment) -> tuple[OperatorPlan, ...]:
    """The chosen strategy of each heavy operator (matmul, convolution, gather, ...); one
    without a name scope is labelled by the parameter it consumes (`operator_labels`)."""
    specs, trips, out = assignment.tensor_specs, graph.node_trips(), []
    heavy = [n for n in graph.nodes if n.primitive in HEAVY_OPERATORS]
    labels = operator_labels(graph, heavy)      # of operators without a name scope (NNX)
    for node in heavy:
        t = graph.tensors[node.outputs[0]]
        out.append(OperatorPlan(
            node=node.id, primitive=node.primitive, strategy=assignment.node_strategy[node.id],
            communication=assignment.node_comm[node.id], source=node.source,
            name_stack=labels.get(node.id, node.name_stack), out_shape=t.shape,
            out_spec=specs[t.id],
            flops=node.flops, compute_s=assignment.node_compute_s[node.id],
            comm_s=assignment.node_comm_s[node.id], trips=trips[node.id]))
    return tuple(out)


def build_plan(graph: OpGraph, assignment: ShardingAssignment, *, method: str, cluster: str,
               device_ids: tuple[int, ...], memory_budget_bytes: float,
               timings_s: dict | None = None, call_overhead_s: float = 0.0,
               cost=None) -> ParallelPlan:
    """The plan of `assignment`; `cost` (the `CostModel` it was solved with) prices the
    predicted resharding collectives."""
    specs = assignment.tensor_specs
    in_specs = [specs[t] for t in graph.inputs]
    # The ILP bounds `assignment.peak_memory_bytes`; XLA also reuses result buffers.
    implied = implied_reshards(graph, assignment)
    peak = predicted_peak_bytes(graph, specs, assignment.mesh_shape,
                                assignment.node_collective_bytes or None,
                                [(r.tensor, r.node, r.dst) for r in implied if r.node != RESULT])
    operators = operator_plans(graph, assignment)
    collectives = predict_collectives(graph, assignment, cost)
    reshards = tuple((r.node, r.operand, r.dst) for r in implied)
    fallbacks = tuple(FallbackPlan(node=f.node, primitive=f.primitive, source=f.source,
                                   reason=f.reason, replicated_bytes=f.replicated_bytes)
                      for f in assignment.fallbacks)
    stage = StagePlan(index=0, device_ids=tuple(device_ids),
                      logical_mesh_shape=assignment.mesh_shape, axis_names=assignment.axis_names,
                      compute_s=assignment.compute_s, comm_s=assignment.comm_s,
                      reshard_s=assignment.reshard_s,
                      peak_memory_bytes=peak)
    ilp = {k: getattr(assignment.ilp, k) for k in assignment.ilp.__slots__}
    assert math.prod(assignment.mesh_shape) == len(device_ids)
    return ParallelPlan(
        method=method, cluster=cluster, mesh_shape=assignment.mesh_shape,
        axis_names=assignment.axis_names, device_ids=tuple(device_ids),
        graph_fingerprint=graph_fingerprint(graph),
        inputs=tensor_plans(graph, graph.inputs, in_specs),
        outputs=tensor_plans(graph, graph.outputs, assignment.output_specs,
                             output_paths(graph)),
        constraints=tuple((t, specs[t])
                          for t in constrained_tensors(graph, assignment.constant_tensors)),
        operators=operators, collectives=collectives, reshards=reshards,
        fallbacks=fallbacks, stages=(stage,),
        predicted_compute_s=assignment.compute_s, predicted_comm_s=assignment.comm_s,
        predicted_reshard_s=assignment.reshard_s, predicted_overhead_s=call_overhead_s,
        peak_memory_bytes=peak,
        memory_budget_bytes=float(memory_budget_bytes), ilp=ilp, timings_s=dict(timings_s or {}))
