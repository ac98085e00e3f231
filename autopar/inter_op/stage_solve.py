"""One pipeline stage's intra-op plan: the ILP over the stage's forward + backward graph on
one logical mesh, giving its microbatch latency, memory and the sharding of every tensor.

The stage's training function takes (params, microbatch data, activations in, cotangents of
its outputs) and returns (outputs, parameter gradients, activation gradients); it is traced
into an `OpGraph` and solved exactly like a ShardParallel step. `split_train_graph` cuts that
graph into its forward part (what does not depend on the cotangents) and its backward part;
the residuals are what the backward reads from the forward.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from autopar.core.graph import OpGraph, TensorKind
from autopar.core.options import MethodKind, ShardParallel
from autopar.core.plan import StageSolution, constrained_tensors
from autopar.core.spec import Spec, dim_shards, num_shards
from autopar.cost.cluster import ClusterSpec, LogicalMesh
from autopar.cost.model import CostModel
from autopar.frontend.interpret import run_nodes
from autopar.frontend.loops import atomic_spans
from autopar.frontend.tracer import trace
from autopar.inter_op.pipeline import LossGraph, StageSlice
from autopar.intra_op.batch_dims import batch_dims
from autopar.intra_op.memory import schedule
from autopar.intra_op.phases import run_order, tail_nodes
from autopar.intra_op.planner import operator_plans
from autopar.intra_op.predict import implied_reshards, predict_collectives
from autopar.intra_op.solve import (
    IntraOpProblem,
    ShardingAssignment,
    build_intra_op,
    latency_bound,
    least_memory,
    solve_built,
)


def is_float(dtype: str) -> bool:
    return dtype.startswith(("float", "bfloat", "complex"))


@dataclass(frozen=True, slots=True, kw_only=True)
class StageIO:
    """A stage's edges, split by differentiability (the vjp needs float values only)."""
    float_acts: tuple[int, ...]
    int_acts: tuple[int, ...]
    float_outputs: tuple[int, ...]
    int_outputs: tuple[int, ...]


def stage_io(loss: LossGraph, sl: StageSlice) -> StageIO:
    t = loss.forward.tensors
    return StageIO(float_acts=tuple(a for a in sl.act_inputs if is_float(t[a].dtype)),
                   int_acts=tuple(a for a in sl.act_inputs if not is_float(t[a].dtype)),
                   float_outputs=tuple(o for o in sl.outputs if is_float(t[o].dtype)),
                   int_outputs=tuple(o for o in sl.outputs if not is_float(t[o].dtype)))


def stage_body(loss: LossGraph, sl: StageSlice, io: StageIO) -> Callable:
    """body(params, data, float_acts, int_acts) -> (float outputs, int outputs)."""
    fwd = loss.forward
    nodes = fwd.nodes[sl.start:sl.stop]

    def body(params, data, float_acts, int_acts):
        env: dict[int, Any] = dict(fwd.const_values)
        env.update(zip((fwd.inputs[p] for p in sl.param_inputs), params))
        env.update(zip((fwd.inputs[p] for p in sl.data_inputs), data))
        env.update(zip(io.float_acts, float_acts))
        env.update(zip(io.int_acts, int_acts))
        run_nodes(fwd, nodes, env)
        return [env[t] for t in io.float_outputs], [env[t] for t in io.int_outputs]

    return body


def stage_train_fn(loss: LossGraph, sl: StageSlice, io: StageIO) -> Callable:
    """train(params, data, float_acts, int_acts, cts) -> (float outs, int outs, param grads,
    act grads): one microbatch's forward and backward of the stage."""
    body = stage_body(loss, sl, io)

    def train(params, data, float_acts, int_acts, cts):
        outs, vjp_fn, int_outs = jax.vjp(lambda p, a: body(p, data, a, int_acts), params,
                                         float_acts, has_aux=True)
        grads, act_grads = vjp_fn(cts)
        return outs, int_outs, grads, act_grads

    return train


def _aval(t) -> jax.ShapeDtypeStruct:
    """The abstract value of graph tensor `t` (a typed PRNG key keeps its own dtype)."""
    return jax.ShapeDtypeStruct(t.shape, t.key_dtype if t.dtype == "key" else jnp.dtype(t.dtype))


