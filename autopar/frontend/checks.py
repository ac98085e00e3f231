"""Checks of what a user hands `parallelize` / `autopar.plan`, with messages that teach: the
rule, the offending value, where it came from (argument number and name, leaf path) and the
fix. The common case costs what it did before (a hash, the signatures the plan cache needs
anyway); the leaf-by-leaf diagnosis runs only once something has failed.

Example:
    >>> part = static_part(step, args, 2)       # ("static", value), or a clear error
    >>> sigs = leaf_signatures(step, args, 0, leaves, abstract_signature)
    >>> check_leaves(step, args, static_argnums=(2,))  # autopar.plan: abstract values allowed
"""
from __future__ import annotations

import inspect
import re
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from autopar.core import _compat
from autopar.core._format import short_repr
from autopar.core.errors import InvalidArgumentError, UnsupportedError


class DefaultArgnums(tuple):
    """`batch_argnums` as `parallelize` / `autopar.plan` default it, so that a message about
    it says it was the default (the user never wrote it)."""


DEFAULT_BATCH_ARGNUMS = DefaultArgnums((1,))


def argnums_text(name: str, argnums: Sequence[int]) -> str:
    """`batch_argnums=(1,) (the default)` when the user did not pass it, else
    `batch_argnums=(0, 2)`."""
    text = f"{name}={tuple(argnums)!r}"
    return text + " (the default)" if isinstance(argnums, DefaultArgnums) else text


def arg_label(fun: Callable | None, num_args: int, i: int, path: str = "") -> str:
    """`argument 1 (batch) leaf ['x']`: the parameter name from `fun`'s signature."""
    name = arg_names(fun, num_args)[i] if fun is not None else f"arg{i}"
    return f"argument {i} ({name})" + (f" leaf {path}" if path else "")


def as_argnums(value, name: str, *, none_ok: bool = False) -> tuple[int, ...]:
    """`value` (an int or a sequence of ints: positional argument indices) as a tuple, every
    element checked (`name`: the option, for the message). The default `batch_argnums` is
    kept as `DEFAULT_BATCH_ARGNUMS`, so that messages can say it was the default; with
    `none_ok`, None means none (as `jax.jit` reads `static_argnums=None`).

    Example:
        >>> as_argnums(0, "donate_argnums")
        (0,)
        >>> as_argnums(None, "static_argnums", none_ok=True)
        ()
    """
    if isinstance(value, DefaultArgnums):
        return value
    if value is None and none_ok:
        return ()
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    hint = (f" To name parameters, use {name[:-4]}names={value!r}." if isinstance(value, str)
            and name in ("static_argnums", "donate_argnums") else "")
    try:
        items = () if isinstance(value, (str, bytes)) else tuple(value)
    except TypeError:
        items = None
    bad = [v for v in items or () if isinstance(v, bool) or not isinstance(v, int)]
    if items is None or bad or isinstance(value, (str, bytes)):
        what = f"its element {bad[0]!r} is not an int" if bad else "it is not an int or a " \
            "sequence of ints"
        raise InvalidArgumentError(
            f"{name}={short_repr(value)}: {what}. {name} takes positional argument indices. "
            f"Fix: pass an int or a tuple of ints, e.g. {name}=(1,){' or ()' if none_ok else ''}"
            f".{hint}")
    return items


def method_instance(method):
    """`method` if it is an autopar method (None: the default); the class itself (a missing
    `()`) or anything else is refused with the fix."""
    from autopar.core.options import ShardParallel  # options imports the solver, which imports here
    if method is None or isinstance(method, ShardParallel):
        return method
    if isinstance(method, type) and issubclass(method, ShardParallel):
        raise InvalidArgumentError(
            f"method=autopar.{method.__name__} is the class, not a method. Fix: call it: "
            f"autopar.{method.__name__}() (options go in the call, e.g. "
            f"method=autopar.{method.__name__}(num_microbatches=4)).")
    raise InvalidArgumentError(
        f"method={short_repr(method)} is not an autopar method. Fix: pass "
        f"autopar.ShardParallel(), DataParallel(), Zero2Parallel(), Zero3Parallel() or "
        f"PipeshardParallel().")


