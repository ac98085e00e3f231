"""Sharding specs on a logical mesh: the small value every pass shares.

A `Spec` gives, for each dimension of a tensor, the tuple of logical-mesh axis indices that
dimension is split over (major to minor). `()` for a dimension means it is not split.
Example: on a (2, 4) mesh, a [B, H] tensor with B over axis 0 and H over axis 1 has spec
``((0,), (1,))``; fully replicated is ``((), ())``; a scalar has spec ``()``.

Pure Python: no JAX import, so solvers and cost models can use it.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

Spec = tuple[tuple[int, ...], ...]


def replicated(rank: int) -> Spec:
    return ((),) * rank


def used_axes(spec: Spec) -> tuple[int, ...]:
    """Mesh axes that split some dimension of the tensor."""
    return tuple(a for dim in spec for a in dim)


def normalize(spec: Spec, mesh_shape: Sequence[int]) -> Spec:
    """`spec` without mesh axes of size 1 (they split nothing)."""
    return tuple(tuple(a for a in dim if mesh_shape[a] > 1) for dim in spec)


def num_shards(spec: Spec, mesh_shape: Sequence[int]) -> int:
    """How many distinct pieces the tensor is cut into."""
    return math.prod(mesh_shape[a] for a in used_axes(spec))


def dim_shards(spec: Spec, dim: int, mesh_shape: Sequence[int]) -> int:
    return math.prod(mesh_shape[a] for a in spec[dim])


def is_valid(spec: Spec, shape: Sequence[int], mesh_shape: Sequence[int]) -> bool:
    """Rank matches, no axis used twice, and every split dimension divides evenly."""
    if len(spec) != len(shape):
        return False
    axes = used_axes(spec)
    if len(set(axes)) != len(axes):
        return False
    return all(shape[d] % dim_shards(spec, d, mesh_shape) == 0 for d in range(len(shape)))


def shard_shape(spec: Spec, shape: Sequence[int], mesh_shape: Sequence[int]) -> tuple[int, ...]:
    return tuple(shape[d] // dim_shards(spec, d, mesh_shape) for d in range(len(shape)))


def bytes_per_device(spec: Spec, nbytes: int, mesh_shape: Sequence[int]) -> float:
    return nbytes / num_shards(spec, mesh_shape)


def enumerate_specs(shape: Sequence[int], mesh_shape: Sequence[int],
                    max_axes_per_dim: int = 2) -> list[Spec]:
    """All valid specs for a tensor: each mesh axis of size > 1 either unused or on one dim.

    Replicated comes first. Axes of size 1 are never used (they split nothing).
    """
    rank = len(shape)
    real_axes = [a for a, n in enumerate(mesh_shape) if n > 1]
    out: list[Spec] = []
    seen: set[Spec] = set()
    for choice in itertools.product(range(-1, rank), repeat=len(real_axes)):
        dims: list[list[int]] = [[] for _ in range(rank)]
        for axis, d in zip(real_axes, choice):
            if d >= 0:
                dims[d].append(axis)
        if any(len(d) > max_axes_per_dim for d in dims):
            continue
        spec = tuple(tuple(d) for d in dims)
        if spec not in seen and is_valid(spec, shape, mesh_shape):
            seen.add(spec)
            out.append(spec)
    out.sort(key=lambda s: (len(used_axes(s)), s))
    return out


def without_axes(spec: Spec, axes: Sequence[int]) -> Spec:
    """The spec with the given mesh axes removed (those dims gathered)."""
    drop = set(axes)
    return tuple(tuple(a for a in dim if a not in drop) for dim in spec)


def to_names(spec: Spec, axis_names: Sequence[str]) -> tuple:
    """Entries for `jax.sharding.PartitionSpec(*entries)`."""
    out = []
    for dim in spec:
        if not dim:
            out.append(None)
        elif len(dim) == 1:
            out.append(axis_names[dim[0]])
        else:
            out.append(tuple(axis_names[a] for a in dim))
    return tuple(out)


def from_names(entries: Sequence, axis_names: Sequence[str]) -> Spec:
    """Inverse of `to_names` (accepts PartitionSpec entries)."""
    index = {n: i for i, n in enumerate(axis_names)}
    out = []
    for e in entries:
        if e is None:
            out.append(())
        elif isinstance(e, str):
            out.append((index[e],))
        else:
            out.append(tuple(index[n] for n in e))
    return tuple(out)


def format_spec(spec: Spec, axis_names: Sequence[str]) -> str:
    """Compact text, e.g. `P(None, 'model')` -> `[-, model]`."""
    parts = []
    for dim in spec:
        parts.append("-" if not dim else "*".join(axis_names[a] for a in dim))
    return "[" + ", ".join(parts) + "]"
