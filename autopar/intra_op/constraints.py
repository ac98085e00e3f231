"""Method constraints on the ILP: data parallel and ZeRO are the same ILP with some input
shardings fixed (batch dimension on every device; optimizer state / parameters sharded)."""
from __future__ import annotations

import math
from typing import Callable, Sequence

from ..errors import InvalidArgumentError
from ..graph import InputRole, OpGraph
from ..options import MethodKind, ShardParallel
from ..spec import Spec, enumerate_specs, num_shards, replicated
from .build import default_input_options


def batch_spec(shape: Sequence[int], mesh_shape: Sequence[int], path: str, method: str) -> Spec:
    """Leading (batch) dimension split over every mesh axis of size > 1."""
    axes = tuple(a for a, n in enumerate(mesh_shape) if n > 1)
    if not shape:
        return ()
    n = math.prod(mesh_shape[a] for a in axes)
    if shape[0] % n:
        raise InvalidArgumentError(
            f"{method} splits the batch (leading) dimension over all {n} devices, but batch "
            f"leaf `{path}` has shape {tuple(shape)}: {shape[0]} is not divisible by {n} "
            f"(mesh shape {tuple(mesh_shape)}). Fix: use a batch size that is a multiple of "
            f"{n}, or method=autopar.ShardParallel(), which chooses shardings that divide.")
    return ((axes),) + ((),) * (len(shape) - 1)


def zero_spec(shape: Sequence[int], mesh_shape: Sequence[int]) -> Spec:
    """The spec that cuts a state leaf into the most pieces, preferring a single split dim
    (the largest) so that updates stay local."""
    if len(shape) == 0:
        return ()
    best = None
    for spec in enumerate_specs(shape, mesh_shape):
        split_dims = sum(1 for d in spec if d)
        key = (num_shards(spec, mesh_shape), -split_dims,
               max((shape[i] for i, d in enumerate(spec) if d), default=0))
        if best is None or key > best[0]:
            best = (key, spec)
    return best[1]


def method_input_options(graph: OpGraph, method: ShardParallel,
                         mesh_shape: Sequence[int]) -> Callable[[int], list[Spec]]:
    free = default_input_options(graph, mesh_shape)
    kind = method.kind
    if kind == MethodKind.SHARD:
        return free
    label = type(method).__name__

    def options(tid: int) -> list[Spec]:
        t = graph.tensors[tid]
        if t.role == InputRole.BATCH:
            return [batch_spec(t.shape, mesh_shape, t.path, label)]
        if t.role == InputRole.OPT_STATE and kind in (MethodKind.ZERO2, MethodKind.ZERO3):
            return [zero_spec(t.shape, mesh_shape)]
        if t.role == InputRole.PARAM and kind == MethodKind.ZERO3:
            return [zero_spec(t.shape, mesh_shape)]
        return [replicated(t.rank)]
    return options
