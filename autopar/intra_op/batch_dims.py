"""Which dimension of every tensor carries the batch: the data-parallel path of a step.

A method that splits the batch (DataParallel, ZeRO, `ShardParallel(batch_axis=...)`) must keep
it split on every value computed from the batch, not only on the input leaves. This pass
follows the leading dimension of the batch inputs through the graph, primitive by primitive:
a matmul keeps it where it is a batch or free dimension and loses it where it is contracted
(a weight gradient), a reduction over it loses it (a loss, BatchNorm statistics), a reshape
keeps it where it stays the major dimension of its group, and so on. Tensors without a batch
dimension (parameters, gradients, optimizer state, the loss) get None.

Example:
    >>> dims = batch_dims(graph)          # graph of `loss(w, x) = mean((x @ w) ** 2)`
    >>> dims[graph.inputs[1]], dims[graph.outputs[0]]
    (0, None)
"""
from __future__ import annotations

from collections.abc import Mapping

from autopar.core.graph import InputRole, Node, OpGraph
from autopar.core.primitives import (
    AXIS_OPS,
    ELEMENTWISE,
    KEY_OPS,
    LOOP_SLICE,
    LOOP_STACK,
    RANDOM_BITS,
    REDUCTIONS,
)

BatchDims = tuple[int | None, ...]


def batch_sources(graph: OpGraph) -> dict[int, int]:
    """The batch inputs' leading dimensions: {tensor id: 0} for every non-scalar BATCH leaf."""
    return {t: 0 for t in graph.inputs
            if graph.tensors[t].role == InputRole.BATCH and graph.tensors[t].rank > 0}


def batch_dims(graph: OpGraph, sources: Mapping[int, int] | None = None) -> BatchDims:
    """Per tensor id, the dimension that carries the batch, or None. `sources` maps tensor ids
    to their batch dimension (default: `batch_sources(graph)`)."""
    dims: list[int | None] = [None] * len(graph.tensors)
    for tid, d in (batch_sources(graph) if sources is None else sources).items():
        dims[tid] = d
    for node in graph.nodes:
        if not any(dims[t] is not None for t in node.inputs):
            continue
        for tid, d in zip(node.outputs, _propagate(graph, node, dims)):
            t = graph.tensors[tid]
            dims[tid] = d if d is not None and 0 <= d < t.rank else None
    return tuple(dims)


def _shape(graph: OpGraph, tid: int) -> tuple[int, ...]:
    return graph.tensors[tid].shape


def _propagate(graph: OpGraph, node: Node, dims: list) -> list[int | None]:
    name = node.primitive
    rule = _RULES.get(name)
    if rule is None and name in ELEMENTWISE:
        rule = _same_position
    if rule is None and name in REDUCTIONS | {"argmax", "argmin"}:
        rule = _reduction
    if rule is None and name in AXIS_OPS:
        rule = _same_position
    out = rule(graph, node, dims) if rule is not None else None
    if out is None:
        out = _same_position(graph, node, dims)
    return list(out) + [None] * (len(node.outputs) - len(out))


def _same_position(graph: OpGraph, node: Node, dims: list) -> list[int | None]:
    """Each output keeps the batch dimension of an operand of its rank whose batch dimension
    it shares in size (elementwise ops, and the conservative guess for other primitives)."""
    out = []
    for o in node.outputs:
        oshape = _shape(graph, o)
        found = None
        for t in node.inputs:
            d = dims[t]
            shape = _shape(graph, t)
            if d is not None and len(shape) == len(oshape) and shape[d] == oshape[d]:
                found = d
                break
        out.append(found)
    return out


def _first_labelled(node: Node, dims: list, positions=None) -> tuple[int, int] | None:
    for pos, t in enumerate(node.inputs):
        if (positions is None or pos in positions) and dims[t] is not None:
            return pos, dims[t]
    return None


def _reduction(graph, node, dims):
    d = dims[node.inputs[0]]
    axes = set(node.eqn.params.get("axes", ()))
    if d is None or d in axes:
        return [None]
    return [d - sum(1 for a in axes if a < d)]


