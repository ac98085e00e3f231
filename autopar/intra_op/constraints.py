"""Method constraints on the ILP: data parallel and ZeRO are the same ILP with some shardings
fixed. The input leaves are pinned (batch dimension on the data axes; optimizer state /
parameters sharded), and so is the whole batch path: every tensor computed from the batch
keeps its batch dimension split exactly as the batch input's (see `batch_dims`), and under
DataParallel every other tensor (parameters, gradients, the update) is replicated. A
`ShardParallel(batch_axis=...)`, or a `sharding_rules` entry that splits a batch leaf's leading
dimension, pins the batch path the same way and leaves the other axes to the ILP."""
from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence

from autopar.core.errors import InvalidArgumentError
from autopar.core.graph import InputRole, OpGraph, TensorKind, cheap_source_tensors
from autopar.core.options import MethodKind, ShardParallel
from autopar.core.primitives import RANDOM_BITS, REDUCTIONS
from autopar.core.spec import Spec, enumerate_specs, is_valid, num_shards, replicated
from autopar.frontend.loops import stacked_tensors
from autopar.intra_op.batch_dims import batch_dims
from autopar.intra_op.build import default_input_options
from autopar.intra_op.phases import tail_nodes

ZERO = (MethodKind.ZERO2, MethodKind.ZERO3)


def batch_spec(shape: Sequence[int], mesh_shape: Sequence[int], path: str, method: str,
               axes: Sequence[int] | None = None) -> Spec:
    """Leading (batch) dimension split over the mesh `axes` (default: every axis of size > 1)."""
    if axes is None:
        axes = tuple(a for a, n in enumerate(mesh_shape) if n > 1)
    axes = tuple(axes)
    if not shape:
        return ()
    n = math.prod(mesh_shape[a] for a in axes)
    if shape[0] % n:
        raise InvalidArgumentError(
            f"{method} splits the batch (leading) dimension over {n} devices, but batch "
            f"leaf `{path}` has shape {tuple(shape)}: {shape[0]} is not divisible by {n} "
            f"(mesh shape {tuple(mesh_shape)}). Fix: use a batch size that is a multiple of "
            f"{n}, or method=autopar.ShardParallel(), which chooses shardings that divide.")
    return ((axes),) + ((),) * (len(shape) - 1)


def zero_spec(shape: Sequence[int], mesh_shape: Sequence[int], whole: int = 0) -> Spec:
    """The spec that cuts a state leaf into the most pieces, preferring a single split dim
    (the largest) so that updates stay local; its first `whole` dims stay unsplit (a layer
    stack that a loop scans over)."""
    if len(shape) == 0:
        return ()
    best = None
    for spec in enumerate_specs(shape, mesh_shape):
        if any(spec[:whole]):
            continue
        split_dims = sum(1 for d in spec if d)
        key = (num_shards(spec, mesh_shape), -split_dims,
               max((shape[i] for i, d in enumerate(spec) if d), default=0))
        if best is None or key > best[0]:
            best = (key, spec)
    return best[1]


def rule_spec(rules, path: str, shape: Sequence[int], mesh_shape: Sequence[int],
              axis_names: Sequence[str]) -> Spec | None:
    """The spec the first matching `sharding_rules` entry gives the leaf at `path`, or None.

    Raises:
      InvalidArgumentError: the rule names an axis the mesh lacks, uses one twice, has more
        entries than the leaf has dimensions, or splits a dimension that does not divide.
    """
    for i, (pattern, entries) in enumerate(rules):
        if not re.search(pattern, path):
            continue
        where = (f"sharding_rules[{i}] ({pattern!r} -> {entries!r}) matches leaf `{path}` of "
                 f"shape {tuple(shape)}")
        if len(entries) > len(shape):
            raise InvalidArgumentError(
                f"{where}, but the spec has {len(entries)} entries for {len(shape)} "
                f"dimensions. Fix: give at most one entry per dimension, or narrow the regex.")
        spec = []
        for e in tuple(entries) + (None,) * (len(shape) - len(entries)):
            names = () if e is None else (e,) if isinstance(e, str) else tuple(e)
            unknown = [a for a in names if a not in axis_names]
            if unknown:
                raise InvalidArgumentError(
                    f"{where}, but the mesh axes are {tuple(axis_names)}: no axis "
                    f"{unknown[0]!r}. Fix: name mesh axes in the rule.")
            spec.append(tuple(axis_names.index(a) for a in names))
        spec = tuple(spec)
        if not is_valid(spec, shape, mesh_shape):
            raise InvalidArgumentError(
                f"{where}: on mesh {dict(zip(axis_names, mesh_shape))} an axis is used twice "
                f"or a split dimension is not divisible by its axes' size. Fix: choose a spec "
                f"whose split dimensions divide, or narrow the regex.")
        return spec
    return None