def trace_stage(loss: LossGraph, sl: StageSlice) -> OpGraph:
    """The stage's training graph (inputs: params, data, float acts, int acts, cotangents);
    of a forward-only stage, its forward graph (no cotangents, no gradients)."""
    io = stage_io(loss, sl)
    fwd = loss.forward
    ins = lambda ids: [_aval(fwd.tensors[i]) for i in ids]
    args = (ins(fwd.inputs[p] for p in sl.param_inputs),
            ins(fwd.inputs[p] for p in sl.data_inputs),
            ins(io.float_acts), ins(io.int_acts))
    if sl.forward_only:
        return trace(stage_body(loss, sl, io), args, batch_argnums=(1,))
    return trace(stage_train_fn(loss, sl, io), (*args, ins(io.float_outputs)),
                 batch_argnums=(1,))


def forward_batch_dims(loss: LossGraph) -> dict:
    """`intra_op.batch_dims` of the loss's forward graph from its batch inputs."""
    fwd = loss.forward
    return batch_dims(fwd, {fwd.inputs[p]: 0 for p in loss.batch_inputs
                            if fwd.tensors[fwd.inputs[p]].rank})


def stage_batch_sources(loss: LossGraph, sl: StageSlice, graph: OpGraph,
                        dims: dict | None = None) -> dict[int, int]:
    """The batch dimension of each input of the stage's training graph (`trace_stage`): its
    data inputs' leading one, and for activations and output cotangents the one they have
    in the loss's forward graph (`dims`: `forward_batch_dims(loss)`, computed if not given)."""
    dims = forward_batch_dims(loss) if dims is None else dims
    io = stage_io(loss, sl)
    n = len(sl.param_inputs)
    out = {t: 0 for t in graph.inputs[n:n + len(sl.data_inputs)] if graph.tensors[t].rank}
    rest = graph.inputs[n + len(sl.data_inputs):]
    for tid, f in zip(rest, (*io.float_acts, *io.int_acts, *io.float_outputs)):
        if dims[f] is not None:
            out[tid] = dims[f]
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainSplit:
    """A stage training graph cut in two: node ids of each part (in graph order) and the
    residuals, the tensors the backward reads from the forward or from the stage's inputs."""
    forward_nodes: tuple[int, ...]
    backward_nodes: tuple[int, ...]
    residuals: tuple[int, ...]


def cotangent_inputs(graph: OpGraph, sl: StageSlice) -> tuple[int, ...]:
    """The training graph's last inputs: one cotangent per float output of the stage (the
    graph's outputs are the stage outputs, then the gradients); none in a forward-only one."""
    if sl.forward_only:
        return ()
    num_cts = sum(is_float(graph.tensors[t].dtype) for t in graph.outputs[:len(sl.outputs)])
    return tuple(graph.inputs[len(graph.inputs) - num_cts:])


def split_train_graph(graph: OpGraph, sl: StageSlice) -> TrainSplit:
    """The backward is every node that depends on the cotangent inputs (one per float output
    of the stage, the graph's last inputs) or on a rematerialization's barrier (the
    recomputation of a `jax.checkpoint`, which the backward runs from the checkpoint's saved
    inputs); nodes computed from constants alone go to both parts (each recomputes what it
    needs, so they are never kept)."""
    if sl.forward_only:                # no backward: nothing is kept for one
        return TrainSplit(forward_nodes=tuple(range(len(graph.nodes))), backward_nodes=(),
                          residuals=())
    late = set(cotangent_inputs(graph, sl))
    const_only = {t.id for t in graph.tensors if t.kind == TensorKind.CONST}
    forward, backward = [], []
    for start, stop in atomic_spans(graph):      # a loop region goes to one side whole
        ids = range(start, stop)
        made = {t for n in ids for t in graph.nodes[n].outputs}
        reads = [t for n in ids for t in graph.nodes[n].inputs if t not in made]
        if any(t in late for t in reads) or any(graph.nodes[n].barrier is not None
                                                for n in ids):
            late.update(made)
            backward.extend(ids)
        elif all(t in const_only for t in reads):
            const_only.update(made)
            forward.extend(ids)
            backward.extend(ids)
        else:
            forward.extend(ids)
    made_late = set(backward)
    read = [t for n in backward for t in graph.nodes[n].inputs] \
        + list(graph.outputs[len(sl.outputs):])          # the gradients
    residuals = dict.fromkeys(
        t for t in read if t not in late and t not in const_only
        and not (graph.tensors[t].kind == TensorKind.INTERMEDIATE
                 and graph.tensors[t].producer in made_late))
    return TrainSplit(forward_nodes=tuple(forward), backward_nodes=tuple(backward),
                      residuals=tuple(residuals))


