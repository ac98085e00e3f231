"""Follow rules of common layers: pooling windows, their gradients and PRNG key operations.

- Pooling (`reduce_window_*`, generic `reduce_window`): a dimension whose window and stride are
  1, unpadded and undilated (batch, channels) keeps its split; a dimension under a real window
  (the spatial ones) is gathered first. No halo exchange is attempted.
- Max-pool gradients (`select_and_scatter_add`, `select_and_gather_add`, `select_and_scatter`):
  operand, source and result share the layout on the non-window dimensions.
- Key operations (`random_seed`, `random_wrap`, `random_unwrap`, `random_fold_in`,
  `random_split`, `random_clone`): the leading dimensions of a batch of keys keep their split,
  the dimensions a primitive adds (the two words of a raw key, the new keys of a split) are
  whole. A single key is a scalar: it stays replicated.

The random bits themselves (`random_bits`) are a leader (see `random_bits_rule` in rules.py):
they take any layout, so the ILP places them where their consumers want them.

Example (a 2x2 max pool over NHWC keeps a batch split, gathers a split height):
    >>> pool(ctx, node, 0, ((0,), (1,), (), ()))   # doctest: +SKIP
    Strategy(name='follow', in_specs=(((0,), (), (), ()),), out_specs=(((0,), (), (), ()),), ...)
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from autopar.core.graph import Node
from autopar.core.primitives import KEY_OPS, WINDOW_REDUCTIONS, WINDOW_SELECTS
from autopar.core.spec import Spec, num_shards, without_axes
from autopar.intra_op.rules import RuleContext, Strategy


def window_dims(params: dict, rank: int) -> list[int]:
    """Dimensions a window op mixes elements along: window or stride other than 1, padding,
    or base / window dilation. The others map element i to element i."""
    ones = (1,) * rank
    size = params["window_dimensions"]
    stride = params["window_strides"]
    pad = params.get("padding", ((0, 0),) * rank)
    base = params.get("base_dilation", ones) or ones
    dil = params.get("window_dilation", ones) or ones
    return [d for d in range(rank) if size[d] != 1 or stride[d] != 1
            or tuple(pad[d]) != (0, 0) or base[d] != 1 or dil[d] != 1]


def _follow(ctx: RuleContext, node: Node, in_specs: Sequence[Spec | None],
            out_specs: Sequence[Spec]) -> Strategy:
    shards = num_shards(out_specs[0], ctx.mesh_shape) if out_specs else 1
    return Strategy(name="follow", in_specs=tuple(in_specs), out_specs=tuple(out_specs),
                    compute_s=ctx.compute(node, shards) if node.outputs else 0.0, comm_s=0.0)


def _unwindowed(spec: Spec, params: dict) -> Spec:
    dims = window_dims(params, len(spec))
    return without_axes(spec, [a for d in dims for a in spec[d]])


def pool(ctx: RuleContext, node: Node, pos: int, spec: Spec) -> Strategy:
    """`reduce_window_*`: operands (all of one shape) then scalar init values (generic
    `reduce_window` only); one result per operand."""
    want = _unwindowed(spec, node.eqn.params)
    n = len(node.outputs)
    ins = [want if i < n else None for i in range(len(node.inputs))]
    return _follow(ctx, node, ins, [want] * n)


def window_select(ctx: RuleContext, node: Node, pos: int, spec: Spec) -> Strategy:
    """Max-pool gradients. `select_and_scatter_add(source, operand)` -> operand's shape,
    `select_and_gather_add(tangents, operand)` -> pooled shape,
    `select_and_scatter(operand, source, init)`: the window dims differ in size between
    operands and are gathered; the others are equal and keep one split."""
    want = _unwindowed(spec, node.eqn.params)
    ins = [want if ctx.t(t).rank == len(want) else None for t in node.inputs]
    return _follow(ctx, node, ins, [want] * len(node.outputs))


def key_op(ctx: RuleContext, node: Node, pos: int, spec: Spec) -> Strategy:
    """A key operation keeps the split of the leading dims shared by its key operand and its
    result (the shape of a batch of keys); the dims it adds or removes are whole."""
    lead = min(ctx.t(node.inputs[0]).rank, ctx.t(node.outputs[0]).rank, len(spec))
    keep = spec[:lead]

    def spec_for(rank: int) -> Spec | None:
        return keep[:rank] + ((),) * (rank - min(rank, lead)) if rank else None

    ins = [spec_for(ctx.t(t).rank) for t in node.inputs]
    outs = [spec_for(ctx.t(t).rank) or () for t in node.outputs]
    return _follow(ctx, node, ins, outs)


LAYER_FOLLOW_RULES: dict[str, Callable] = {name: pool for name in WINDOW_REDUCTIONS}
LAYER_FOLLOW_RULES.update({name: window_select for name in WINDOW_SELECTS})
LAYER_FOLLOW_RULES.update({name: key_op for name in KEY_OPS})