def batch_axes(method: ShardParallel, mesh_shape: Sequence[int],
               axis_names: Sequence[str] = ()) -> tuple[int, ...] | None:
    """The mesh axes the batch dimension is pinned to along the whole batch path, or None
    (the ILP chooses): `method.batch_axis`; else every axis of size > 1 for DataParallel and
    ZeRO. (A `sharding_rules` entry for a batch leaf pins that leaf only: a mixture of experts
    moves its tokens' split from the batch to the experts.)

    Raises:
      InvalidArgumentError: `batch_axis` names an axis the mesh lacks.
    """
    if method.batch_axis is not None:
        names = (method.batch_axis,) if isinstance(method.batch_axis, str) \
            else tuple(method.batch_axis)
        unknown = [a for a in names if a not in axis_names]
        if unknown:
            raise InvalidArgumentError(
                f"{type(method).__name__}(batch_axis={method.batch_axis!r}): the mesh axes are "
                f"{tuple(axis_names)}; there is no axis {unknown[0]!r}. Fix: name mesh axes "
                f"(in a pipeline, each stage's axes are ('data', 'model')).")
        return tuple(axis_names.index(a) for a in names)
    if method.kind in (MethodKind.DATA, MethodKind.ZERO2, MethodKind.ZERO3):
        return tuple(a for a, n in enumerate(mesh_shape) if n > 1)
    return None


def method_tensor_rule(graph: OpGraph, method: ShardParallel, mesh_shape: Sequence[int],
                       axis_names: Sequence[str] = (), sources: dict[int, int] | None = None,
                       whole: frozenset[int] = frozenset()) -> Callable[..., bool] | None:
    """`allowed(tid, spec, wanted=False)`: whether tensor `tid` may take sharding `spec` under
    `method`, or with `wanted`, be read in `spec` by an operator (None: every sharding may).

    With batch axes A (see `batch_axes`), a tensor whose batch dimension d (see `batch_dims`;
    `sources` seeds it, default the batch inputs' leading dimensions) divides by A's size
    keeps A on d: exactly A and nothing else under DataParallel and ZeRO, A first under
    ShardParallel (other axes are the ILP's). DataParallel replicates every other tensor;
    `whole`: tensors kept whole where their operator can (ZeRO's statistics of the update,
    `update_statistics`)."""
    axes = batch_axes(method, mesh_shape, axis_names)
    if axes is None:
        return None
    dims = batch_dims(graph, sources)
    n = math.prod(mesh_shape[a] for a in axes)
    exact = method.kind != MethodKind.SHARD
    replicate_rest = method.kind == MethodKind.DATA
    drawn = random_values(graph) if replicate_rest else frozenset()

    def allowed(tid: int, spec: Spec, wanted: bool = False) -> bool:
        d = dims[tid]
        if tid in whole and not wanted and any(spec):
            return False
        if d is None and tid in drawn:    # random bits take any layout: the batch path's
            return True
        if d is None or graph.tensors[tid].shape[d] % n:
            # an operator may take a slice of a replicated value: that moves nothing
            return wanted or not (replicate_rest and any(spec))
        if exact:
            return spec[d] == axes and not any(s for i, s in enumerate(spec) if i != d)
        return spec[d][:len(axes)] == axes
    return allowed


def random_values(graph: OpGraph) -> frozenset[int]:
    """Values made from random bits alone (with scalars and constants): a dropout mask drawn
    from a fixed key has no batch dimension, yet its bits take any layout at no cost
    (`random_bits_rule`), so DataParallel does not hold it replicated: it lies as the batch
    path that reads it, and no activation is gathered to meet it."""
    drawn: set[int] = set()
    fixed = cheap_source_tensors(graph)          # computed from constants alone
    for node in graph.nodes:
        if node.primitive in RANDOM_BITS:
            drawn.update(node.outputs)
        elif any(t in drawn for t in node.inputs) and all(
                t in drawn or fixed[t] or math.prod(graph.tensors[t].shape) == 1
                for t in node.inputs):
            drawn.update(node.outputs)
    return frozenset(drawn)


def _statistic_reductions(graph: OpGraph, tail, dims) -> set[int]:
    """Reductions of the update (the tail) over a value with no batch dimension: a statistic
    of a whole gradient or parameter (Adafactor's factored means, its update clipping, a
    global norm)."""
    return {n.id for n in graph.nodes if n.id in tail and n.primitive in REDUCTIONS
            and n.inputs and dims[n.inputs[0]] is None and graph.tensors[n.inputs[0]].size > 1}