def static_part(fun: Callable, args: tuple, i: int) -> tuple:
    """("static", args[i]) for the plan-cache key; an unhashable static argument is refused
    (jax.jit refuses it too: plans are cached per static value)."""
    a = args[i]
    try:
        hash(a)
    except TypeError:
        raise InvalidArgumentError(
            f"static_argnums: {arg_label(fun, len(args), i)} of "
            f"{getattr(fun, '__name__', 'the step')} is static but its value "
            f"{short_repr(a)} (of type {type(a).__name__}) is not hashable; plans are cached "
            f"per static value, as jax.jit caches them. Fix: pass a hashable value (a tuple, "
            f"a frozen dataclass, flax.core.FrozenDict), or drop {i} from static_argnums / "
            f"static_argnames so that its leaves are traced as arrays.") from None
    return ("static", a)


def _leaf_problem(leaf: Any, *, abstract_ok: bool) -> str | None:
    """Why `leaf` cannot be an argument leaf, or None."""
    if isinstance(leaf, jax.Array) or hasattr(leaf, "__jax_array__"):
        return None
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return None if abstract_ok else "abstract"
    if isinstance(leaf, (bool, int, float, complex)):
        return None
    if isinstance(leaf, (np.ndarray, np.generic)):     # strings, bytes, objects: no JAX dtype
        return f"{leaf.dtype.name} dtype" if leaf.dtype.kind in "OSUV" else None
    return "not an array"


def bad_leaf_error(fun: Callable, args: tuple, static_argnums: Sequence[int], *,
                   abstract_ok: bool, only: int | None = None) -> InvalidArgumentError | None:
    """The error for the first argument leaf that is not an array (a string, an object, an
    object array; with `abstract_ok=False` also a `jax.ShapeDtypeStruct`), or None (`only`:
    look at that argument only)."""
    for i, a in enumerate(args):
        if i in static_argnums or only not in (None, i):
            continue
        for path, leaf in jax.tree_util.tree_flatten_with_path(a)[0]:
            problem = _leaf_problem(leaf, abstract_ok=abstract_ok)
            if problem is None:
                continue
            where = arg_label(fun, len(args), i, jax.tree_util.keystr(path))
            if problem == "abstract":
                return InvalidArgumentError(
                    f"{where} is an abstract value {short_repr(leaf)}: a parallelized step "
                    f"runs on concrete arrays. Fix: to plan without data use step.get_plan(...), "
                    f"step.lower(...) or autopar.plan(fun, ..., cluster=...), which accept "
                    f"jax.ShapeDtypeStruct; to run it, pass arrays (e.g. from step.init(...)).")
            return InvalidArgumentError(
                f"{where} is {short_repr(leaf)} (of type {type(leaf).__name__}, {problem}): "
                f"every leaf of a non-static argument must be an array (jax.Array, numpy "
                f"array, Python number); None and empty containers are fine. Fix: keep it "
                f"out of the traced arguments, e.g. as a flax.struct.field("
                f"pytree_node=False), a closure variable, or a static argument "
                f"(static_argnums=({i},), hashable values only).")
    return None


def leaf_signatures(fun: Callable, args: tuple, i: int, leaves: list,
                    signature: Callable) -> tuple:
    """`signature(leaf)` for every leaf of argument `i` (the plan-cache key); a leaf that has
    none (a string, an object) is reported with its argument and path."""
    try:
        return tuple(signature(x) for x in leaves)
    except Exception:
        err = bad_leaf_error(fun, args, (), abstract_ok=True, only=i)
        if err is None:
            raise
        raise err from None


