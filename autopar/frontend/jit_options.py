"""`jax.jit`'s argument options on `parallelize`: `static_argnames` / `donate_argnames`
(mapped to positions through the step's signature, as jax.jit maps them) and `in_shardings` /
`out_shardings`, taken as pinned shardings the plan must respect.

`in_shardings` is a pytree prefix of the tuple of non-static positional arguments (or one
leaf for all of them), `out_shardings` a prefix of the step's result; a leaf is a
`PartitionSpec` over the mesh's axis names, a `NamedSharding` on the step's mesh, or None
(autopar chooses). A pinned argument leaf becomes a `sharding_rules` entry matching exactly
its path (the ILP plans around it); a pinned result is planned into that layout, the
resharding priced by the cost model.

Example:
    >>> @autopar.parallelize(mesh=mesh, in_shardings=(None, P("data")),
    ...                      out_shardings=(None, P()), donate_argnames="state")
    ... def train_step(state, batch): ...
"""
from __future__ import annotations

import inspect
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from autopar.core.errors import InvalidArgumentError
from autopar.core.spec import Spec, from_names


def argnums_for_names(fun: Callable, names, option: str) -> tuple[int, ...]:
    """The positions of the parameters `names` (a str or an iterable of str) of `fun`.

    Raises:
      InvalidArgumentError: a name that is not a positional parameter of `fun`.
    """
    names = (names,) if isinstance(names, str) else tuple(names or ())
    try:
        params = list(inspect.signature(fun).parameters.values())
    except (TypeError, ValueError):
        params = []
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY,
                                                         p.POSITIONAL_OR_KEYWORD)]
    out = []
    for n in names:
        if n not in positional:
            raise InvalidArgumentError(
                f"{option}={names!r}: {getattr(fun, '__name__', 'the step')} has no positional "
                f"parameter {n!r} (its positional parameters are {positional}). Fix: name one "
                f"of them, or use the matching *_argnums.")
        out.append(positional.index(n))
    return tuple(out)


def _is_leaf(x) -> bool:
    return x is None or isinstance(x, (PartitionSpec, jax.sharding.Sharding))


def _normalized(tree):
    return tuple(tree) if isinstance(tree, list) else tree


@dataclass(frozen=True, slots=True)
class Pin:
    """A checked pinned leaf: its PartitionSpec entries and its `Spec` over the mesh."""
    entries: tuple
    spec: Spec


def check_pin(value, shape: Sequence[int], mesh: jax.sharding.Mesh, where: str) -> Pin | None:
    """`value` (PartitionSpec / NamedSharding / None) checked against a leaf of `shape`.

    Raises:
      InvalidArgumentError: another kind of sharding, a NamedSharding on another mesh, more
        entries than dimensions, an unknown or repeated axis, a split that does not divide.
    """
    if value is None:
        return None
    names, sizes = tuple(mesh.axis_names), dict(zip(mesh.axis_names, mesh.devices.shape))
    if isinstance(value, NamedSharding):
        if (value.mesh.axis_names != mesh.axis_names
                or value.mesh.devices.shape != mesh.devices.shape
                or [d.id for d in value.mesh.devices.flat] != [d.id for d in mesh.devices.flat]):
            raise InvalidArgumentError(
                f"{where}: NamedSharding on mesh {dict(value.mesh.shape)} (devices "
                f"{[d.id for d in value.mesh.devices.flat]}) is not on the step's mesh "
                f"{dict(zip(names, mesh.devices.shape))} (devices "
                f"{[d.id for d in mesh.devices.flat]}). Fix: use the step's mesh, or give a "
                "PartitionSpec.")
        value = value.spec
    if not isinstance(value, PartitionSpec):
        raise InvalidArgumentError(
            f"{where}: {value!r} is not a PartitionSpec, a NamedSharding or None. Fix: give "
            "jax.sharding.PartitionSpec(...) over the mesh's axis names.")
    entries = tuple(value)
    if len(entries) > len(shape):
        raise InvalidArgumentError(
            f"{where} of shape {tuple(shape)}: {value} has {len(entries)} entries for "
            f"{len(shape)} dimension(s). Fix: at most one entry per dimension.")
    used = []
    for dim, e in enumerate(entries):
        if not (e is None or isinstance(e, (str, tuple))):
            raise InvalidArgumentError(
                f"{where}: {value} has entry {e!r} for dimension {dim}; autopar pins only "
                "None, an axis name or a tuple of axis names (not P.UNCONSTRAINED). Fix: give "
                "those, or None for the whole leaf to let autopar choose.")
        axes = () if e is None else (e,) if isinstance(e, str) else tuple(e)
        for a in axes:
            if a not in names:
                raise InvalidArgumentError(
                    f"{where}: {value} names axis {a!r}; the mesh axes are {names}. Fix: "
                    "name axes of the step's mesh.")
            if a in used:
                raise InvalidArgumentError(
                    f"{where}: {value} uses axis {a!r} twice. Fix: use each mesh axis once.")
            used.append(a)
        n = math.prod(sizes[a] for a in axes)
        if shape[dim] % n:
            raise InvalidArgumentError(
                f"{where} of shape {tuple(shape)}: {value} splits dimension {dim} (size "
                f"{shape[dim]}) over {n} devices {axes}, which does not divide it. Fix: a "
                "spec whose split dimensions divide, or None to let autopar choose.")
    return Pin(entries=entries,
               spec=from_names(entries + (None,) * (len(shape) - len(entries)), names))


