"""Follow rules: cheap nodes take the sharding of one operand and share its ILP variable.

`follow_strategy(ctx, node, pos, spec)` returns the node's strategy when its operand at
position `pos` has sharding `spec`. Dimensions the primitive cannot keep split (the axis of a
sort, a sliced dimension, the non-major side of a reshape merge) are gathered: the wanted
input spec drops those axes and the reshard cost is charged to the node.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from autopar.core.graph import Node
from autopar.core.primitives import AXIS_OPS, ELEMENTWISE, REDUCTIONS
from autopar.core.spec import Spec, num_shards, replicated, without_axes
from autopar.intra_op.layer_rules import LAYER_FOLLOW_RULES
from autopar.intra_op.loops import LOOP_FOLLOW_RULES
from autopar.intra_op.rules import RuleContext, Strategy


def _drop_dims(spec: Spec, dims) -> Spec:
    dims = set(dims)
    axes = [a for d in dims for a in spec[d]]
    return without_axes(spec, axes)


def _strategy(ctx: RuleContext, node: Node, in_specs, out_specs, name: str,
              comm_s: float = 0.0, comm: str = "", shards: int | None = None) -> Strategy:
    """A follower's strategy; its compute is split `shards` ways (default: as its first
    result is)."""
    if shards is None:
        shards = num_shards(out_specs[0], ctx.mesh_shape) if out_specs else 1
    compute = ctx.compute(node, shards) if node.outputs else 0.0
    return Strategy(name=name, in_specs=tuple(in_specs), out_specs=tuple(out_specs),
                    compute_s=compute, comm_s=comm_s, comm=comm)


def _same_shape_inputs(ctx, node, spec):
    """Wanted specs of elementwise operands: the node's spec, except on size-1 (broadcast)
    dimensions; scalars are taken as they are."""
    out_shape = ctx.t(node.outputs[0]).shape
    wanted = []
    for t in node.inputs:
        shape = ctx.t(t).shape
        if not shape:
            wanted.append(None)
        elif len(shape) == len(out_shape):
            wanted.append(tuple(spec[d] if shape[d] == out_shape[d] else ()
                                for d in range(len(shape))))
        else:
            wanted.append(replicated(len(shape)))
    return wanted


def elementwise(ctx, node, pos, spec):
    outs = [spec for _ in node.outputs]
    return _strategy(ctx, node, _same_shape_inputs(ctx, node, spec), outs, "follow")


def bitcast_convert_type(ctx, node, pos, spec):
    """Elementwise when the bit width is kept; a changed width adds or drops a minor dim,
    which stays unsplit."""
    out = ctx.t(node.outputs[0])
    if out.rank == len(spec):
        return elementwise(ctx, node, pos, spec)
    if out.rank > len(spec):
        return _strategy(ctx, node, [spec], [spec + ((),)], "follow")
    want = _drop_dims(spec, [len(spec) - 1])
    return _strategy(ctx, node, [want], [want[:-1]], "follow")


def broadcast_in_dim(ctx, node, pos, spec):
    out = ctx.t(node.outputs[0])
    operand = ctx.t(node.inputs[0])
    bdims = node.eqn.params["broadcast_dimensions"]
    want = list(spec)
    assign = [()] * out.rank
    for i, d in enumerate(bdims):
        if operand.shape[i] == out.shape[d]:
            assign[d] = spec[i]
        else:
            want[i] = ()
    ins = [tuple(want)] + [None] * (len(node.inputs) - 1)
    # A broadcast that adds elements is fused by XLA into its consumers, which take their
    # own shard of it (a replicated broadcast feeding a batch-split product is never
    # materialized whole): charge it as split over every device.
    shards = math.prod(ctx.mesh_shape) if operand.size < out.size else None
    return _strategy(ctx, node, ins, [tuple(assign)], "follow", shards=shards)


def transpose(ctx, node, pos, spec):
    perm = node.eqn.params["permutation"]
    return _strategy(ctx, node, [spec], [tuple(spec[p] for p in perm)], "follow")


def squeeze(ctx, node, pos, spec):
    dims = set(node.eqn.params["dimensions"])
    return _strategy(ctx, node, [spec], [tuple(s for d, s in enumerate(spec) if d not in dims)],
                     "follow")


def _reshape_groups(src: tuple[int, ...], dst: tuple[int, ...]):
    """Pairs of (src dims, dst dims) whose element counts match, major to minor."""
    groups, i, j = [], 0, 0
    while i < len(src) and j < len(dst):
        gi, gj, ps, pd = [i], [j], src[i], dst[j]
        i, j = i + 1, j + 1
        while ps != pd and (i < len(src) or j < len(dst)):
            if (ps < pd and i < len(src)) or j >= len(dst):
                ps, i = ps * src[i], i + 1
                gi.append(i - 1)
            else:
                pd, j = pd * dst[j], j + 1
                gj.append(j - 1)
        groups.append((gi, gj))
    if groups:  # trailing size-1 dims
        groups[-1][0].extend(range(i, len(src)))
        groups[-1][1].extend(range(j, len(dst)))
    return groups


def reshape(ctx, node, pos, spec):
    src = ctx.t(node.inputs[0]).shape
    dst = ctx.t(node.outputs[0]).shape
    perm = node.eqn.params.get("dimensions")
    split = spec
    if perm is not None:   # the operand is transposed by `dimensions` first
        src, split = tuple(src[d] for d in perm), tuple(spec[d] for d in perm)
    assign: list[tuple[int, ...]] = [()] * len(dst)
    drop: list[int] = []
    for gi, gj in _reshape_groups(src, dst):
        major_in = next((d for d in gi if src[d] != 1), None)
        major_out = next((d for d in gj if dst[d] != 1), None)
        for d in gi:
            if not split[d]:
                continue
            n = 1
            for a in split[d]:
                n *= ctx.mesh_shape[a]
            if d == major_in and major_out is not None and dst[major_out] % n == 0:
                assign[major_out] = split[d]
            else:
                drop.extend(split[d])
    want = without_axes(spec, drop)
    ins = [want] + [None] * (len(node.inputs) - 1)
    return _strategy(ctx, node, ins, [tuple(assign)], "follow")


def reduce(ctx, node, pos, spec):
    axes = set(node.eqn.params["axes"])
    out_spec = tuple(s for d, s in enumerate(spec) if d not in axes)
    red = [a for d in axes for a in spec[d]]
    out = ctx.t(node.outputs[0])
    nbytes = out.nbytes / num_shards(out_spec, ctx.mesh_shape)
    comm_s = ctx.all_reduce(node, nbytes, red)
    comm = ctx.all_reduce_label(nbytes, red)
    # The work is split as the operand is: a reduced split dim leaves partial results.
    s = _strategy(ctx, node, [spec], [out_spec] * len(node.outputs), "follow", comm_s, comm,
                  shards=num_shards(spec, ctx.mesh_shape))
    return dataclasses.replace(s, partial_bytes=nbytes) if red else s


def gather_on_axis(ctx, node, pos, spec):
    p = node.eqn.params
    if "axes" in p:
        dims = list(p["axes"])
    elif "dimension" in p:
        dims = [p["dimension"]]
    elif "axis" in p:
        dims = [p["axis"]]
    else:
        dims = [len(spec) - 1]
    dims = [d % max(len(spec), 1) for d in dims]
    want = _drop_dims(spec, dims)
    if node.primitive in ("argmax", "argmin"):
        outs = [tuple(s for d, s in enumerate(want) if d not in dims)]
    else:
        outs = [want for _ in node.outputs]
    ins = [want if ctx.t(t).shape == ctx.t(node.inputs[0]).shape else None for t in node.inputs]
    return _strategy(ctx, node, ins, outs, "follow")


def slicing(ctx, node, pos, spec):
    """slice / dynamic_slice / pad / rev: dims whose extent changes are gathered."""
    src = ctx.t(node.inputs[0])
    out = ctx.t(node.outputs[0])
    changed = [d for d in range(src.rank) if src.shape[d] != out.shape[d]]
    if node.primitive == "pad":
        changed = [d for d, (lo, hi, it) in enumerate(node.eqn.params["padding_config"])
                   if lo or hi or it]
    if node.primitive == "rev":
        changed = list(node.eqn.params["dimensions"])
    want = _drop_dims(spec, changed)
    ins = [want] + [None] * (len(node.inputs) - 1)
    return _strategy(ctx, node, ins, [want], "follow")


def dynamic_update_slice(ctx, node, pos, spec):
    operand, update = ctx.t(node.inputs[0]), ctx.t(node.inputs[1])
    changed = [d for d in range(operand.rank) if operand.shape[d] != update.shape[d]]
    want = _drop_dims(spec, changed)
    ins = [want, want] + [None] * (len(node.inputs) - 2)
    return _strategy(ctx, node, ins, [want], "follow")


def concatenate(ctx, node, pos, spec):
    want = _drop_dims(spec, [node.eqn.params["dimension"]])
    return _strategy(ctx, node, [want] * len(node.inputs), [want], "follow")


def split(ctx, node, pos, spec):
    want = _drop_dims(spec, [node.eqn.params["axis"]])
    return _strategy(ctx, node, [want], [want] * len(node.outputs), "follow")


FOLLOW_RULES: dict[str, Callable] = {name: elementwise for name in ELEMENTWISE}
FOLLOW_RULES.update({name: reduce for name in REDUCTIONS})
FOLLOW_RULES.update({name: gather_on_axis for name in AXIS_OPS})
FOLLOW_RULES.update({
    "broadcast_in_dim": broadcast_in_dim, "transpose": transpose, "squeeze": squeeze,
    "reshape": reshape, "slice": slicing, "dynamic_slice": slicing, "pad": slicing,
    "rev": slicing, "dynamic_update_slice": dynamic_update_slice,
    "concatenate": concatenate, "split": split, "bitcast_convert_type": bitcast_convert_type,
})
FOLLOW_RULES.update(LAYER_FOLLOW_RULES)   # pooling, max-pool gradients, PRNG keys
FOLLOW_RULES.update(LOOP_FOLLOW_RULES)    # a loop's xs slices and ys stacks


def main_operand(ctx: RuleContext, node: Node, preference) -> int | None:
    """Position of the operand a follower follows: the largest non-scalar operand, preferring
    the one `preference(tensor)` ranks highest (e.g. one with a choice of shardings over one
    computed from constants)."""
    best, best_key = None, None
    for pos, t in enumerate(node.inputs):
        tensor = ctx.t(t)
        key = (tensor.rank > 0, preference(t), tensor.size, -pos)
        if best_key is None or key > best_key:
            best, best_key = pos, key
    return best
