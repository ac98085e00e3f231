"""Flax NNX graph objects (`nnx.Module`, `nnx.Optimizer`, `nnx.Rngs`, `nnx.MultiMetric`,
`nnx.Variable`) as arguments of a parallelized step, taken as `nnx.jit` takes them.

Before tracing, every argument that holds NNX graph nodes is split together with the others
(`nnx.update_context(...).split`, so an object reachable from two arguments is one object,
its state one set of leaves) into a static graph definition and one `NnxState` pytree per
argument. autopar plans and runs the pure step `(states, other args) -> (result, new
states)`; afterwards the new states are merged back into the user's objects in place (the
update context's outer merge, as `nnx.jit` does), so `optimizer.update(model, grads)`,
BatchNorm statistics, RNG counters, metrics and even graph-structure changes (a new
attribute or Variable) reach them. The states are donated: they are replaced in place.

A state leaf is named by its attribute path, e.g. `model.layers[0].linear.kernel` or
`optimizer.opt_state[0].mu.layers[0].kernel`, so the plan dump reads like the model and
optimizer state is recognised by its path.

Example:
    >>> @autopar.parallelize(mesh=mesh, batch_argnums=(3,))   # instead of @nnx.jit
    ... def train_step(model, optimizer, metrics, batch):
    ...     (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, batch)
    ...     optimizer.update(model, grads)
    ...     metrics.update(loss=loss, logits=logits, labels=batch["label"])
    >>> train_step(model, optimizer, metrics, batch)    # updates all three in place
"""
from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax

from autopar.core import _compat
from autopar.core.errors import InvalidArgumentError, UnsupportedError
from autopar.frontend.checks import arg_names, argnums_text
from autopar.frontend.static_leaves import PathKey, combined, with_static

_TAG = "autopar.parallelize"      # the nnx update-context tag of a parallelized call


def _nnx():
    """flax.nnx if the program has imported it (no NNX object can exist otherwise)."""
    return sys.modules.get("flax.nnx")


def holds_graph_nodes(x) -> bool:
    """Whether `x` is an NNX graph node (Module, Optimizer, Rngs, Variable, ...) or a pytree
    holding one other than a Variable. A pytree of Variables (the `nnx.State` of functional
    NNX code, `nnx.split(model, nnx.Param)[1]`) stays a plain pytree, as it always was."""
    nnx = _nnx()
    return nnx is not None and (nnx.graph.is_graph_node(x) or _holds_objects(x))


def _holds_objects(x) -> bool:
    """Whether the pytree `x` holds an NNX graph node other than a Variable."""
    nnx = _nnx()
    is_node = nnx.graph.is_graph_node
    return any(is_node(leaf) and not isinstance(leaf, nnx.Variable)
               for leaf in jax.tree_util.tree_leaves(x, is_leaf=is_node))


def path_text(parts: Sequence[Any]) -> str:
    """An NNX state path as attribute access: ('layers', 0, 'kernel') -> '.layers[0].kernel'."""
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts)


@dataclass(frozen=True, slots=True)
class StateLayout:
    """The static part of one argument's NNX state (part of the plan cache key)."""
    graphdef: Any                    # the joint graph definition of the call's NNX arguments
    part: int                        # this argument's index among them
    paths: tuple[tuple, ...]         # NNX path of each Variable (or array) of the argument
    leaf_defs: tuple                 # the pytree definition of each (Variable type, metadata)
    keys: tuple[PathKey, ...]        # one per leaf, for readable leaf paths


