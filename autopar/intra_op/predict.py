"""Predict every collective a sharding assignment compiles to, and check a prediction against
compiled HLO.

Two sources of collectives:
- *strategies*: the collective a chosen strategy implies (`Strategy.comm`: the all-reduce after
  a contraction over a split dimension, a reduce-scatter of a gradient, a reduction over a split
  dimension);
- *resharding*: a tensor lies in its producer's spec but a consumer wants another spec (an ILP
  edge, or a reshard inside one variable group), or a carried result must move into the
  sharding of the argument it replaces next step.

A resharding goes through `reshard_path`: elementary steps, each of which XLA's SPMD
partitioner turns into at most one collective (checked on jax 0.10.2, XLA:CPU):
  - `collective-permute`: the same number of shards per dimension on other axes;
  - `all-to-all`: the minor axis of one dimension moves to the minor end of another;
  - `all-gather`: the axes of one dimension past its common prefix with the target are
    gathered (one all-gather over their product);
  - `slice`: axes appended to the minor end of dimensions: each device slices, no collective.
The lowering constrains every intermediate layout of a path (`lowering/single_mesh.py`), so XLA
never changes a layout in one step that would need more than one collective: that is what makes
it replicate the whole tensor ("Involuntary full rematerialization", see `CostModel.reshard_s`).

Works on the graph and the assignment alone: no devices, no compile.

Example:
    >>> [s.kind for s in reshard_path((8, 8), 4, ((0, 1), ()), ((), (0,)), (2, 2))]
    ['all-gather', 'all-to-all']
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from autopar.core._format import format_bytes
from autopar.core.graph import OpGraph
from autopar.core.plan import CollectivePlan
from autopar.core.spec import Spec, normalize, num_shards
from autopar.cost.hlo import KINDS as COLLECTIVE_KINDS
from autopar.cost.hlo import Collective
from autopar.frontend.interpret import RESULT
from autopar.intra_op.memory import moved_operands, moves
from autopar.intra_op.solve import ShardingAssignment

COMBINED_KINDS = ("all-reduce", "all-gather")   # XLA's combiners merge independent ones


@dataclass(frozen=True, slots=True, kw_only=True)
class ReshardStep:
    """One elementary layout change and the collective XLA does for it ("" for a slice)."""
    kind: str                 # "all-gather", "all-to-all", "collective-permute" or "slice"
    src: Spec
    dst: Spec
    axes: tuple[int, ...]     # mesh axes the collective runs over
    nbytes: float             # per device: the result (all-gather), the bytes held (others)

    @property
    def collective(self) -> str:
        return "" if self.kind == "slice" else self.kind


@dataclass(frozen=True, slots=True, kw_only=True)
class Reshard:
    """Tensor `tensor` moves from `src` to `dst` for operand `operand` of node `node`, or, with
    `node == RESULT`, for result position `operand` (its out_sharding)."""
    tensor: int
    node: int
    operand: int
    src: Spec
    dst: Spec


def _prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _dim_shards(spec: Spec, mesh_shape) -> tuple[int, ...]:
    return tuple(math.prod(mesh_shape[a] for a in dim) for dim in spec)


def reshard_path(shape: Sequence[int], itemsize: int, src: Spec, dst: Spec,
                 mesh_shape: Sequence[int]) -> tuple[ReshardStep, ...]:
    """The elementary steps from layout `src` to `dst` (empty if they are one layout).

    Greedy: a relabelling with the same shards per dimension is one collective-permute;
    otherwise, repeatedly, move a minor axis that the target wants at the minor end of another
    dimension (all-to-all), else gather the axes of one dimension past its common prefix with
    the target (all-gather): only those below an axis that can then move, else all of them,
    first in a dimension another axis waits to move into; finally slice (free).

    Example:
        >>> [(s.kind, s.dst) for s in reshard_path((8, 8), 4, ((0,), (1,)), ((1,), ()), (2, 4))]
        [('all-gather', ((), (1,))), ('all-to-all', ((1,), ()))]
    """
    total = float(math.prod(shape)) * itemsize
    cur, want = normalize(src, mesh_shape), normalize(dst, mesh_shape)
    steps: list[ReshardStep] = []

    def add(kind: str, new: Spec, axes, nbytes: float) -> None:
        nonlocal cur
        steps.append(ReshardStep(kind=kind, src=cur, dst=new, axes=tuple(axes), nbytes=nbytes))
        cur = new

    if cur == want:
        return ()
    if _dim_shards(cur, mesh_shape) == _dim_shards(want, mesh_shape):
        moved = sorted({a for d in cur for a in d} | {a for d in want for a in d})
        add("collective-permute", want, moved, total / num_shards(cur, mesh_shape))
        return tuple(steps)
    while True:
        keep = [_prefix(c, w) for c, w in zip(cur, want)]
        excess = [d for d in range(len(cur)) if keep[d] < len(cur[d])]
        if not excess:
            break

        def mover(a: int, d: int) -> int | None:
            """The dimension axis `a` (now in dimension `d`) can move to by an all-to-all
            once it is the minor axis of `d`."""
            for d2, w in enumerate(want):
                if d2 != d and d2 not in excess and len(w) > len(cur[d2]) \
                        and w[len(cur[d2])] == a:
                    return d2
            return None

        d = next((d for d in excess if mover(cur[d][-1], d) is not None), None)
        if d is not None:
            d2, a = mover(cur[d][-1], d), cur[d][-1]
            new = list(cur)
            new[d], new[d2] = cur[d][:-1], cur[d2] + (a,)
            add("all-to-all", tuple(new), [a], total / num_shards(cur, mesh_shape))
            continue
        # Gather: down to an axis that can then move, else a dimension some excess axis
        # waits to move into, else the first one; all the excess of that dimension.
        cut = None
        for d in excess:
            for i in range(len(cur[d]) - 1, keep[d] - 1, -1):
                if mover(cur[d][i], d) is not None:
                    cut = (d, i + 1)
                    break
            if cut:
                break
        if cut is None:
            targets = {d2 for d in excess for a in cur[d][keep[d]:]
                       for d2, w in enumerate(want) if a in w and d2 != d}
            d = next((d for d in excess if d in targets), excess[0])
            cut = (d, keep[d])
        d, i = cut
        new = list(cur)
        new[d] = cur[d][:i]
        new = tuple(new)
        add("all-gather", new, cur[d][i:], total / num_shards(new, mesh_shape))
    if cur != want:
        add("slice", want, [a for w, c in zip(want, cur) for a in w[len(c):]], 0.0)
    if steps and steps[-1].dst != dst:      # same layout, spelled with size-1 axes
        steps[-1] = ReshardStep(kind=steps[-1].kind, src=steps[-1].src, dst=dst,
                                axes=steps[-1].axes, nbytes=steps[-1].nbytes)
    return tuple(steps)


def live_nodes(graph: OpGraph) -> frozenset[int]:
    """Nodes some result depends on; XLA removes the others (dead code a trace keeps, e.g.
    the unused half of a custom derivative), and their collectives with them."""
    needed = set(graph.outputs)
    live = set()
    for node in reversed(graph.nodes):
        if any(o in needed for o in node.outputs):
            live.add(node.id)
            needed.update(node.inputs)
    return frozenset(live)


def implied_reshards(graph: OpGraph, assignment: ShardingAssignment) -> tuple[Reshard, ...]:
    """Every (tensor, consumer) whose wanted spec is another layout than the tensor's, and
    every result whose out_sharding differs from its value's spec. Tensors computed from
    constants alone are left out: the lowering does not constrain them, XLA materializes them
    in whatever layout a consumer wants. So are dead nodes (`live_nodes`)."""
    specs, shape = assignment.tensor_specs, assignment.mesh_shape
    live = live_nodes(graph)
    out = [Reshard(tensor=tid, node=node, operand=pos, src=specs[tid], dst=want)
           for tid, node, pos, want in moved_operands(
               graph, specs, assignment.node_in_specs, shape, assignment.constant_tensors)
           if node in live]
    for pos, tid in enumerate(graph.outputs):
        want = assignment.output_specs[pos]
        if moves(graph, tid, specs[tid], want, shape, assignment.constant_tensors):
            out.append(Reshard(tensor=tid, node=RESULT, operand=pos, src=specs[tid], dst=want))
    return tuple(out)


def _axes_of(label: str, axis_names: Sequence[str]) -> tuple[int, ...]:
    """Mesh axes named in a strategy label, e.g. "all-reduce(data*model) 4 KiB" -> (0, 1)."""
    inside = label[label.find("(") + 1:label.find(")")]
    return tuple(axis_names.index(n) for n in inside.split("*") if n in axis_names)


def _reduced_dims(node, in_specs) -> list[tuple[int, ...]]:
    """The mesh axes of each operand dimension a node sums over (its contracting dimensions,
    a gathered table's rows, a scatter's update rows, a reduction's axes), as the operand
    specs split them. XLA reduces each such dimension's partial sums by an all-reduce of its
    own: a contraction over two dimensions split on two axes makes two all-reduces."""
    p = node.eqn.params
    prim, specs = node.primitive, in_specs

    def axes(operand: int, dim: int) -> tuple[int, ...]:
        spec = specs[operand] if operand < len(specs) else None
        return tuple(spec[dim]) if spec is not None and dim < len(spec) else ()

    if prim == "dot_general":
        dims = [(0, d) for d in p["dimension_numbers"][0][0]]
    elif prim == "conv_general_dilated":
        dims = [(0, p["dimension_numbers"].lhs_spec[1])]
    elif prim == "gather":
        dn = p["dimension_numbers"]
        dims = [(0, d) for d in dn.start_index_map
                if d in dn.collapsed_slice_dims and p["slice_sizes"][d] == 1]
    elif prim == "scatter-add":
        dn = p["dimension_numbers"]
        batching = set(getattr(dn, "scatter_indices_batching_dims", ()))
        rank = len(node.eqn.invars[1].aval.shape)
        scatter_dims = [d for d in range(len(node.eqn.invars[2].aval.shape))
                        if d not in dn.update_window_dims]
        dims = [(2, scatter_dims[j]) for j in range(rank - 1) if j not in batching]
    elif "axes" in p:
        dims = [(0, d) for d in p["axes"]]
    else:
        return []
    return [a for a in (axes(o, d) for o, d in dims) if a]


def strategy_collectives(graph: OpGraph, assignment: ShardingAssignment,
                         ) -> tuple[CollectivePlan, ...]:
    """The collectives each node's chosen strategy implies (`Strategy.comm`), with their bytes
    per device: the partial result (all-reduce) or the unscattered input (reduce-scatter).
    One per reduced operand dimension (`_reduced_dims`); of a reduce-scatter's, the last
    scatters and the others all-reduce. Dead nodes (`live_nodes`) are left out."""
    names, shape = assignment.axis_names, assignment.mesh_shape
    live = live_nodes(graph)
    out = []
    for node in graph.nodes:
        label = assignment.node_comm[node.id]
        if not label or node.id not in live:
            continue
        kind, axes = label.split("(")[0], _axes_of(label, names)
        t = graph.tensors[node.outputs[0]]
        spec = assignment.tensor_specs[t.id]
        if kind == "reduce-scatter":
            spec = tuple(tuple(a for a in dim if a not in axes) for dim in spec)
        in_specs = assignment.node_in_specs[node.id] if assignment.node_in_specs else ()
        real = [g for g in (tuple(a for a in grp if shape[a] > 1)
                            for grp in _reduced_dims(node, in_specs)) if g]
        groups = real if real and sorted(a for g in real for a in g) == sorted(axes) \
            else [axes]
        for i, grp in enumerate(groups):
            last = i == len(groups) - 1
            k = kind if last else "all-reduce"
            out.append(CollectivePlan(
                node=node.id, primitive=node.primitive, kind=k, detail=label,
                name_stack=node.name_stack, source=node.source,
                comm_s=assignment.node_comm_s[node.id] if last else 0.0,
                tensor=t.id, nbytes=t.nbytes / num_shards(spec, shape),
                axes=tuple(names[a] for a in grp), src=spec,
                dst=assignment.tensor_specs[t.id] if last else spec))
    return tuple(out)


def reshard_collectives(graph: OpGraph, assignment: ShardingAssignment, cost=None,
                        ) -> tuple[CollectivePlan, ...]:
    """One entry per collective of every implied resharding's path (`reshard_path`); a step
    shared by several consumers (same tensor, same layouts) counts once, as the lowering
    computes it once. `cost` (a `CostModel`) prices each step."""
    names, shape = assignment.axis_names, assignment.mesh_shape
    seen: set = set()
    out = []
    for r in implied_reshards(graph, assignment):
        t = graph.tensors[r.tensor]
        node = graph.nodes[r.node] if r.node != RESULT else None
        for step in reshard_path(t.shape, t.itemsize, r.src, r.dst, shape):
            key = (r.tensor, step.src, normalize(step.dst, shape))
            if not step.collective or key in seen:
                continue
            seen.add(key)
            axes = tuple(names[a] for a in step.axes)
            where = (f"operand {r.operand} of {node.primitive}" if node is not None
                     else f"result[{r.operand}]")
            out.append(CollectivePlan(
                node=r.node, primitive=node.primitive if node is not None else "result",
                kind=step.kind,
                detail=f"{step.kind}({'*'.join(axes)}) {format_bytes(step.nbytes)} reshard "
                       f"{t.path or 'value'} {tuple(t.shape)} for {where}",
                name_stack=node.name_stack if node is not None else "",
                source=node.source if node is not None else "",
                comm_s=_step_s(cost, step), tensor=r.tensor, operand=r.operand,
                nbytes=step.nbytes, axes=axes, src=step.src, dst=step.dst))
    return tuple(out)


def _step_s(cost, step: ReshardStep) -> float:
    if cost is None:
        return 0.0
    if step.kind == "all-gather":
        return cost.all_gather_s(step.nbytes, step.axes)
    if step.kind == "all-to-all":
        return cost.all_to_all_s(step.nbytes, step.axes)
    return cost.collective_permute_s(step.nbytes, step.axes)


def predict_collectives(graph: OpGraph, assignment: ShardingAssignment, cost=None,
                        ) -> tuple[CollectivePlan, ...]:
    """Every collective the lowered step should compile to: the strategies' and the
    reshardings' (see the module docstring)."""
    return strategy_collectives(graph, assignment) + reshard_collectives(graph, assignment, cost)


# ---------------------------------------------------------------------------- comparison
@dataclass(frozen=True, slots=True, kw_only=True)
class Comparison:
    """Predicted vs compiled collectives per kind.

    The rule (`compare`): for every kind, the compiled collectives counted by *operand* (a
    combined all-reduce of n tensors counts n) equal the predicted count; all-reduces and
    all-gathers may be combined (fewer instructions than predicted), the other kinds may
    not (as many instructions as predicted). With `reduce_scatter_as_all_reduce` (XLA:CPU,
    which never forms a reduce-scatter) a predicted reduce-scatter counts as an all-reduce.
    Bytes are reported, not compared.
    """
    predicted: dict[str, tuple[int, float]]          # kind -> (count, bytes per device)
    compiled: dict[str, tuple[int, int, float]]      # kind -> (instructions, operands, bytes)
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.problems

    def table(self) -> str:
        rows = []
        for kind in COLLECTIVE_KINDS:
            p, c = self.predicted.get(kind), self.compiled.get(kind)
            if p or c:
                pn, pb = p or (0, 0.0)
                cn, co, cb = c or (0, 0, 0.0)
                rows.append(f"{kind}: predicted {pn} ({format_bytes(pb)}), compiled {cn}"
                            + (f" holding {co}" if co != cn else "") + f" ({format_bytes(cb)})")
        return "; ".join(rows) or "no collectives"


def compare(predicted: Sequence[CollectivePlan], compiled: Sequence[Collective], *,
            reduce_scatter_as_all_reduce: bool = False) -> Comparison:
    """Check `predicted` (a plan's collectives) against `compiled` (`hlo.collectives(text)`);
    see `Comparison` for the rule.

    Example:
        >>> c = compare(plan.collectives, hlo.collectives(compiled.as_text()),
        ...             reduce_scatter_as_all_reduce=jax.default_backend() == "cpu")
        >>> assert c.ok, c.problems
    """
    pred: dict[str, tuple[int, float]] = {}
    for c in predicted:
        kind = c.kind
        if kind == "reduce-scatter" and reduce_scatter_as_all_reduce:
            kind = "all-reduce"
        n, b = pred.get(kind, (0, 0.0))
        pred[kind] = (n + 1, b + c.nbytes)
    got: dict[str, tuple[int, int, float]] = {}
    for c in compiled:
        n, k, b = got.get(c.kind, (0, 0, 0.0))
        got[c.kind] = (n + 1, k + c.num_operands, b + c.nbytes)
    problems = []
    for kind in COLLECTIVE_KINDS:
        pn = pred.get(kind, (0, 0.0))[0]
        cn, co, _ = got.get(kind, (0, 0, 0.0))
        if co != pn:
            problems.append(f"{kind}: {pn} predicted, {co} compiled (counted by operand)")
        elif kind not in COMBINED_KINDS and cn != co:
            problems.append(f"{kind}: {cn} compiled instructions hold {co} operands, but XLA "
                            f"does not combine {kind}s")
    return Comparison(predicted=pred, compiled=got, problems=tuple(problems))


__all__ = ["Comparison", "Reshard", "ReshardStep", "RESULT", "compare", "implied_reshards",
           "live_nodes", "normalize", "predict_collectives", "reshard_collectives", "reshard_path",
           "strategy_collectives"]