@dataclass(frozen=True, slots=True)
class BackwardSplit:
    """A stage backward cut in two: B (`input_nodes`: what the activation gradients need)
    and W (`weight_nodes`: the rest of what the parameter gradients need); `handoff` are the
    tensors W reads that B computes or receives (the output cotangents), which B returns."""
    input_nodes: tuple[int, ...]
    weight_nodes: tuple[int, ...]
    handoff: tuple[int, ...]


def split_backward(graph, backward_nodes, n_out: int, n_grads: int, cts) -> BackwardSplit:
    """Cut the stage's backward (`backward_nodes`; graph outputs: `n_out` stage outputs, then
    `n_grads` parameter gradients, then the activation gradients) into B and W. A loop region
    (a scanned backward) stays whole on B's side, its parameter gradients handed to W."""
    ids = set(backward_nodes)
    producer = {t: n for n in backward_nodes for t in graph.nodes[n].outputs}
    spans = {n: (a, b) for a, b in atomic_spans(graph) for n in range(a, b) if n in ids}

    def needed(targets) -> set[int]:
        seen: set[int] = set()
        stack = [producer[t] for t in targets if t in producer]
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            a, b = spans.get(n, (n, n + 1))
            for k in range(a, b):
                if k in ids and k not in seen:
                    seen.add(k)
                    stack += [producer[t] for t in graph.nodes[k].inputs if t in producer]
        return seen

    b = needed(graph.outputs[n_out + n_grads:])
    w = needed(graph.outputs[n_out:n_out + n_grads]) - b
    reads = {t for n in w for t in graph.nodes[n].inputs}
    reads.update(graph.outputs[n_out:n_out + n_grads])
    made_by_b = [t for n in backward_nodes if n in b for t in graph.nodes[n].outputs]
    handoff = tuple(dict.fromkeys(t for t in (*made_by_b, *cts) if t in reads))
    return BackwardSplit(input_nodes=tuple(n for n in backward_nodes if n in b),
                         weight_nodes=tuple(n for n in backward_nodes if n in w),
                         handoff=handoff)


def stage_backward_split(graph: OpGraph, sl: StageSlice, backward_nodes=None) -> BackwardSplit:
    """`split_backward` of a stage's training graph (its outputs, parameter gradients and
    activation gradients as `stage_io` orders them); `backward_nodes`: its backward where the
    caller has split the graph already (`split_train_graph`)."""
    if backward_nodes is None:
        backward_nodes = split_train_graph(graph, sl).backward_nodes
    return split_backward(graph, backward_nodes, len(sl.outputs), len(sl.param_inputs),
                          cotangent_inputs(graph, sl))


def _weight_bytes(graph: OpGraph, sl: StageSlice, split: TrainSplit, specs,
                  mesh_shape) -> float:
    """Per device, what a microbatch keeps from its B to its W where a schedule splits the
    backward: the forward's residuals W reads, and B's hand-off (what W reads that B made
    or received: the output cotangents)."""
    if sl.forward_only or not split.backward_nodes:
        return 0.0
    parts = stage_backward_split(graph, sl, split.backward_nodes)
    reads = {t for n in parts.weight_nodes for t in graph.nodes[n].inputs}
    kept = [t for t in split.residuals if t in reads
            and graph.tensors[t].kind == TensorKind.INTERMEDIATE] + list(parts.handoff)
    return float(sum(graph.tensors[t].nbytes / num_shards(specs[t], mesh_shape)
                     for t in dict.fromkeys(kept)))


def _residual_bytes(graph: OpGraph, split: TrainSplit, specs, mesh_shape) -> float:
    """Per-device bytes made by the forward and read by the backward (what a microbatch keeps
    alive between its forward and its backward; inputs are held anyway)."""
    return float(sum(graph.tensors[t].nbytes / num_shards(specs[t], mesh_shape)
                     for t in split.residuals
                     if graph.tensors[t].kind == TensorKind.INTERMEDIATE))


