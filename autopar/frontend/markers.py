"""Stage-boundary markers: an identity primitive that survives `jax.grad`, `jit` and `vmap`.

`mark_stage_boundary(x)` returns `x` unchanged, but leaves a marker equation in the traced
step, in the forward pass and (transposed) in the backward pass. The trace pass removes the
markers from the operator graph and records where they were, for manual layer construction
(`ManualLayerOption`).

Example:
    >>> def block_stack(x):
    ...     x = block_0(x)
    ...     x = autopar.mark_stage_boundary(x)     # layer 0 | layer 1
    ...     return block_1(x)

The values crossing the boundary are passed explicitly, so the marker cannot be removed as
dead code and sits exactly between the computations that produce and use them.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.extend.core as jcore
from jax.interpreters import ad, batching, mlir

from autopar.frontend.checks import check_array_tree

stage_boundary_p = jcore.Primitive("autopar_stage_boundary")
stage_boundary_p.multiple_results = True
STAGE_BOUNDARY = stage_boundary_p.name


def _impl(*xs, name: str):
    return xs


def _abstract_eval(*avals, name: str):
    return avals


def _jvp(primals, tangents, *, name: str):
    tangents = [ad.instantiate_zeros(t) for t in tangents]
    return (stage_boundary_p.bind(*primals, name=name),
            stage_boundary_p.bind(*tangents, name=name))


def _transpose(cts, *args, name: str):
    cts = [ad.instantiate_zeros(c) for c in cts]
    return stage_boundary_p.bind(*cts, name=name)


def _batch(args, dims, *, name: str):
    return stage_boundary_p.bind(*args, name=name), dims


stage_boundary_p.def_impl(_impl)
stage_boundary_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(stage_boundary_p, lambda ctx, *xs, name: list(xs))
ad.primitive_jvps[stage_boundary_p] = _jvp
ad.primitive_transposes[stage_boundary_p] = _transpose
batching.primitive_batchers[stage_boundary_p] = _batch


def mark_stage_boundary(*values: Any, name: str = ""):
    """Mark a pipeline layer boundary on the values that cross it; returns them unchanged
    (one value: that value; several: a tuple). Any pytree of arrays may be passed."""
    leaves, treedef = jax.tree_util.tree_flatten(values)
    check_array_tree(values, "mark_stage_boundary: value", "pass the arrays that flow "
                     "from one layer to the next (e.g. the hidden state `x`).")
    if leaves:
        leaves = stage_boundary_p.bind(*leaves, name=str(name))
    out = jax.tree_util.tree_unflatten(treedef, list(leaves))
    return out[0] if len(values) == 1 else out