def _dot_general(graph, node, dims):
    (lc, rc), (lb, rb) = node.eqn.params["dimension_numbers"]
    lrank, rrank = len(_shape(graph, node.inputs[0])), len(_shape(graph, node.inputs[1]))
    lfree = [d for d in range(lrank) if d not in lc and d not in lb]
    rfree = [d for d in range(rrank) if d not in rc and d not in rb]
    for pos, batch, contract, free, offset in ((0, lb, lc, lfree, len(lb)),
                                               (1, rb, rc, rfree, len(lb) + len(lfree))):
        d = dims[node.inputs[pos]]
        if d is None or d in contract:
            continue
        return [list(batch).index(d) if d in batch else offset + free.index(d)]
    return [None]


def _conv(graph, node, dims):
    p = node.eqn.params
    dn = p["dimension_numbers"]
    if dims[node.inputs[0]] == dn.lhs_spec[0] and p.get("batch_group_count", 1) == 1:
        return [dn.out_spec[0]]
    return [None]


def _transpose(graph, node, dims):
    return [list(node.eqn.params["permutation"]).index(dims[node.inputs[0]])]


def _broadcast_in_dim(graph, node, dims):
    d = dims[node.inputs[0]]
    if d is None:
        return [None]
    target = node.eqn.params["broadcast_dimensions"][d]
    same = _shape(graph, node.inputs[0])[d] == _shape(graph, node.outputs[0])[target]
    return [target if same else None]


def _squeeze(graph, node, dims):
    d = dims[node.inputs[0]]
    squeezed = set(node.eqn.params["dimensions"])
    if d is None or d in squeezed:
        return [None]
    return [d - sum(1 for a in squeezed if a < d)]


def _reshape(graph, node, dims):
    from autopar.intra_op.follow import (
        _reshape_groups,  # the follow rule's grouping of reshaped dims
    )
    d = dims[node.inputs[0]]
    if d is None:
        return [None]
    src, dst = _shape(graph, node.inputs[0]), _shape(graph, node.outputs[0])
    for gi, gj in _reshape_groups(src, dst):
        if d in gi:
            major_in = next((x for x in gi if src[x] != 1), None)
            major_out = next((x for x in gj if dst[x] != 1), None)
            return [major_out if d == major_in else None]
    return [None]


def _unchanged_extent(graph, node, dims):
    """slice / dynamic_slice / pad / rev / dynamic_update_slice: kept where the batch
    dimension's extent is unchanged (and for rev and pad: not reversed or padded)."""
    d = dims[node.inputs[0]]
    if d is None:
        return [None]
    p = node.eqn.params
    if node.primitive == "rev" and d in p["dimensions"]:
        return [None]
    if node.primitive == "pad" and any(p["padding_config"][d]):
        return [None]
    same = _shape(graph, node.inputs[0])[d] == _shape(graph, node.outputs[0])[d]
    if node.primitive == "dynamic_update_slice":
        same = same and _shape(graph, node.inputs[1])[d] == _shape(graph, node.inputs[0])[d]
    return [d if same else None]


def _concatenate(graph, node, dims):
    found = _first_labelled(node, dims)
    if found is None or found[1] == node.eqn.params["dimension"]:
        return [None]
    return [found[1]]


def _split(graph, node, dims):
    d = dims[node.inputs[0]]
    keep = d is not None and d != node.eqn.params["axis"]
    return [d if keep else None] * len(node.outputs)


def _gather(graph, node, dims):
    dn = node.eqn.params["dimension_numbers"]
    out_rank = len(_shape(graph, node.outputs[0]))
    offset_dims = tuple(dn.offset_dims)
    batch_out = [d for d in range(out_rank) if d not in offset_dims]
    d_idx = dims[node.inputs[1]]
    idx_rank = len(_shape(graph, node.inputs[1]))
    if d_idx is not None and d_idx < idx_rank - 1:      # a row of indices per example
        return [batch_out[d_idx]]
    d_op = dims[node.inputs[0]]
    if d_op is None:
        return [None]
    op_batching = tuple(getattr(dn, "operand_batching_dims", ()))
    if d_op in op_batching:
        j = tuple(dn.start_indices_batching_dims)[op_batching.index(d_op)]
        return [batch_out[j]]
    operand_shape = _shape(graph, node.inputs[0])
    window = [x for x in range(len(operand_shape)) if x not in dn.collapsed_slice_dims
              and x not in op_batching]
    if d_op in window and node.eqn.params["slice_sizes"][d_op] == operand_shape[d_op] \
            and d_op not in dn.start_index_map:
        return [offset_dims[window.index(d_op)]]
    return [None]