def deferred_bytes(graph: OpGraph, specs, mesh_shape, grads, edges=()) -> float:
    """Per device, the temporaries the weight-gradient tail reads that are live when it
    starts: the memory model runs the nodes from which no matmul is reachable after the
    whole backward (`intra_op.phases.run_order`), so what the weight-gradient matmuls of a
    layer read (its matmuls' inputs and output cotangents) stays live from its backward to
    the end. In a stage of several layers, the later layers' (whose backward runs first)
    are live through the earlier layers' backward, so a span adds them up. `grads`: the
    tensors of the parameter gradients (what the tail counted here leads to; the tail that
    makes the activations' cotangents feeds the previous layer's backward in a span).
    `edges`: the graph's activation and cotangent inputs, which the tail's reading counts
    too: in a span they are temporaries made by the neighbouring layers."""
    key = (id(graph), tuple(grads), tuple(edges))
    hit = _DEFERRED.get(key)
    if hit is None or hit[0] is not graph:
        hit = _DEFERRED[key] = (graph, _deferred_tensors(graph, grads, edges))
        while len(_DEFERRED) > 64:
            _DEFERRED.pop(next(iter(_DEFERRED)))
    model = schedule(graph).model
    return float(sum(model.nbytes(graph, t) / num_shards(specs[model.size_of[t]], mesh_shape)
                     for t in hit[1]))


_DEFERRED: dict = {}      # (graph id, grads, edges) -> (graph, `_deferred_tensors`)


def _deferred_tensors(graph: OpGraph, grads, edges) -> tuple[int, ...]:
    """The tensors `deferred_bytes` counts (they depend on the graph only)."""
    tail = tail_nodes(graph)
    needed = set(grads)                   # tail nodes that lead to a parameter gradient
    weight_tail = set()
    for node in reversed(graph.nodes):
        if node.id in tail and any(o in needed for o in node.outputs):
            weight_tail.add(node.id)
            needed.update(node.inputs)
    if not weight_tail:
        return ()
    events = schedule(graph)
    model, order = events.model, run_order(graph)
    start = min(model.pos[n] for n in tail)
    read = {t for n in weight_tail for t in graph.nodes[n].inputs}
    return tuple([t for p, born in events.born.items() if p < start for t in born
                  if start <= model.end[t] < len(order) and order[model.end[t]] in weight_tail]
                 + [t for t in edges if t in read])


def stage_input_paths(loss: LossGraph, sl: StageSlice) -> tuple[str, ...]:
    """The user's path of each parameter and data input of the stage's graph (the step's
    input leaf the gradient marker reads; "" where that operand is computed), for
    `sharding_rules`."""
    step = loss.step
    operands = step.nodes[loss.grad_node].inputs

    def path(pos: int) -> str:
        t = step.tensors[operands[pos]]
        return t.path if t.kind == TensorKind.INPUT else ""
    return tuple(path(p) for p in sl.param_inputs + sl.data_inputs)


@dataclass(frozen=True, slots=True, kw_only=True)
class StageProblem:
    """A stage's ILP on one logical mesh, built once and solved at any memory budget."""
    graph: OpGraph
    slice: StageSlice
    ilp: IntraOpProblem
    logical: LogicalMesh

    def least_bytes(self, *, in_flight: int | None = None, opt_ratio: float = 0.0) -> float:
        """The least peak bytes per device of any plan of the stage: of one microbatch, or
        with `in_flight` the pipeline's peak as `solve` counts it."""
        return least_memory(self.ilp, self._held(in_flight, opt_ratio))

    def solve(self, budget: float | None = None, *, in_flight: int | None = None,
              opt_ratio: float = 0.0) -> StageSolution:
        """The fastest plan whose peak fits `budget` (default: the method's budget). With
        `in_flight`, the peak is the pipeline's as the stage DP counts it: one microbatch's
        peak, plus a gradient accumulator and `opt_ratio` bytes of optimizer state per
        parameter byte, plus the activations of `in_flight - 1` more microbatches.

        Raises:
          InfeasiblePlanError: the stage cannot fit the budget on this logical mesh.
        """
        return _stage_solution(self.graph, self.slice, self.logical,
                               solve_built(self.ilp, budget,
                                           held=self._held(in_flight, opt_ratio)))

    def latency_bound(self, budget: float | None = None) -> float:
        """A lower bound of the `latency_s` of any plan `solve` returns at `budget` or less
        (None: at any budget; `intra_op.solve.latency_bound` plus the calls' overhead)."""
        return latency_bound(self.ilp, budget) + self.slice.calls * self.logical.call_overhead_s

    def _held(self, in_flight: int | None, opt_ratio: float) -> dict[int, float]:
        held = {}
        if in_flight is not None and not self.slice.forward_only:   # no accumulator then
            graph, n_params = self.graph, len(self.slice.param_inputs)
            held = {t: 1.0 + opt_ratio for t in graph.inputs[:n_params]}
            for t in split_train_graph(graph, self.slice).residuals:
                if graph.tensors[t].kind == TensorKind.INTERMEDIATE:
                    held[t] = held.get(t, 0.0) + in_flight - 1
        return held