class NnxState:
    """One argument's NNX state as a pytree: its leaves are the Variable values, keyed by
    attribute path; the graph definition and Variable types are static."""
    __slots__ = ("layout", "values")

    def __init__(self, layout: StateLayout, values: Sequence[Any]):
        self.layout = layout
        self.values = tuple(values)

    def __repr__(self) -> str:
        return f"NnxState(part={self.layout.part}, {len(self.values)} leaves)"

    @classmethod
    def of(cls, graphdef, part: int, state) -> NnxState:
        """The pytree of `state` (an `nnx.State`; a Variable for a Variable argument; None
        for an argument with no state of its own)."""
        nnx = _nnx()
        items = (() if state is None else nnx.to_flat_state(state)
                 if isinstance(state, nnx.State) else [((), state)])
        paths, leaf_defs, keys, values = [], [], [], []
        for path, leaf in items:
            flat, leaf_def = jax.tree_util.tree_flatten_with_path(leaf)
            paths.append(tuple(path))
            leaf_defs.append(leaf_def)
            for sub, value in flat:
                sub = sub[1:] if sub and getattr(sub[0], "name", None) == "value" else sub
                keys.append(PathKey(path_text(path) + jax.tree_util.keystr(sub)))
                values.append(value)
        return cls(StateLayout(graphdef=graphdef, part=part, paths=tuple(paths),
                               leaf_defs=tuple(leaf_defs), keys=tuple(keys)), values)

    def state_items(self) -> list[tuple[tuple, Any]]:
        """(path, Variable) pairs rebuilt from the values."""
        it = iter(self.values)
        return [(path, jax.tree_util.tree_unflatten(d, [next(it) for _ in range(d.num_leaves)]))
                for path, d in zip(self.layout.paths, self.layout.leaf_defs)]


jax.tree_util.register_pytree_with_keys(
    NnxState,
    lambda s: (tuple(zip(s.layout.keys, s.values)), s.layout),
    lambda layout, values: NnxState(layout, values),
    flatten_func=lambda s: (s.values, s.layout))


def _joint_state(parts: Sequence[NnxState]):
    """The nnx.State of the tuple of NNX arguments the parts were split from."""
    nnx = _nnx()
    return nnx.from_flat_state([((k, *path), leaf) for k, p in enumerate(parts)
                                for path, leaf in p.state_items()])


def _split_parts(objects: tuple, graphdef=None) -> tuple[Any, list[NnxState]]:
    """Split `objects` in the open update context: (graphdef, one NnxState per object, with
    `graphdef` (default: the one just made) as its static layout's)."""
    with _nnx().split_context(_TAG) as ctx:
        gd, state = ctx.split(objects)
    layout_gd = gd if graphdef is None else graphdef
    return gd, [NnxState.of(layout_gd, k, state[k] if k in state else None)
                for k in range(len(objects))]


class PureStep:
    """`fun` as a pure function of its arguments' NNX states: called with `NnxState`s in
    place of NNX arguments it merges them into objects, runs `fun`, and returns
    `(result, *new states)` (one per NNX argument, in order); without any `NnxState` it is
    `fun`. Traced inside a `BoundCall` (the update context's inner merge and split)."""

    def __init__(self, fun: Callable):
        functools.update_wrapper(self, fun)
        self.fun = fun
        self.out_graphdefs: dict[Any, Any] = {}   # input graphdef -> graphdef of the outputs

    def __call__(self, *args):
        args = tuple(combined(a) for a in args)       # static leaves back in place
        parts = [(i, a) for i, a in enumerate(args) if isinstance(a, NnxState)]
        if not parts:
            return with_static(self.fun(*args))
        nnx = _nnx()
        graphdef = parts[0][1].layout.graphdef
        with nnx.merge_context(_TAG, inner=True) as ctx:
            objects = ctx.merge(graphdef, _joint_state([a for _, a in parts]))
        full = list(args)
        for (i, _), obj in zip(parts, objects):
            full[i] = obj
        out = with_static(self.fun(*full))
        if _holds_objects(out):
            raise UnsupportedError(
                f"autopar.parallelize: {getattr(self.fun, '__name__', 'the step')} returns an "
                "NNX graph object (Module, Variable, Rngs, ...). A parallelized step updates "
                "its NNX arguments in place and returns arrays only (or pytrees of them, such "
                "as `nnx.state(obj)`). Fix: return arrays, e.g. the loss.")
        names = arg_names(self.fun, len(args))
        _check_static_arrays(objects, self.fun, [names[i] for i, _ in parts])
        gd_out, states = _split_parts(tuple(objects), graphdef)
        self.out_graphdefs[graphdef] = gd_out
        return (out, *states)