def _one_level(x):
    """(child key paths, children, node definition with the children as leaves) of a node."""
    keyed, node = jax.tree_util.tree_flatten_with_path(x, is_leaf=lambda c: c is not x)
    return [k for k, _ in keyed], [c for _, c in keyed], node


def _broadcast(prefix, tree, where: str, label: str) -> list:
    """The prefix's leaf for every leaf of `tree` (whose path starts `label`).

    Raises:
      InvalidArgumentError: the prefix is not a prefix of `tree`, naming the first path where
        they differ.
    """
    out = []

    def walk(p, t, path: str) -> None:
        if _is_leaf(p):
            out.extend([p] * len(jax.tree_util.tree_leaves(t)))
            return
        p_keys, p_children, p_node = _one_level(p)
        t_keys, t_children, t_node = _one_level(t)
        if p_node != t_node:
            def describe(x, keys):
                return (f"{type(x).__name__} with keys "
                        f"{[jax.tree_util.keystr(k) for k in keys]}")
            raise InvalidArgumentError(
                f"{where} is not a pytree prefix of the value: at `{path}` the prefix has a "
                f"{describe(p, p_keys)} but the value a {describe(t, t_keys)}. Fix: give one "
                "leaf (PartitionSpec, NamedSharding or None) per subtree, in the value's "
                "structure, or a single leaf for all of it.")
        for k, pc, tc in zip(t_keys, p_children, t_children):
            walk(pc, tc, path + jax.tree_util.keystr(k))

    walk(prefix, tree, label)
    return out


@dataclass(frozen=True, slots=True)
class PinnedShardings:
    """The `in_shardings` / `out_shardings` of a parallelized step (None: not given)."""
    in_shardings: Any = None
    out_shardings: Any = None

    @classmethod
    def of(cls, in_shardings, out_shardings) -> PinnedShardings:
        return cls(_normalized(in_shardings), _normalized(out_shardings))

    def _per_argument(self, dynamic: Sequence[int]) -> list:
        """One prefix per dynamic argument (checked for count)."""
        if _is_leaf(self.in_shardings):
            return [self.in_shardings] * len(dynamic)
        if not isinstance(self.in_shardings, tuple) or len(self.in_shardings) != len(dynamic):
            raise InvalidArgumentError(
                f"in_shardings={self.in_shardings!r} must be one leaf for all arguments or a "
                f"tuple with one entry per non-static positional argument ({len(dynamic)} "
                f"here: positions {list(dynamic)}), as in jax.jit. Fix: one entry per argument "
                "(None lets autopar choose).")
        return list(self.in_shardings)

    def input_rules(self, args: Sequence[Any], static: Sequence[int], names: Sequence[str],
                    mesh: jax.sharding.Mesh) -> tuple[tuple[str, tuple], ...]:
        """Check `in_shardings` against the call's arguments; one exact-path `sharding_rules`
        entry per pinned leaf (paths as the trace names them: `name` + key path)."""
        if self.in_shardings is None:
            return ()
        dynamic = [i for i in range(len(args)) if i not in static]
        rules = []
        for i, prefix in zip(dynamic, self._per_argument(dynamic)):
            if prefix is None:
                continue
            where = f"in_shardings for argument {i} (`{names[i]}`)"
            leaves = jax.tree_util.tree_flatten_with_path(args[i])[0]
            for (path, leaf), pin in zip(leaves, _broadcast(prefix, args[i], where,
                                                            names[i])):
                leaf_path = names[i] + jax.tree_util.keystr(path)
                pin = check_pin(pin, jax.numpy.shape(leaf), mesh, f"{where}, leaf `{leaf_path}`")
                if pin is not None:
                    rules.append((f"^{re.escape(leaf_path)}$", pin.entries))
        return tuple(rules)

    def output_specs(self, out_tree, out_shapes: Sequence[Sequence[int]], num_states: int,
                     mesh: jax.sharding.Mesh) -> dict[int, Spec]:
        """Result position -> pinned spec, for `out_shardings` over the step's result (the
        traced result minus the `num_states` NNX states that follow it)."""
        if self.out_shardings is None:
            return {}
        shapes = [jax.ShapeDtypeStruct(tuple(s), jax.numpy.float32) for s in out_shapes]
        full = jax.tree_util.tree_unflatten(out_tree, shapes)
        user = full[0] if num_states else full
        where = "out_shardings"
        pins = {}
        flat = jax.tree_util.tree_flatten_with_path(user)[0]
        for pos, ((path, leaf), pin) in enumerate(zip(flat, _broadcast(
                self.out_shardings, user, where, "result"))):
            pin = check_pin(pin, leaf.shape, mesh,
                            f"{where}, result leaf `result{jax.tree_util.keystr(path)}`")
            if pin is not None:
                pins[pos] = pin.spec
        return pins