def check_array_tree(tree: Any, what: str, fix: str) -> None:
    """Every leaf of `tree` is an array or a Python number, else an InvalidArgumentError:
    "{what} leaf {path} is ...: {fix}"."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        problem = _leaf_problem(leaf, abstract_ok=False)
        if problem is not None:
            raise InvalidArgumentError(
                f"{what} leaf {jax.tree_util.keystr(path) or '(the value itself)'} is "
                f"{short_repr(leaf)} (of type {type(leaf).__name__}, {problem}); it must be an "
                f"array. Fix: {fix}")


def check_leaves(fun: Callable, args: tuple, static_argnums: Sequence[int], *,
                 abstract_ok: bool = True) -> None:
    """Every non-static argument leaf is an array (or, with `abstract_ok`, an abstract
    value)."""
    err = bad_leaf_error(fun, args, static_argnums, abstract_ok=abstract_ok)
    if err is not None:
        raise err


def check_mesh(mesh, where: str = "mesh"):
    """`mesh` if it is a `jax.sharding.Mesh` (or None: every device)."""
    if mesh is not None and not isinstance(mesh, jax.sharding.Mesh):
        raise InvalidArgumentError(
            f"{where}={short_repr(mesh)} is not a jax.sharding.Mesh. Fix: build one with "
            f"jax.make_mesh((2, 4), ('data', 'model')).")
    return mesh


def check_plan(plan):
    """`parallelize(plan=...)`: a `ParallelPlan` (or None: search)."""
    from autopar.core.plan import ParallelPlan
    if plan is not None and not isinstance(plan, ParallelPlan):
        hint = ("autopar.ParallelPlan.from_json(text)" if isinstance(plan, (str, bytes, dict))
                else "a plan from step.get_plan(...) or autopar.plan(...)")
        raise InvalidArgumentError(
            f"plan={short_repr(plan)} (of type {type(plan).__name__}) is not an "
            f"autopar.ParallelPlan. Fix: pass {hint}, or plan=None to search.")
    return plan


def check_concrete(fun: Callable, args: tuple, leaves: list,
                   static_argnums: Sequence[int]) -> None:
    """A call runs on data: a `jax.ShapeDtypeStruct` leaf is refused with the way to plan
    from abstract values (cheap: one isinstance per leaf)."""
    if any(isinstance(x, jax.ShapeDtypeStruct) for x in leaves):
        check_leaves(fun, args, static_argnums, abstract_ok=False)


# Primitives autopar cannot plan: a message each, with the fix.
_UNSUPPORTED = {
    "shard_map": (
        "jax.shard_map (manual per-device code) inside a parallelized step: autopar chooses "
        "every sharding itself and cannot plan a region whose sharding the code fixes by hand. "
        "Fix: write that part without shard_map (autopar splits it), or run the step with "
        "jax.jit on your mesh instead of autopar.parallelize."),
    "xla_pmap": (
        "jax.pmap inside a parallelized step: autopar maps the step over the mesh itself. "
        "Fix: write the per-example code without pmap (jax.vmap, or plain batched code)."),
}


def check_primitive(name: str, eqn, outer_source: str | None) -> None:
    """An UnsupportedError for a primitive autopar cannot trace through (`shard_map`,
    `pmap`), naming its source line."""
    message = _UNSUPPORTED.get(name)
    if message is not None:
        source = _compat.source_summary(eqn.source_info) or outer_source or "<unknown>"
        raise UnsupportedError(f"{name} at {source}: {message}")


def warn_unmatched_rules(rules: Sequence[tuple[str, tuple]], paths: Sequence[str]) -> None:
    """A UserWarning for each `sharding_rules` regex that matches no input leaf (a typo in a
    path pins nothing, silently)."""
    for i, (pattern, spec) in enumerate(rules):
        if not any(re.search(pattern, p) for p in paths):
            example = ", ".join(f"`{p}`" for p in list(paths)[:3])
            warnings.warn(
                f"sharding_rules[{i}] ({pattern!r} -> {spec!r}) matches no input leaf, so it "
                f"pins nothing. Leaf paths look like {example}{' ...' if len(paths) > 3 else ''}"
                f" (autopar.dump prints them all). Fix: correct the regex (re.search on the "
                f"path), or drop the rule.", UserWarning, stacklevel=3)


def warn_one_microbatch(method) -> None:
    """A UserWarning for `PipeshardParallel` with one microbatch: its stages run one after
    another (no two work at once), so the pipeline only splits memory."""
    if method.num_microbatches == 1:
        warnings.warn(
            "PipeshardParallel(num_microbatches=1): with one microbatch the pipeline stages run "
            "one after another, never at the same time, so there is no pipelining (each stage's "
            "devices idle while the others work). Fix: set num_microbatches to a divisor of the "
            "batch size, e.g. PipeshardParallel(num_microbatches=8), at least the number of "
            "stages; or use ShardParallel() on the whole mesh.", UserWarning, stacklevel=3)


def dtype_name(aval) -> str:
    dtype = getattr(aval, "dtype", None)
    if dtype is None:
        return "token"
    try:
        return np.dtype(dtype).name
    except TypeError:  # extended dtypes such as PRNG keys
        return "key"


def arg_names(fun: Callable, n: int) -> list[str]:
    try:
        params = list(inspect.signature(fun).parameters.values())
    except (TypeError, ValueError):
        params = []
    names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return [names[i] if i < len(names) else f"arg{i}" for i in range(n)]


def is_parallelized(fn) -> bool:
    """Whether `fn` is what `autopar.parallelize` returned (`api.ParallelizedFunction`): the
    tools that take one (sharded init, calibration) check it without importing the driver."""
    return getattr(fn, "_autopar_parallelized", False) is True
