"""`autopar.value_and_grad` on pytrees with non-array leaves (an Equinox module: its
activation functions, its integer buffers), as `eqx.filter_value_and_grad` takes them: the
gradient is taken with respect to the floating arrays of the differentiated arguments, every
other leaf is held fixed, and the gradient comes back shaped like the argument with None in
those places (what `eqx.apply_updates` and `optax` on `eqx.filter(model, eqx.is_array)`
expect). The gradient carries autopar's mark, so gradient accumulation and pipelines work on
Equinox steps.

Example:
    >>> def train_step(model, opt_state, x, y):
    ...     loss, grads = autopar.value_and_grad(loss_fn)(model, x, y)   # was eqx.filter_...
    ...     updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    ...     return eqx.apply_updates(model, updates), opt_state, loss
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from autopar.frontend.static_leaves import holds_static, is_array


def has_static_leaves(args: tuple, nums: Sequence[int]) -> bool:
    """Whether a differentiated argument is taken as `eqx.filter_jit` takes it."""
    return any(holds_static(args[i]) for i in nums)


def _differentiated(x) -> bool:
    return is_array(x) and jnp.issubdtype(x.dtype, jnp.inexact)


def value_and_grad_filtered(marked_value_and_grad: Callable, fun: Callable, argnums,
                            nums: Sequence[int], has_aux: bool, args: tuple):
    """`marked_value_and_grad` (autopar's, on pytrees) applied to `fun(*args)` with respect to
    the floating array leaves of arguments `nums` (see the module docstring)."""
    tu = jax.tree_util
    flat = {i: tu.tree_flatten(args[i]) for i in nums}
    masks = {i: [_differentiated(x) for x in leaves] for i, (leaves, _) in flat.items()}
    diff = tuple([x for x, m in zip(flat[i][0], masks[i]) if m] for i in nums)

    def filled(i, values, kept: bool):
        """Argument i with `values` at its differentiated leaves, its other leaves (`kept`)
        or None (a gradient) elsewhere."""
        it = iter(values)
        leaves, treedef = flat[i]
        return tu.tree_unflatten(treedef, [next(it) if m else x if kept else None
                                           for x, m in zip(leaves, masks[i])])

    def pure(diff):
        full = list(args)
        for i, values in zip(nums, diff):
            full[i] = filled(i, values, kept=True)
        return fun(*full)

    value, g = marked_value_and_grad(pure, argnums=0, has_aux=has_aux)(diff)
    grads = [filled(i, values, kept=False) for i, values in zip(nums, g)]
    return value, (grads[0] if isinstance(argnums, int) else tuple(grads))
