"""Sharding strategies per primitive.

Two kinds of rule:
- A *leader* rule enumerates every strategy of a node (dot_general, conv, gather, scatter):
  the node gets an ILP variable of its own.
- A *follow* rule maps the spec of one operand (the one the node follows) to the node's
  strategy; the node shares that operand's ILP variable, so it costs the ILP nothing.

A strategy fixes the spec the node wants for each input (None: any, e.g. a scalar) and the spec
of each output, with a compute time and the time of the collective the strategy implies (e.g.
the all-reduce after a matmul whose contracting dimension is split).
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from autopar.core._format import format_bytes
from autopar.core.graph import Node, OpGraph, Tensor
from autopar.core.spec import Spec, dim_shards, enumerate_specs, num_shards, replicated
from autopar.cost.model import CostModel
from autopar.intra_op.fusion import FusionCosts, fusion_costs


@dataclass(frozen=True, slots=True)
class Strategy:
    name: str
    in_specs: tuple[Spec | None, ...]
    out_specs: tuple[Spec, ...]
    compute_s: float
    comm_s: float
    comm: str = ""            # e.g. "all-reduce(model) 32.0 KiB"
    # Memory of the collective (per device): the unreduced partial sums it reads (a buffer
    # of their own until the collective runs), and what it writes beyond the node's result
    # (a reduce-scatter the backend runs as an all-reduce then a slice: the whole sum).
    partial_bytes: float = 0.0
    collective_out_bytes: float = 0.0


@dataclass(frozen=True, slots=True)
class RuleContext:
    graph: OpGraph
    cost: CostModel
    deferred: frozenset[int]   # nodes whose results reach no heavy op: their collectives are
                               # combined by XLA, so only the bandwidth term is charged
    fusion: FusionCosts | None = None   # bytes per node after XLA's fusion (default: computed
                                        # from `graph` for the mesh's backend)

    def __post_init__(self) -> None:
        if self.fusion is None:
            object.__setattr__(self, "fusion", fusion_costs(
                self.graph, self.cost.mesh.fusion_style))

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return self.cost.mesh.shape

    @property
    def real_axes(self) -> list[int]:
        return [a for a, n in enumerate(self.mesh_shape) if n > 1]

    def t(self, tid: int) -> Tensor:
        return self.graph.tensors[tid]

    def compute(self, node: Node, shards: int) -> float:
        """Roofline time of `node` split `shards` ways: its flops and the bytes it moves once
        XLA has fused it with its neighbours (`fusion.py`: an elementwise chain reads its
        inputs once and writes only what leaves it)."""
        out = self.t(node.outputs[0])
        nbytes = self.fusion.node_bytes[node.id]
        return self.cost.compute_s(node.flops / shards, nbytes / shards, out.dtype)

    def all_reduce(self, node: Node, nbytes: float, axes: Sequence[int]) -> float:
        if not axes:
            return 0.0
        t = self.cost.all_reduce_s(nbytes, axes)
        if node.id in self.deferred:
            t -= self.cost.all_reduce_s(0.0, axes)
        return t

    def all_reduce_label(self, nbytes: float, axes: Sequence[int]) -> str:
        """e.g. "all-reduce(model) 32.0 KiB ring": the collective, its size per device and the
        algorithm the cost model priced; "" without axes."""
        if not axes:
            return ""
        algorithm = self.cost.all_reduce_algorithm(nbytes, axes).value.replace("_", "-")
        return f"all-reduce({self.axis_label(axes)}) {format_bytes(nbytes)} {algorithm}"

    def axis_label(self, axes: Sequence[int]) -> str:
        return "*".join(self.cost.mesh.axis_names[a] for a in axes)


def _spec_from(rank: int, assign: dict[int, list[int]]) -> Spec:
    return tuple(tuple(assign.get(d, ())) for d in range(rank))


# ---------------------------------------------------------------------------------- leaders
def _enumerate_loops(ctx: RuleContext, loops: list[tuple[str, dict[int, int]]],
                     shapes: list[tuple[int, ...]]) -> list[dict[int, list[tuple[str, dict]]]]:
    """Assign every real mesh axis to one loop (or none). A loop is (label, {operand: dim}),
    with operand -1 for the output. Returns, per valid assignment, loop index -> axes."""
    real = ctx.real_axes
    out = []
    for choice in itertools.product(range(-1, len(loops)), repeat=len(real)):
        used: dict[int, list[int]] = {}
        for axis, li in zip(real, choice):
            if li >= 0:
                used.setdefault(li, []).append(axis)
        ok = True
        for li, axes in used.items():
            n = math.prod(ctx.mesh_shape[a] for a in axes)
            for operand, dim in loops[li][1].items():
                if shapes[operand][dim] % n:
                    ok = False
        if ok:
            out.append(used)
    return out


def _loop_strategies(ctx: RuleContext, node: Node, loops, reduce_loops: set[int]) -> list[Strategy]:
    """Strategies of an einsum-like node from loops: operand dims that move together.
    Axes on a loop in `reduce_loops` leave partial sums: an all-reduce of the output."""
    operands = list(node.inputs) + [node.outputs[0]]
    shapes = [ctx.t(t).shape for t in operands]
    out_pos = len(operands) - 1
    out_t = ctx.t(node.outputs[0])
    strategies = []
    for used in _enumerate_loops(ctx, [(lbl, {(out_pos if k == -1 else k): d for k, d in m.items()})
                                       for lbl, m in loops], shapes):
        assigns = [dict() for _ in operands]
        red_axes: list[int] = []
        names = []
        for li, axes in sorted(used.items()):
            label, mapping = loops[li]
            names.append(f"{label}@{ctx.axis_label(axes)}")
            for operand, dim in mapping.items():
                assigns[out_pos if operand == -1 else operand].setdefault(dim, []).extend(axes)
            if li in reduce_loops:
                red_axes.extend(axes)
        specs = [_spec_from(len(s), a) for s, a in zip(shapes, assigns)]
        shards = math.prod(ctx.mesh_shape[a] for axes in used.values() for a in axes)
        out_bytes = out_t.nbytes / num_shards(specs[-1], ctx.mesh_shape)
        name, compute_s = " ".join(names) or "replicated", ctx.compute(node, shards)
        strategies.append(Strategy(name=name, in_specs=tuple(specs[:-1]), out_specs=(specs[-1],),
                                   compute_s=compute_s,
                                   comm_s=ctx.all_reduce(node, out_bytes, red_axes),
                                   comm=ctx.all_reduce_label(out_bytes, red_axes),
                                   partial_bytes=out_bytes if red_axes else 0.0))
        if red_axes and node.id in ctx.deferred:
            strategies += _reduce_scatter_variants(ctx, node, strategies[-1], red_axes,
                                                   out_bytes)
    return strategies


def _reduce_scatter_variants(ctx: RuleContext, node: Node, s: Strategy, red_axes: list[int],
                             in_bytes: float) -> list[Strategy]:
    """`s` with its partial sums reduce-scattered onto one output dimension instead of
    all-reduced: the strategy ZeRO's gradients take (each device keeps the reduced shard it
    updates). Offered for nodes that feed no heavy operator (gradients on their way to the
    optimizer), where the scattered result is worth its smaller update and memory."""
    out = []
    spec, shape = s.out_specs[0], ctx.t(node.outputs[0]).shape
    n = math.prod(ctx.mesh_shape[a] for a in red_axes)
    whole = ctx.cost.mesh.reduce_scatter_is_all_reduce   # XLA:CPU: all-reduce, then a slice
    for d in range(len(shape)):
        if spec[d] or shape[d] % n:
            continue
        scattered = spec[:d] + (tuple(red_axes),) + spec[d + 1:]
        comm_s = ctx.cost.reduce_scatter_s(in_bytes, red_axes) \
            - ctx.cost.reduce_scatter_s(0.0, red_axes)       # deferred: combined by XLA
        label = (f"reduce-scatter({ctx.axis_label(red_axes)}) {format_bytes(in_bytes)}")
        out.append(Strategy(name=f"{s.name} rs{d}", in_specs=s.in_specs,
                            out_specs=(scattered,), compute_s=s.compute_s, comm_s=comm_s,
                            comm=label, partial_bytes=in_bytes,
                            collective_out_bytes=in_bytes if whole else 0.0))
    return out


def dot_general_rule(ctx: RuleContext, node: Node) -> list[Strategy]:
    (lc, rc), (lb, rb) = node.eqn.params["dimension_numbers"]
    lhs, rhs = ctx.t(node.inputs[0]), ctx.t(node.inputs[1])
    lfree = [d for d in range(lhs.rank) if d not in lc and d not in lb]
    rfree = [d for d in range(rhs.rank) if d not in rc and d not in rb]
    loops, out = [], 0
    for i, (a, b) in enumerate(zip(lb, rb)):
        loops.append((f"b{i}", {0: a, 1: b, -1: out}))
        out += 1
    for d in lfree:
        loops.append((f"i{d}", {0: d, -1: out}))
        out += 1
    for d in rfree:
        loops.append((f"j{d}", {1: d, -1: out}))
        out += 1
    reduce = set()
    for i, (a, b) in enumerate(zip(lc, rc)):
        reduce.add(len(loops))
        loops.append((f"k{i}", {0: a, 1: b}))
    return _loop_strategies(ctx, node, loops, reduce)


def conv_rule(ctx: RuleContext, node: Node) -> list[Strategy]:
    """Loops of a convolution: the batch (n); without groups the output features (o) and the
    contracted input features (c, an all-reduce). With `feature_group_count` G > 1 (grouped,
    depthwise) the feature groups (g) move the lhs input features, the rhs output features and
    the output features together; with `batch_group_count` G > 1 (the weight gradient of a
    grouped conv) the groups move the lhs batch with the output features, and the lhs features
    are contracted (c). A group loop splits only over a number of devices that divides G, so
    that every device holds whole groups: depthwise channels split need no collective."""
    p = node.eqn.params
    dn = p["dimension_numbers"]
    lhs_spec, rhs_spec, out_spec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
    fgc, bgc = p.get("feature_group_count", 1), p.get("batch_group_count", 1)
    reduce = set()
    if fgc == 1 and bgc == 1:
        loops = [("n", {0: lhs_spec[0], -1: out_spec[0]}),
                 ("o", {1: rhs_spec[0], -1: out_spec[1]}),
                 ("c", {0: lhs_spec[1], 1: rhs_spec[1]})]
        reduce.add(2)
        return _loop_strategies(ctx, node, loops, reduce)
    if bgc == 1:
        groups, group_dim = fgc, lhs_spec[1]
        loops = [("n", {0: lhs_spec[0], -1: out_spec[0]}),
                 ("g", {0: lhs_spec[1], 1: rhs_spec[0], -1: out_spec[1]})]
    else:
        groups, group_dim = bgc, lhs_spec[0]
        loops = [("g", {0: lhs_spec[0], 1: rhs_spec[0], -1: out_spec[1]}),
                 ("c", {0: lhs_spec[1], 1: rhs_spec[1]})]
        reduce.add(1)
    return [s for s in _loop_strategies(ctx, node, loops, reduce)
            if groups % dim_shards(s.in_specs[0], group_dim, ctx.mesh_shape) == 0]


def random_bits_rule(ctx: RuleContext, node: Node) -> list[Strategy]:
    """A generator: the bits take every layout of their shape, so the ILP places them where
    their consumers (a dropout mask's `select_n`) want them. The key (a scalar, or a batch of
    keys on the leading dims) is replicated or split like those dims. With JAX's partitionable
    threefry (`jax_threefry_partitionable`, the default) each device computes only its shard of
    the bits, and they equal the unsharded ones."""
    key, out = ctx.t(node.inputs[0]), ctx.t(node.outputs[0])
    strategies = []
    for spec in enumerate_specs(out.shape, ctx.mesh_shape):
        split = [f"d{d}@{ctx.axis_label(axes)}" for d, axes in enumerate(spec) if axes]
        strategies.append(Strategy(
            name=" ".join(split) or "replicated",
            in_specs=(spec[:key.rank] if key.rank else None,) + (None,) * (len(node.inputs) - 1),
            out_specs=(spec,), compute_s=ctx.compute(node, num_shards(spec, ctx.mesh_shape)),
            comm_s=0.0))
    return strategies


def gather_rule(ctx: RuleContext, node: Node) -> list[Strategy]:
    dn = node.eqn.params["dimension_numbers"]
    slice_sizes = node.eqn.params["slice_sizes"]
    operand, indices = ctx.t(node.inputs[0]), ctx.t(node.inputs[1])
    out = ctx.t(node.outputs[0])
    offset_dims = tuple(dn.offset_dims)
    batch_out = [d for d in range(out.rank) if d not in offset_dims]   # <-> indices dims [:-1]
    op_batching = tuple(getattr(dn, "operand_batching_dims", ()))
    idx_batching = tuple(getattr(dn, "start_indices_batching_dims", ()))
    window = [d for d in range(operand.rank) if d not in dn.collapsed_slice_dims
              and d not in op_batching]
    loops, reduce = [], set()
    for j in range(indices.rank - 1):
        if j in idx_batching:
            i = op_batching[idx_batching.index(j)]
            loops.append((f"b{j}", {0: i, 1: j, -1: batch_out[j]}))
        else:
            loops.append((f"idx{j}", {1: j, -1: batch_out[j]}))
    for k, d in enumerate(window):
        if slice_sizes[d] == operand.shape[d] and d not in dn.start_index_map:
            loops.append((f"w{d}", {0: d, -1: offset_dims[k]}))
    for d in dn.start_index_map:
        if d in dn.collapsed_slice_dims and slice_sizes[d] == 1:
            reduce.add(len(loops))
            loops.append((f"table{d}", {0: d}))
    return _loop_strategies(ctx, node, loops, reduce)


def scatter_rule(ctx: RuleContext, node: Node) -> list[Strategy]:
    dn = node.eqn.params["dimension_numbers"]
    operand, indices, updates = (ctx.t(t) for t in node.inputs[:3])
    op_batching = tuple(getattr(dn, "operand_batching_dims", ()))
    idx_batching = tuple(getattr(dn, "scatter_indices_batching_dims", ()))
    upd_scatter = [d for d in range(updates.rank) if d not in dn.update_window_dims]
    window_ops = [d for d in range(operand.rank) if d not in dn.inserted_window_dims
                  and d not in op_batching]
    loops, reduce = [], set()
    additive = node.primitive == "scatter-add"
    for j in range(indices.rank - 1):
        u = upd_scatter[j]
        if j in idx_batching:
            i = op_batching[idx_batching.index(j)]
            loops.append((f"b{j}", {0: i, 1: j, 2: u, -1: i}))
        elif additive:
            reduce.add(len(loops))
            loops.append((f"upd{j}", {1: j, 2: u}))
    for k, d in enumerate(window_ops):
        u = dn.update_window_dims[k]
        if updates.shape[u] == operand.shape[d] and d not in dn.scatter_dims_to_operand_dims:
            loops.append((f"w{d}", {0: d, 2: u, -1: d}))
    return _loop_strategies(ctx, node, loops, reduce)


def replicated_rule(ctx: RuleContext, node: Node) -> list[Strategy]:
    """Conservative fallback: every input gathered, every output replicated."""
    ins = tuple(replicated(ctx.t(t).rank) for t in node.inputs)
    outs = tuple(replicated(ctx.t(t).rank) for t in node.outputs)
    compute = ctx.compute(node, 1) if node.outputs else 0.0
    return [Strategy(name="replicated", in_specs=ins, out_specs=outs, compute_s=compute,
                     comm_s=0.0)]


LEADER_RULES: dict[str, Callable[[RuleContext, Node], list[Strategy]]] = {
    "dot_general": dot_general_rule,
    "conv_general_dilated": conv_rule,
    "gather": gather_rule,
    "scatter-add": scatter_rule,
    "scatter": scatter_rule,
    "random_bits": random_bits_rule,
}
