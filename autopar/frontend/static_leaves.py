"""Leaves of a traced argument that are not arrays (an Equinox module's activation function,
its Python floats and bools, a string, a Python object) are static, as `eqx.filter_jit` takes
them.

An argument that holds an Equinox module or a leaf `jax.jit` cannot trace (`holds_static`) is
replaced before tracing by a `WithStatic` pytree: its leaves are the argument's arrays, keyed
by their paths in the argument; its static part (the argument's structure and the other
leaves' values) is pytree metadata, so it is part of the plan and executable cache key. Any
other argument is taken as `jax.jit` takes it (Python numbers traced). A static leaf is
keyed by equality (and type) where it is hashable, else by identity. The step is called with
the argument rebuilt, and a result holding non-array leaves comes back the same way: its
arrays are the step's outputs, its other leaves are the values the trace returned, put back
in place.

Example:
    >>> model = eqx.nn.MLP(16, 4, 64, 2, key=key)     # activation: a function leaf
    >>> part = with_static(model)
    >>> [type(x).__name__ for x in jax.tree_util.tree_leaves(part)][:2]
    ['ArrayImpl', 'ArrayImpl']
    >>> combined(part).activation is model.activation
    True
"""
from __future__ import annotations

import sys
from typing import Any

import jax
import numpy as np


def is_array(x) -> bool:
    """An array leaf: JAX or numpy, abstract or concrete (numpy scalars too)."""
    return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)) \
        or hasattr(x, "__jax_array__")


def _holds_equinox(tree) -> bool:
    eqx = sys.modules.get("equinox")
    if eqx is None:
        return False
    is_module = lambda n: isinstance(n, eqx.Module)
    return any(map(is_module, jax.tree_util.tree_leaves(tree, is_leaf=is_module)))


def holds_static(tree) -> bool:
    """Whether `tree` is taken as `eqx.filter_jit` takes it (only its arrays traced): it holds
    a leaf `jax.jit` could not trace (a function, a string, an object), or an Equinox module.
    Any other tree is taken as `jax.jit` takes it: its Python numbers are traced too."""
    return any(not (is_array(x) or isinstance(x, (bool, int, float, complex)))
               for x in jax.tree_util.tree_leaves(tree)) or _holds_equinox(tree)


class PathKey:
    """A pytree key that prints as a path (`.layers[0].kernel`, `['params']`)."""
    __slots__ = ("text",)

    def __init__(self, text: str):
        self.text = text

    def __str__(self) -> str:
        return self.text

    def __repr__(self) -> str:
        return f"PathKey({self.text!r})"

    def __hash__(self) -> int:
        return hash(self.text)

    def __eq__(self, other) -> bool:
        return isinstance(other, PathKey) and other.text == self.text


class _Static:
    """A static leaf as part of a cache key: equal to another of the same type that compares
    equal, where hashable; else only to itself (its identity)."""
    __slots__ = ("value", "by_identity")

    def __init__(self, value):
        self.value = value
        try:
            hash(value)
            self.by_identity = False
        except TypeError:
            self.by_identity = True

    def __hash__(self) -> int:
        return id(self.value) if self.by_identity else hash((type(self.value), self.value))

    def __eq__(self, other) -> bool:
        if not isinstance(other, _Static) or self.by_identity or other.by_identity:
            return isinstance(other, _Static) and self.value is other.value
        if type(self.value) is not type(other.value):
            return False
        try:
            return bool(self.value == other.value)
        except Exception:       # noqa: BLE001 - an == that is not a truth value: identity
            return self.value is other.value


class _Layout:
    """The static part of a `WithStatic`: the tree's structure, the static leaves by position,
    and a path key per traced leaf."""
    __slots__ = ("treedef", "static", "keys")

    def __init__(self, treedef, static: tuple[tuple[int, _Static], ...],
                 keys: tuple[PathKey, ...]):
        self.treedef, self.static, self.keys = treedef, static, keys

    def _id(self):
        return (self.treedef, self.static)

    def __hash__(self) -> int:
        return hash(self._id())

    def __eq__(self, other) -> bool:
        return isinstance(other, _Layout) and self._id() == other._id()


class WithStatic:
    """A pytree whose non-array leaves are static (see the module docstring)."""
    __slots__ = ("layout", "values")

    def __init__(self, layout: _Layout, values):
        self.layout, self.values = layout, tuple(values)

    def __repr__(self) -> str:
        return (f"WithStatic({len(self.values)} arrays, {len(self.layout.static)} static "
                f"leaves)")

    def combine(self) -> Any:
        """The tree with its static leaves back in place."""
        n = self.layout.treedef.num_leaves
        leaves: list[Any] = [None] * n
        static = dict(self.layout.static)
        it = iter(self.values)
        for k in range(n):
            leaves[k] = static[k].value if k in static else next(it)
        return jax.tree_util.tree_unflatten(self.layout.treedef, leaves)


jax.tree_util.register_pytree_with_keys(
    WithStatic,
    lambda w: (tuple(zip(w.layout.keys, w.values)), w.layout),
    lambda layout, values: WithStatic(layout, values),
    flatten_func=lambda w: (w.values, w.layout))


def with_static(tree) -> Any:
    """`tree` as a `WithStatic` (its leaves other than arrays static) where `holds_static`,
    else `tree` itself (a tree `jax.jit` takes keeps its structure, so its leaf paths and cache
    keys do not change)."""
    if not holds_static(tree):
        return tree
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    static = tuple((k, _Static(x)) for k, (_, x) in enumerate(flat) if not is_array(x))
    marked = {k for k, _ in static}
    keys = tuple(PathKey(jax.tree_util.keystr(path)) for k, (path, _) in enumerate(flat)
                 if k not in marked)
    return WithStatic(_Layout(treedef, static, keys),
                      [x for k, (_, x) in enumerate(flat) if k not in marked])


def combined(tree) -> Any:
    """`tree` with a `WithStatic` rebuilt (`with_static`'s inverse); anything else as is."""
    return tree.combine() if isinstance(tree, WithStatic) else tree
