"""`autopar.value_and_grad` on NNX modules, as `nnx.value_and_grad` takes them: the gradient
is taken with respect to the `nnx.Param`s of the differentiated arguments and comes back as an
`nnx.State`; other state the loss changes (BatchNorm statistics) is written back to the
objects. The gradient carries autopar's mark, so gradient accumulation
(`ShardParallel(num_microbatches=M)`) and `PipeshardParallel` work on NNX steps.

Under microbatching the loss runs once per microbatch: floating state it changes is averaged
over the microbatches (a BatchNorm running mean then moves by the mean of the microbatch
means), and integer state (an `nnx.Rngs` counter advanced by Dropout) cannot be combined, so
changing it inside the loss raises.

Example:
    >>> def train_step(model, optimizer, batch):
    ...     loss, grads = autopar.value_and_grad(loss_fn)(model, batch)   # was nnx's
    ...     optimizer.update(model, grads)
    ...     return loss
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

from autopar.core.errors import UnsupportedError
from autopar.frontend.nnx import _nnx, holds_graph_nodes, path_text


def _values(state) -> dict[tuple, list]:
    """Path -> the leaves of each Variable of `state` (a snapshot: merge shares Variables)."""
    return {tuple(p): jax.tree_util.tree_leaves(v) for p, v in _nnx().to_flat_state(state)}


def _changed(before: dict[tuple, list], after) -> list[tuple[tuple, Any]]:
    """(path, Variable) of `after`'s flat state whose value is not in the snapshot `before`
    (by identity: under a trace an untouched Variable keeps its input tracer)."""
    out = []
    for path, var in _nnx().to_flat_state(after):
        new, prev = jax.tree_util.tree_leaves(var), before.get(tuple(path), [])
        if len(new) != len(prev) or any(a is not b for a, b in zip(new, prev)):
            out.append((tuple(path), var))
    return out


def value_and_grad_nnx(marked_value_and_grad: Callable, fun: Callable, argnums, nums:
                       Sequence[int], has_aux: bool, args: tuple):
    """`marked_value_and_grad` (autopar's, on pytrees) applied to `fun(*args)` whose
    differentiated arguments `nums` hold NNX graph nodes: see the module docstring."""
    nnx = _nnx()
    positions = [i for i, a in enumerate(args) if holds_graph_nodes(a)]
    objects = tuple(args[i] for i in positions)
    diff_parts = {k for k, i in enumerate(positions) if i in nums}

    def is_diff(path, value) -> bool:
        return isinstance(value, nnx.Param) and path[0] in diff_parts

    graphdef, params, rest = nnx.split(objects, is_diff, ...)
    plain = tuple(args[i] for i in nums if i not in positions)   # differentiated pytrees

    def pure(params, plain, rest):
        before = _values(rest)
        inner = nnx.merge(graphdef, params, rest)
        full, it = list(args), iter(plain)
        for i, obj in zip(positions, inner):
            full[i] = obj
        for i in nums:
            if i not in positions:
                full[i] = next(it)
        out = fun(*full)
        loss, aux = out if has_aux else (out, None)
        changed = _changed(before, nnx.state(inner, nnx.Not(is_diff)))
        for path, var in changed:
            if not all(jax.numpy.issubdtype(x.dtype, jax.numpy.floating)
                       for x in jax.tree_util.tree_leaves(var)):
                raise UnsupportedError(
                    f"autopar.value_and_grad: {getattr(fun, '__name__', 'the loss')} changes "
                    f"non-floating NNX state `{path_text(path[1:]).lstrip('.')}` of argument "
                    f"{positions[path[0]]} "
                    f"({type(var).__name__}, e.g. an nnx.Rngs counter advanced by Dropout). "
                    "Under microbatching the loss runs once per microbatch and such state "
                    "cannot be combined. Fix: without microbatches or pipelines take the "
                    "gradient with nnx.value_and_grad; with them, make the loss leave integer "
                    "state alone (e.g. Dropout(deterministic=True) or rngs passed as a key).")
        return loss, (aux, nnx.from_flat_state(changed))

    vg = marked_value_and_grad(pure, argnums=(0, 1), has_aux=True)
    (loss, (aux, changed)), (g_params, g_plain) = vg(params, plain, rest)
    nnx.update(objects, changed)
    grads, it = [], iter(g_plain)
    for i in nums:
        k = positions.index(i) if i in positions else None
        grads.append(next(it) if k is None else g_params[k] if k in g_params else nnx.State({}))
    grads = grads[0] if isinstance(argnums, int) else tuple(grads)
    return ((loss, aux) if has_aux else loss), grads