def stage_problem(graph: OpGraph, sl: StageSlice, cluster: ClusterSpec,
                  logical_shape: tuple[int, ...], axis_names: tuple[str, ...],
                  method: ShardParallel, input_paths: tuple[str, ...] = (), *,
                  points_above: float | None = None,
                  batch_sources: dict[int, int] | None = None) -> StageProblem:
    """Build the stage's ILP on `logical_shape`; `input_paths` (see `stage_input_paths`) name
    its first inputs for `method.sharding_rules`; `points_above=0` keeps every memory point
    (for `least_bytes` and budgets below the method's); `batch_sources` (see
    `stage_batch_sources`) seeds the batch path a method pins."""
    logical = cluster.logical_mesh(tuple(logical_shape), tuple(axis_names))
    # A pipeline's stage is sharded like a ShardParallel step with the pipeline's solver
    # settings; gradient accumulation's one stage keeps its method's rules (data, ZeRO).
    inner = method if method.kind != MethodKind.PIPESHARD else ShardParallel(
        **{f.name: getattr(method, f.name) for f in dataclasses.fields(ShardParallel)})
    paths = tuple(input_paths) + ("",) * (len(graph.inputs) - len(input_paths))
    ilp = build_intra_op(graph, CostModel(mesh=logical), inner, {}, paths,
                         points_above=points_above, batch_sources=batch_sources)
    return StageProblem(graph=graph, slice=sl, ilp=ilp, logical=logical)


def solve_stage(graph: OpGraph, sl: StageSlice, cluster: ClusterSpec,
                logical_shape: tuple[int, ...], axis_names: tuple[str, ...],
                method: ShardParallel, input_paths: tuple[str, ...] = ()) -> StageSolution:
    """Build and solve the stage's ILP on `logical_shape` (see `stage_problem`).

    Raises:
      InfeasiblePlanError: the stage cannot fit the memory budget on this logical mesh.
    """
    return stage_problem(graph, sl, cluster, logical_shape, axis_names, method,
                         input_paths).solve()


def zero_spec(spec: Spec, shape, mesh_shape, axis: int = 0) -> Spec | None:
    """`spec` with the data axis added to the first dimension it divides (ZeRO's split of a
    parameter's optimizer state), or None where the axis is trivial, already used, or
    divides no dimension."""
    if mesh_shape[axis] <= 1 or any(axis in dim for dim in spec):
        return None
    for d, (size, dim) in enumerate(zip(shape, spec)):
        if size % (dim_shards(spec, d, mesh_shape) * mesh_shape[axis]) == 0:
            return spec[:d] + ((*dim, axis),) + spec[d + 1:]
    return None