def _scatter(graph, node, dims):
    """The result has the operand's shape: batched where the operand is, or where the
    per-example indices or updates scatter along an operand batching dimension (the
    transpose of `take_along_axis`); a scatter of per-example updates into a shared table
    (an embedding gradient) loses the batch."""
    d = dims[node.inputs[0]]
    dn = node.eqn.params["dimension_numbers"]
    if d is not None:
        return [None if d in dn.scatter_dims_to_operand_dims else d]
    op_batching = tuple(getattr(dn, "operand_batching_dims", ()))
    idx_batching = tuple(getattr(dn, "scatter_indices_batching_dims", ()))
    j = dims[node.inputs[1]]
    if j is None and len(node.inputs) > 2 and dims[node.inputs[2]] is not None:
        update_rank = len(_shape(graph, node.inputs[2]))
        scatter_dims = [x for x in range(update_rank) if x not in dn.update_window_dims]
        du = dims[node.inputs[2]]
        j = scatter_dims.index(du) if du in scatter_dims else None
    if j is not None and j in idx_batching:
        return [op_batching[idx_batching.index(j)]]
    du = dims[node.inputs[2]] if len(node.inputs) > 2 else None
    if du is not None and du in dn.update_window_dims:     # a whole-extent window dimension
        operand_shape = _shape(graph, node.inputs[0])
        window = [x for x in range(len(operand_shape)) if x not in dn.inserted_window_dims
                  and x not in op_batching]
        d = window[list(dn.update_window_dims).index(du)]
        if _shape(graph, node.inputs[2])[du] == operand_shape[d] \
                and d not in dn.scatter_dims_to_operand_dims:
            return [d]
    return [None]


def _loop_slice(graph: OpGraph, node: Node, dims: list) -> list[int | None]:
    """A loop's xs [T, ...] -> its body's slice: the batch moves one dimension down."""
    d = dims[node.inputs[0]]
    return [d - 1 if d is not None and d > 0 else None]


def _loop_stack(graph: OpGraph, node: Node, dims: list) -> list[int | None]:
    """A body's y -> the loop's stacked ys [T, ...]: the batch moves one dimension up."""
    d = dims[node.inputs[0]]
    return [None if d is None else d + 1]


def _key_leading(graph: OpGraph, node: Node, dims: list) -> list[int | None]:
    """Key operations and random bits: a result's leading dimensions are its key operand's
    (`random_bits(keys[B], shape)` is [B, *shape]; `random_unwrap(keys[B])` is [B, 2])."""
    d, shape = dims[node.inputs[0]], _shape(graph, node.inputs[0])
    return [d if d is not None and d < len(_shape(graph, o))
            and _shape(graph, o)[d] == shape[d] else None for o in node.outputs]


_RULES = {
    **{name: _key_leading for name in KEY_OPS | RANDOM_BITS},
    "dot_general": _dot_general, "conv_general_dilated": _conv, "transpose": _transpose,
    "broadcast_in_dim": _broadcast_in_dim, "squeeze": _squeeze, "reshape": _reshape,
    "slice": _unchanged_extent, "dynamic_slice": _unchanged_extent, "pad": _unchanged_extent,
    "rev": _unchanged_extent, "dynamic_update_slice": _unchanged_extent,
    "concatenate": _concatenate, "split": _split, "gather": _gather,
    "scatter": _scatter, "scatter-add": _scatter,
    LOOP_SLICE: _loop_slice, LOOP_STACK: _loop_stack,   # carries keep their position
}

__all__ = ["BatchDims", "batch_dims", "batch_sources"]