def update_statistics(graph: OpGraph, dims=None) -> tuple[frozenset[int], frozenset[int]]:
    """(whole, unpinned) for the statistics of whole gradients or parameters the update takes
    (`_statistic_reductions`: Adafactor's factored means and update clipping, a global norm).

    `whole`: the values of the update (the tail, `phases.tail_nodes`) connected to such a
    statistic through values without a batch dimension, backward to the summed gradient and
    forward to the new parameters and state; the step's arguments excepted. ZeRO keeps them
    whole on every device: computed from the summed gradient, a statistic needs no
    collective, while on shards each is an all-reduce that waits for the gradient's and that
    XLA:CPU cannot combine with it (an Adafactor MLP: 25 all-reduces, 1 when whole). Only
    where the backend's reduce-scatter is an all-reduce and a slice anyway
    (`LogicalMesh.reduce_scatter_is_all_reduce`): with a real one, the gradient stays split
    and the statistics' independent all-reduces are combined.

    `unpinned`: optimizer-state leaves whose update reaches such a statistic, and what the
    update computes from them: their elementwise update follows the whole gradient, not the
    state's ZeRO shard (`build_ilp(unpinned=...)`)."""
    dims = batch_dims(graph) if dims is None else dims
    tail, consumers = tail_nodes(graph), graph.consumers()
    reductions = _statistic_reductions(graph, tail, dims)
    inputs = set(graph.inputs)
    seen: set[int] = set()
    stack = list(reductions)
    while stack:
        v = stack.pop()
        if v in seen or v not in tail:
            continue
        seen.add(v)
        node = graph.nodes[v]
        stack += [graph.tensors[t].producer for t in node.inputs
                  if graph.tensors[t].producer is not None and dims[t] is None]
        stack += [c for o in node.outputs for c in consumers[o]]
    whole = frozenset(o for v in seen for o in graph.nodes[v].outputs if o not in inputs)
    unpinned: set[int] = set()
    for s in graph.inputs:
        if graph.tensors[s].role != InputRole.OPT_STATE or graph.tensors[s].size <= 1:
            continue
        cone, stack, hit = set(), [s], False
        while stack:
            t = stack.pop()
            if t in cone:
                continue
            cone.add(t)
            for c in consumers[t]:
                if c in tail:
                    hit |= c in reductions
                    stack += graph.nodes[c].outputs
        if hit:
            unpinned |= cone
    return whole, frozenset(unpinned)


def method_input_options(graph: OpGraph, method: ShardParallel, mesh_shape: Sequence[int],
                         axis_names: Sequence[str] = (),
                         paths: Sequence[str] | None = None) -> Callable[[int], list[Spec]]:
    """The shardings each graph input may take under `method`: its `sharding_rules` first
    (by the leaf's path; `paths[i]` overrides the path of `graph.inputs[i]`, for a stage graph
    whose inputs come from a step), then the method's own rules."""
    base = _kind_options(graph, method, mesh_shape, axis_names)
    rules = method.sharding_rules
    if not rules:
        return base
    path_of = {tid: graph.tensors[tid].path for tid in graph.inputs}
    if paths is not None:
        path_of.update(zip(graph.inputs, paths))

    def options(tid: int) -> list[Spec]:
        t = graph.tensors[tid]
        path = path_of.get(tid, "")
        spec = rule_spec(rules, path, t.shape, mesh_shape, axis_names) if path else None
        return [spec] if spec is not None else base(tid)
    return options


def _kind_options(graph: OpGraph, method: ShardParallel, mesh_shape: Sequence[int],
                  axis_names: Sequence[str]) -> Callable[[int], list[Spec]]:
    free = default_input_options(graph, mesh_shape)
    kind = method.kind
    if kind == MethodKind.SHARD:
        return free
    label = type(method).__name__
    axes = batch_axes(method, mesh_shape, axis_names)
    # Layer stacks a loop scans over keep their layer dim whole; so does the state of a
    # parameter of that shape (its moments are updated with it).
    stacks = {graph.tensors[t].shape for t in stacked_tensors(graph)
              if graph.tensors[t].kind == TensorKind.INPUT}
    statistics = _state_statistics(graph)

    def options(tid: int) -> list[Spec]:
        t = graph.tensors[tid]
        whole = int(t.shape in stacks)
        if t.role == InputRole.BATCH:
            return [batch_spec(t.shape, mesh_shape, t.path, label, axes)]
        if t.role == InputRole.OPT_STATE and kind in ZERO and tid not in statistics:
            return [zero_spec(t.shape, mesh_shape, whole)]
        if t.role == InputRole.PARAM and kind == MethodKind.ZERO3:
            return [zero_spec(t.shape, mesh_shape, whole)]
        return [replicated(t.rank)]
    return options


def _state_statistics(graph: OpGraph) -> frozenset[int]:
    """Optimizer-state leaves that are statistics of a parameter rather than copies of its
    shape: the leaf's path ends with a parameter's path (after its argument's name, e.g.
    `['params']['Dense_0']['kernel']`) and its shape differs (Adafactor's factored row and
    column means, (rows,) and (cols,) of a (rows, cols) kernel). ZeRO keeps them whole: they
    hold rows + cols numbers, and split they would be gathered to scale the update."""
    params = []
    for t in graph.inputs:
        p = graph.tensors[t]
        if p.role == InputRole.PARAM and p.path and "[" in p.path:
            params.append((p.path[p.path.index("["):], p.shape))
    out = set()
    for t in graph.inputs:
        s = graph.tensors[t]
        if s.role != InputRole.OPT_STATE or not s.path:
            continue
        match = max(((len(suffix), shape) for suffix, shape in params
                     if s.path.endswith(suffix)), default=None)
        if match is not None and match[1] != s.shape:
            out.add(t)
    return frozenset(out)