def _stage_solution(graph: OpGraph, sl: StageSlice, logical: LogicalMesh,
                    a: ShardingAssignment) -> StageSolution:
    logical_shape = logical.shape
    specs = a.tensor_specs
    ins = [specs[t] for t in graph.inputs]          # params, data, acts, output cotangents
    outs = a.output_specs                           # outputs, param grads, act grads
    p, d = len(sl.param_inputs), len(sl.data_inputs)
    n_act, n_out = len(sl.act_inputs), len(sl.outputs)
    param_bytes = sum(graph.tensors[t].nbytes / num_shards(specs[t], logical_shape)
                      for t in graph.inputs[:p])
    grad_bytes = sum(graph.tensors[t].nbytes / num_shards(s, logical_shape)
                     for t, s in zip(graph.outputs[n_out:n_out + p], outs[n_out:n_out + p]))
    split = split_train_graph(graph, sl)
    overhead = sl.calls * logical.call_overhead_s
    return StageSolution(
        deferred_bytes=deferred_bytes(graph, specs, logical_shape,
                                      graph.outputs[n_out:n_out + p], graph.inputs[p + d:]),
        logical_shape=tuple(logical_shape),
        latency_s=a.compute_s + a.comm_s + a.reshard_s + overhead, overhead_s=overhead,
        compute_s=a.compute_s, comm_s=a.comm_s, reshard_s=a.reshard_s,
        peak_memory_bytes=a.peak_memory_bytes,
        activation_bytes=_residual_bytes(graph, split, specs, logical_shape),
        weight_bytes=0.0 if sl.forward_only else _weight_bytes(graph, sl, split, specs,
                                                               logical_shape),
        param_bytes=param_bytes, grad_bytes=grad_bytes, trains=not sl.forward_only,
        param_specs=tuple(ins[:p]), data_specs=tuple(ins[p:p + d]),
        act_specs=tuple(ins[p + d:p + d + n_act]), out_specs=tuple(outs[:n_out]),
        grad_specs=tuple(outs[n_out:n_out + p]), ilp=a.ilp,
        **_zero_fields(graph, ins[:p], logical),
        constraints=tuple((t, specs[t]) for t in constrained_tensors(graph,
                                                                        a.constant_tensors)),
        reshards=tuple((r.node, r.operand, r.dst) for r in implied_reshards(graph, a)),
        operators=operator_plans(graph, a),
        collectives=predict_collectives(graph, a, CostModel(mesh=logical)))


def _zero_fields(graph: OpGraph, param_specs, logical: LogicalMesh) -> dict:
    """`StageSolution`'s ZeRO fields: the parameter bytes per device whose optimizer state
    the data axis splits, and the per-step all-gather of the updated parameters."""
    shape = logical.shape
    split = sum(graph.tensors[t].nbytes / num_shards(spec, shape)
                for t, spec in zip(graph.inputs, param_specs)
                if zero_spec(spec, graph.tensors[t].shape, shape) is not None)
    return dict(zero_split_bytes=split, zero_gather_s=CostModel(mesh=logical).all_gather_s(
        split, (0,)) if split else 0.0)


def mirrored(sol: StageSolution, graph: OpGraph, logical: LogicalMesh) -> StageSolution:
    """`sol`, a plan on the logical mesh (a, b), as the same plan on `logical` = (b, a): every
    spec with its two mesh axes swapped. Where the two meshes' axes cost the same (swapped),
    the ILPs are the same problem up to that renaming, so this is an optimum of the other
    (its ZeRO fields are recomputed: ZeRO splits over axis 0).

        >>> mirrored(sol_on_1x8, graph, cluster.logical_mesh((8, 1))).logical_shape
        (8, 1)
    """
    swap = lambda spec: tuple(tuple(1 - a for a in dim) for dim in spec)
    specs = lambda v: tuple(swap(x) for x in v)
    param_specs = specs(sol.param_specs)
    return dataclasses.replace(
        sol, logical_shape=tuple(logical.shape), param_specs=param_specs,
        data_specs=specs(sol.data_specs), act_specs=specs(sol.act_specs),
        out_specs=specs(sol.out_specs), grad_specs=specs(sol.grad_specs),
        constraints=tuple((t, swap(x)) for t, x in sol.constraints),
        reshards=tuple((n, i, swap(x)) for n, i, x in sol.reshards),
        **_zero_fields(graph, param_specs, logical), **_mirrored_records(sol, logical))


def _mirrored_records(sol: StageSolution, logical: LogicalMesh) -> dict:
    """`sol`'s operator and collective records with the two mesh axes swapped (specs, and the
    axis names in strategy and collective labels)."""
    a, b = logical.axis_names[:2]
    pattern = re.compile(rf"\b({re.escape(a)}|{re.escape(b)})\b")
    name = lambda text: pattern.sub(lambda m: b if m.group(1) == a else a, text)
    swap = lambda spec: tuple(tuple(1 - x for x in dim) for dim in spec)
    return dict(
        operators=tuple(dataclasses.replace(o, strategy=name(o.strategy),
                                            communication=name(o.communication),
                                            out_spec=swap(o.out_spec)) for o in sol.operators),
        collectives=tuple(dataclasses.replace(c, detail=name(c.detail), src=swap(c.src),
                                              dst=swap(c.dst), axes=tuple(map(name, c.axes)))
                          for c in sol.collectives))