def _check_static_arrays(objects, fun, names: Sequence[str]) -> None:
    """A traced array kept outside an `nnx.Variable` (a plain attribute, a list element) is
    static to NNX: it cannot be written back (nnx.jit leaks the tracer into the object)."""
    for path, value in _nnx().graph.iter_graph(objects):
        if isinstance(value, _compat.Tracer):
            raise UnsupportedError(
                f"autopar.parallelize: {getattr(fun, '__name__', 'the step')} stores a computed "
                f"array ({value.aval.str_short()}) at `{names[path[0]]}{path_text(path[1:])}`, "
                "outside any nnx.Variable; NNX treats such attributes as static structure, so "
                "the new value cannot be written back after the call. Fix: keep arrays in "
                "Variables, e.g. `self.foo = nnx.Variable(value)` (or nnx.BatchStat / nnx.Param)"
                " and update them with `self.foo[...] = value`.")


def _arg_label(names: Sequence[str], i: int) -> str:
    return f"argument {i} (`{names[i]}`)" if i < len(names) else f"argument {i}"


class BoundCall:
    """One call's arguments with NNX objects replaced by `NnxState`s (`args`); a context
    manager (the NNX update context must stay open while the step is traced and until
    `finish` writes the new state back). Without NNX arguments it changes nothing.

    Example:
        >>> with BoundCall(args, static_argnums=(), batch_argnums=(3,), names=names) as call:
        ...     result = run(call.args)
        ...     out = call.finish(pure_step, result)
    """

    def __init__(self, args: tuple, *, static_argnums: Sequence[int],
                 batch_argnums: Sequence[int], names: Sequence[str]):
        self.args = args
        self.positions: tuple[int, ...] = ()
        self._names, self._static, self._batch = names, set(static_argnums), batch_argnums
        self._manager = self._graphdef = None

    def __enter__(self) -> BoundCall:
        if _nnx() is not None:
            self._split_nnx()
        self.args = tuple(a if i in self._static or isinstance(a, NnxState) else with_static(a)
                          for i, a in enumerate(self.args))
        return self

    def _split_nnx(self) -> None:
        nnx = _nnx()
        self.positions = tuple(i for i, a in enumerate(self.args)
                               if i not in self._static and holds_graph_nodes(a))
        if not self.positions:
            return
        for i in self._batch:
            if isinstance(i, int) and -len(self.args) <= i < len(self.args) \
                    and i % len(self.args) in self.positions:
                self._bad_batch(i % len(self.args))
        self._manager = nnx.update_context(_TAG)
        self._manager.__enter__()
        self._graphdef, parts = _split_parts(tuple(self.args[i] for i in self.positions))
        args = list(self.args)
        for i, part in zip(self.positions, parts):
            args[i] = part
        self.args = tuple(args)

    def __exit__(self, *exc) -> None:
        if self._manager is not None:
            self._manager.__exit__(*exc)
            self._manager = None

    def _bad_batch(self, i: int) -> None:
        arrays = [j for j, a in enumerate(self.args)
                  if j not in self._static and j not in self.positions
                  and jax.tree_util.tree_leaves(a)]
        hint = (f"batch_argnums={tuple(arrays[:1])}" if arrays else
                "batch_argnums listing the argument that holds the batch")
        raise InvalidArgumentError(
            f"{argnums_text('batch_argnums', self._batch)} names {_arg_label(self._names, i)}, "
            f"which holds NNX objects ({type(self.args[i]).__name__}); the batch argument must "
            f"hold arrays whose leading dimension is the batch. Fix: pass {hint} (e.g. "
            f"`train_step(model, optimizer, metrics, batch)` takes batch_argnums=(3,)).")

    def finish(self, pure: PureStep, result) -> Any:
        """Write the new NNX states of `result` back into the user's objects; the step's own
        result."""
        if not self.positions:
            return combined(result)
        out, states = result[0], result[1:]
        with _nnx().merge_context(_TAG, inner=False) as ctx:
            ctx.merge(pure.out_graphdefs[self._graphdef], _joint_state(states))
        return combined(out)


def as_state(tree) -> Any:
    """An `NnxState` (e.g. of NamedShardings) as the `nnx.State` it stands for, shaped like
    `nnx.state(arg)`; a tree with static leaves rebuilt with them; any other tree unchanged."""
    if not isinstance(tree, NnxState):
        return combined(tree)
    items = tree.state_items()
    if [path for path, _ in items] == [()]:         # a Variable argument
        return items[0][1]
    return _nnx().from_flat_state(items)
