"""Local gradient accumulation: reduce a parameter's gradient over the data axes once per step,
not once per microbatch (as Alpa did).

With the batch split over mesh axes R, the operator that makes a weight gradient (a matmul
contracting the batch, a sum over it, the scatter of an embedding gradient) leaves partial sums
on each device, and XLA all-reduces them at once. Under gradient accumulation and in a pipeline
that reduction would run for every microbatch. Here such an operator runs under a `shard_map`
manual over R that keeps each device's partial sum as a leading dimension of size |R| (split
over R, so every device holds its own partial and nothing moves); the linear operators between
it and the gradient output (reshape, transpose, adds of partials, scaling) run on the partials;
the accumulator adds partials; and one reduction per stage and step sums the leading dimension
(an all-reduce, or a reduce-scatter where the gradient's sharding is split) before the
optimizer update. An operator whose result reaches the gradient through anything else keeps
its per-microbatch reduction.

Example:
    >>> local = find_local_grads(graph, spec_of, dims, grad_outputs)
    >>> local.reducers        # node id -> the mesh axes its partial sums are kept over
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import PartitionSpec

from autopar.core import _compat
from autopar.core.graph import OpGraph, TensorKind
from autopar.core.spec import Spec
from autopar.frontend.interpret import resharded, run_nodes
from autopar.frontend.loops import region_at
from autopar.inter_op.pipeline import LossGraph
from autopar.inter_op.stage_solve import stage_batch_sources, stage_io
from autopar.inter_op.stages import ChosenStage
from autopar.intra_op.batch_dims import batch_dims

# Operators linear in their partial operand(s): they may run on partial sums.
_UNARY_LINEAR = frozenset({"reshape", "transpose", "convert_element_type", "neg", "copy",
                           "copy_p", "squeeze", "broadcast_in_dim", "reduce_sum", "rev",
                           "slice", "dynamic_slice", "expand_dims"})
_ALL_PARTIAL = frozenset({"add", "add_any", "sub", "concatenate"})   # every float operand
_ONE_PARTIAL = {"mul": (0, 1), "div": (0,), "dot_general": (0, 1)}   # positions it may be


@dataclass(frozen=True, slots=True, kw_only=True)
class LocalGrads:
    reducers: dict[int, tuple[int, ...]]     # node id -> mesh axes of its kept partial sums
    split_dims: dict[int, tuple[int | None, ...]]   # reducer -> per operand, the dimension
                                                     # split over those axes (its batch)
    partial: dict[int, tuple[int, ...]]      # tensor id -> mesh axes it is partial over
    grad_outputs: tuple[bool, ...]           # per parameter gradient output: partial?

    def __bool__(self) -> bool:
        return bool(self.reducers)


def _is_zeros(graph: OpGraph, tid: int) -> bool:
    """A tensor that is a broadcast literal zero (the operand JAX scatters gradients into)."""
    t = graph.tensors[tid]
    if t.kind == TensorKind.CONST:
        return not np.any(np.asarray(graph.const_values.get(tid, 1)))
    if t.kind != TensorKind.INTERMEDIATE:
        return False
    node = graph.nodes[t.producer]
    return node.primitive == "broadcast_in_dim" and _is_zeros(graph, node.inputs[0])


def _split_dims(graph: OpGraph, node, dims) -> tuple[int | None, ...] | None:
    """If `node` sums the batch away (a matmul contracting it, a sum over it, the kernel
    gradient of a convolution, a scatter of per-example updates into zeros) and its result
    has no batch dimension: per operand, the dimension to split with the batch (so that each
    device's local operation is its share of the sum), else None."""
    if any(dims[o] is not None for o in node.outputs) or len(node.outputs) != 1:
        return None
    p, name = node.eqn.params, node.primitive
    ins = node.inputs
    if name == "dot_general":
        (lc, rc), (lb, rb) = p["dimension_numbers"]
        # the batch dimension of a labelled operand and its partner in the other operand
        for i, (mine, theirs) in enumerate(((lc, rc), (rc, lc))):
            d = dims[ins[i]]
            if d is not None and d in mine:
                split = [None, None]
                split[i], split[1 - i] = d, theirs[list(mine).index(d)]
                other = dims[ins[1 - i]]
                return tuple(split) if other in (None, split[1 - i]) else None
        return None
    if name == "reduce_sum":
        d = dims[ins[0]]
        return (d,) if d is not None and d in p["axes"] else None
    labelled = tuple(dims[t] for t in ins)
    if name == "conv_general_dilated" and p.get("feature_group_count", 1) == 1 \
            and p.get("batch_group_count", 1) == 1 and all(d is not None for d in labelled):
        return labelled
    if name == "scatter-add" and labelled[0] is None and _is_zeros(graph, ins[0]) \
            and all(d is not None for d in labelled[1:3]):
        return labelled
    return None


def _reduced_axes(graph: OpGraph, node, dims, spec_of) -> tuple[int, ...] | None:
    """The mesh axes the batch dimension of `node`'s batch-split operands is split over, if
    `node` sums the batch away (see `_split_dims`). Where the operands are split over nested
    axes (an embedding's token ids over `data`, its cotangent rows over `data` x `model`),
    the finest: the others are sliced to it on each device, which moves nothing."""
    split = _split_dims(graph, node, dims)
    if split is None:
        return None
    axes = {spec_of(t)[dims[t]] if spec_of(t) is not None else ()
            for t in node.inputs if dims[t] is not None}
    finest = max(axes, key=len)
    if not all(axes) or any(a != finest[:len(a)] for a in axes):
        return None
    return finest


def _linear_in(node, partial_positions: Sequence[int], float_positions: Sequence[int]) -> bool:
    name = node.primitive
    if name in _UNARY_LINEAR:
        return tuple(partial_positions) == (0,)
    if name in _ALL_PARTIAL:
        return set(partial_positions) == set(float_positions)
    allowed = _ONE_PARTIAL.get(name)
    return allowed is not None and len(partial_positions) == 1 and \
        partial_positions[0] in allowed


def find_local_grads(graph: OpGraph, spec_of: Callable[[int], Spec | None], dims,
                     grad_outputs: Sequence[int]) -> LocalGrads:
    """Which operators keep their partial sums (see the module docstring). `spec_of(tid)`: the
    plan's sharding of a tensor; `dims`: `batch_dims` of the graph; `grad_outputs`: the
    tensor ids of the parameter gradients. A partial value must reach only gradient outputs,
    through linear operators whose other operands are not partial over other axes."""
    consumers = graph.consumers()
    grads = set(grad_outputs)
    other_outputs = set(graph.outputs) - grads
    candidates = {}
    for node in graph.nodes:
        axes = _reduced_axes(graph, node, dims, spec_of)
        if axes is not None:
            candidates[node.id] = axes
    # Forward: where partial sums would flow if every candidate kept them.
    partial: dict[int, tuple[int, ...]] = {}
    ok_node: dict[int, bool] = {}
    for node in graph.nodes:
        if node.id in candidates:
            partial[node.outputs[0]] = candidates[node.id]
            continue
        pos = [i for i, t in enumerate(node.inputs) if t in partial]
        if not pos:
            continue
        floats = [i for i, t in enumerate(node.inputs)
                  if graph.tensors[t].dtype.startswith(("float", "bfloat"))]
        axes = {partial[node.inputs[i]] for i in pos}
        ok_node[node.id] = len(axes) == 1 and len(node.outputs) == 1 and _linear_in(
            node, pos, floats) and not any(dims[node.inputs[i]] is not None
                                           for i in range(len(node.inputs)) if i not in pos)
        partial[node.outputs[0]] = next(iter(axes))
    # Backward: a partial tensor is fine when it is a gradient output, or every reader is a
    # linear operator whose result is fine; it must never be another output.
    fine: dict[int, bool] = {}
    for tid in sorted(partial, key=lambda t: -(graph.tensors[t].producer or 0)):
        readers = consumers[tid]
        fine[tid] = tid not in other_outputs and (tid in grads or bool(readers)) and all(
            ok_node.get(c, False) and fine.get(graph.nodes[c].outputs[0], False)
            for c in readers)
    reducers = {n: a for n, a in candidates.items() if fine.get(graph.nodes[n].outputs[0])}
    # Keep the partials reachable from a kept reducer only.
    kept: dict[int, tuple[int, ...]] = {}
    for node in graph.nodes:
        if node.id in reducers:
            kept[node.outputs[0]] = reducers[node.id]
        elif any(t in kept for t in node.inputs) and ok_node.get(node.id):
            kept[node.outputs[0]] = next(kept[t] for t in node.inputs if t in kept)
    # A linear operator mixing kept and not-kept partial operands would add a full sum to
    # partial ones: drop such reducers' chains (rare; keep it exact).
    for node in graph.nodes:
        pos = [t for t in node.inputs if t in partial]
        if pos and any(t in kept for t in pos) and not all(t in kept for t in pos):
            return LocalGrads(reducers={}, split_dims={}, partial={},
                              grad_outputs=(False,) * len(grad_outputs))
    split = {n: _split_dims(graph, graph.nodes[n], dims) for n in reducers}
    return LocalGrads(reducers=reducers, split_dims=split, partial=kept,
                      grad_outputs=tuple(t in kept for t in grad_outputs))


def stage_local_grads(loss: LossGraph, stage: ChosenStage) -> LocalGrads:
    """The gradients of a chosen pipeline (or gradient-accumulation) stage that accumulate as
    partial sums, read off its plan: the stage ILP's shardings and the batch path."""
    sl, sol, graph = stage.slice, stage.solution, stage.graph
    io = stage_io(loss, sl)
    specs = dict(sol.constraints)
    specs.update(zip(graph.inputs, (*sol.param_specs, *sol.data_specs, *sol.act_specs,
                                    *sol.out_specs[:len(io.float_outputs)])))
    dims = batch_dims(graph, stage_batch_sources(loss, sl, graph))
    n_out = len(io.float_outputs) + len(io.int_outputs)
    return find_local_grads(graph, specs.get, dims,
                            graph.outputs[n_out:n_out + len(sl.param_inputs)])


def partial_spec(spec: Spec, axes: tuple[int, ...]) -> Spec:
    """The sharding of a partial value: the kept-partial dimension first, split over `axes`,
    then the value's own dimensions without those axes."""
    return (tuple(axes),) + tuple(tuple(a for a in d if a not in axes) for d in spec)


def run_nodes_local(graph: OpGraph, nodes, env: dict, specs: dict[int, Spec],
                    local: LocalGrads, mesh, named: Callable,
                    reshard: dict[tuple[int, int], tuple] | None = None) -> None:
    """`frontend.interpret.run_nodes` with the kept partial sums: reducers run under a
    `shard_map` manual over their axes, linear readers of partial values run vmapped over the
    partial dimension, and every pinned value is constrained to its spec (`partial_spec` for a
    partial one). `reshard`: as for `run_nodes` (a partial operand is never moved)."""
    names, reshard = mesh.axis_names, reshard or {}
    regions, skip_to, constrain = region_at(graph), -1, None
    for node in nodes:
        if node.id < skip_to:
            continue
        if node.id in regions:   # a loop: no partial sums cross it (its pseudo-nodes are
            region = regions[node.id][0]         # not linear), so it runs as planned
            if constrain is None:
                constrain = {t: named(mesh, s) for t, s in specs.items() if s is not None}
            run_nodes(graph, graph.nodes[region.start:region.stop], env, constrain, reshard)
            skip_to = region.stop
            continue
        eqn = node.eqn
        prim, params = eqn.primitive, eqn.params
        with _compat.equation_context(eqn):
            ins = [env[t] if t in local.partial else resharded(env, t, reshard.get((node.id, i)))
                   for i, t in enumerate(node.inputs)]
            if node.id in local.reducers:
                manual = tuple(names[a] for a in local.reducers[node.id])
                in_specs = tuple(_manual_spec(len(np.shape(x)), d, manual)
                                 for x, d in zip(ins, local.split_dims[node.id]))
                out = jax.shard_map(lambda *xs: prim.bind(*xs, **params)[None], mesh=mesh,
                                    in_specs=in_specs, out_specs=PartitionSpec(manual),
                                    axis_names=set(manual), check_vma=False)(*ins)
                outs = (out,)
            elif any(t in local.partial for t in node.inputs):
                axes_in = tuple(0 if t in local.partial else None for t in node.inputs)
                outs = (jax.vmap(lambda *xs: prim.bind(*xs, **params), in_axes=axes_in)(*ins),)
            else:
                outs = prim.bind(*ins, **params)
                if not prim.multiple_results:
                    outs = (outs,)
            for tid, val in zip(node.outputs, outs):
                spec = specs.get(tid)
                if spec is not None and tid in local.partial:
                    spec = partial_spec(spec, local.partial[tid])
                env[tid] = (val if spec is None else
                            jax.lax.with_sharding_constraint(val, named(mesh, spec)))


def _manual_spec(rank: int, dim: int | None, manual: tuple[str, ...]) -> PartitionSpec:
    """A `shard_map` operand spec naming only the manual axes: on the batch dimension of a
    batch-split operand, none for the others (replicated over those axes)."""
    if dim is None:
        return PartitionSpec()
    entries: list = [None] * rank
    entries[dim] = manual if len(manual) > 1 else manual[0]
    return PartitionSpec(*entries)
