"""Creating a train state directly in a step's plan layout: `init_sharded` and `step.init`.

A model too big for one device cannot be created whole and sharded afterwards. Here
`create_state` is first evaluated abstractly (`jax.eval_shape`: shapes and dtypes, nothing
allocated); the step is planned on that abstract state and its other example arguments; then
`create_state` is compiled with the plan's shardings of the state leaves as `out_shardings`, so
every device computes only its own shards (random initializers stay partitioned because
`jax_threefry_partitionable` is on). A pipeline plan puts leaves on several stage submeshes,
and one executable cannot output to several meshes: one executable per submesh creates just
that submesh's leaves (XLA removes the computation of the others).

The abstract state is planned under the same cache entry the created state later hits, so the
first `step(state, batch)` neither re-plans nor moves a byte.

Example:
    >>> step = autopar.parallelize(train_step, mesh=mesh, method=autopar.Zero3Parallel())
    >>> def create_state(key):
    ...     params = model.init(key, jnp.zeros((1, seq_len), jnp.int32))
    ...     return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    >>> state = step.init(create_state, batch, create_args=(jax.random.key(0),))
    >>> state, loss = step(state, batch)         # same plan, nothing moved
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from autopar.core.errors import InvalidArgumentError
from autopar.frontend.checks import arg_names, dtype_name, is_parallelized
from autopar.frontend.static_leaves import combined, is_array, with_static
from autopar.lowering.single_mesh import put

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class InitPart:
    """One init executable: the state leaves that live on one (sub)mesh."""
    mesh: jax.sharding.Mesh
    leaves: tuple[int, ...]                    # flat indices of the state leaves it creates
    arg_shardings: tuple[NamedSharding, ...]   # create_args leaves, replicated on `mesh`
    compiled: Any                              # jax.stages.Compiled

    @property
    def memory_bytes_per_device(self) -> int | None:
        """Arguments + outputs + temporaries per device, from XLA's memory analysis (None
        where the backend gives none)."""
        m = self.compiled.memory_analysis()
        if m is None:
            return None
        return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                   - m.alias_size_in_bytes)


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardedInit:
    """`create_state` compiled to output the state in a step's plan layout (see
    `compile_init`); `run(*create_args)` creates it."""
    state_tree: Any                            # treedef of the state's arrays (`with_static`)
    shardings: Any                             # the plan's sharding of every state leaf
    args_tree: Any                             # treedef of create_args
    parts: tuple[InitPart, ...]

    @property
    def memory_bytes_per_device(self) -> int | None:
        """The most any device needs while the state is created (the largest part's; None
        where the backend reports no memory analysis)."""
        sizes = [p.memory_bytes_per_device for p in self.parts]
        return None if None in sizes else max(sizes, default=0)

    def run(self, *create_args):
        """The state `create_state(*create_args)`, each leaf on its plan sharding."""
        flat, tree = jax.tree_util.tree_flatten(create_args)
        if tree != self.args_tree:
            raise InvalidArgumentError(
                f"ShardedInit.run: create_args have the structure {tree}, but the init was "
                f"compiled for {self.args_tree}. Fix: pass arguments like those given to "
                f"compile_init.")
        flat = _key_data(flat)
        leaves: list = [None] * self.state_tree.num_leaves
        for part in self.parts:
            outs = part.compiled(*(put(x, s) for x, s in zip(flat, part.arg_shardings)))
            for i, x in zip(part.leaves, outs):
                leaves[i] = x
        return combined(jax.tree_util.tree_unflatten(self.state_tree, leaves))


def abstract_state(create_state: Callable, create_args: Sequence = ()) -> Any:
    """`jax.eval_shape(create_state, *create_args)` with strong types, as `init_sharded`
    creates it: a weakly typed leaf (a Python `0` step counter) would come back from the step
    as a strong array and re-plan the second call. Leaves other than arrays (an Equinox
    module's activation function) come back as they are, as `eqx.filter_eval_shape` gives
    them."""
    return jax.tree_util.tree_map(_strong, _eval_shape(create_state, create_args))


def _eval_shape(create_state: Callable, create_args: Sequence) -> Any:
    """`jax.eval_shape` of a function whose result may hold static leaves (`with_static`)."""
    return combined(jax.eval_shape(lambda *a: with_static(create_state(*a)), *create_args))


def _strong(x):
    if isinstance(x, jax.ShapeDtypeStruct) and x.weak_type:
        return jax.ShapeDtypeStruct(x.shape, x.dtype)
    return x


def compile_init(create_state: Callable, step, *example_args, state_argnum: int = 0,
                 create_args: Sequence = ()) -> ShardedInit:
    """Plan `step` for the state `create_state(*create_args)` would return and compile
    `create_state` to output it in the plan's layout, without running it.

    Its `memory_bytes_per_device` says what creating the state needs per device; `run`
    creates it. `init_sharded` is `compile_init(...).run(*create_args)`.

    Example:
        >>> init = autopar.runtime.init.compile_init(create_state, step, batch, create_args=(key,))
        >>> init.memory_bytes_per_device            # well below the state's total bytes
        >>> state = init.run(key)
    """
    if not is_parallelized(step):
        raise InvalidArgumentError(
            f"init_sharded: step={step!r} is not a parallelized step. Fix: pass the function "
            f"`autopar.parallelize` returned.")
    if not callable(create_state):
        raise InvalidArgumentError(
            f"init_sharded: create_state={create_state!r} is not callable. Fix: pass a "
            f"function that returns the state, e.g. `lambda: TrainState.create(...)`.")
    if not isinstance(create_args, (tuple, list)):
        raise InvalidArgumentError(
            f"init_sharded: create_args={create_args!r} must be a tuple of create_state's "
            f"positional arguments, e.g. create_args=(jax.random.key(0),).")
    create_args = tuple(create_args)
    _check_state_argnum(step, state_argnum, len(example_args))
    weak = _eval_shape(create_state, create_args)
    state = jax.tree_util.tree_map(_strong, weak)
    args = (*example_args[:state_argnum], state, *example_args[state_argnum:])
    _check_matches(step, args, state_argnum)
    shardings = step.input_shardings(*args)[state_argnum]
    abstract, state_tree = jax.tree_util.tree_flatten(with_static(state))
    weak_flat = [x.weak_type for x in jax.tree_util.tree_leaves(with_static(weak))]
    flat_sh = _array_leaves(state, shardings)
    flat_args, args_tree = jax.tree_util.tree_flatten(create_args)
    impls = tuple(jax.random.key_impl(x) if _is_key(x) else None for x in flat_args)
    flat_args = _key_data(flat_args)

    groups: dict[Any, list[int]] = {}          # mesh -> the state leaves it holds
    for i, s in enumerate(flat_sh):
        groups.setdefault(s.mesh, []).append(i)
    parts = []
    for mesh, idx in groups.items():
        replicated = tuple(NamedSharding(mesh, PartitionSpec()) for _ in flat_args)
        fn = _part_fn(create_state, args_tree, impls, idx, [weak_flat[i] for i in idx])
        jitted = jax.jit(fn, in_shardings=replicated,
                         out_shardings=tuple(flat_sh[i] for i in idx))
        placed = [put(x, s) for x, s in zip(flat_args, replicated)]
        parts.append(InitPart(mesh=mesh, leaves=tuple(idx), arg_shardings=replicated,
                              compiled=jitted.lower(*placed).compile()))
    init = ShardedInit(state_tree=state_tree, shardings=shardings, args_tree=args_tree,
                       parts=tuple(parts))
    total = sum(x.size * x.dtype.itemsize for x in abstract)
    log.info("autopar: init of a %.1f MiB state in %d executable(s); per device at most %s "
             "bytes", total / 2**20, len(parts), init.memory_bytes_per_device)
    return init


def init_sharded(create_state: Callable, step, *example_args, state_argnum: int = 0,
                 create_args: Sequence = ()) -> Any:
    """Create the state `step` takes as argument `state_argnum` directly in the step's plan
    layout: each device computes only its shards, so the state may be far larger than one
    device's memory.

    Args:
      create_state: `create_state(*create_args) -> state`, e.g. `model.init` plus
        `TrainState.create` (traced once abstractly and compiled, never run whole).
      step: a function returned by `autopar.parallelize`.
      example_args: the step's other positional arguments in order (the state left out),
        concrete or `jax.ShapeDtypeStruct`: the step is planned for them.
      state_argnum: the position of the state among the step's arguments.
      create_args: positional arguments of `create_state`, e.g. a PRNG key (passed to
        every device, replicated).

    The created state is laid out exactly as `step.input_shardings(state, *example_args)`
    says, and `step(state, *example_args)` uses the plan made here (no re-planning). If the
    step already has a plan for these other arguments (`parallelize(plan=...)` or an earlier
    call) and `create_state` returns a different tree or leaf shape, an
    `InvalidArgumentError` names the first differing leaf.

    Example:
        >>> step = autopar.parallelize(train_step, mesh=mesh, method=autopar.Zero3Parallel())
        >>> state = autopar.init_sharded(create_state, step, batch,
        ...                              create_args=(jax.random.key(0),))
        >>> state, loss = step(state, batch)
    """
    return compile_init(create_state, step, *example_args, state_argnum=state_argnum,
                        create_args=create_args).run(*create_args)


def _array_leaves(state, tree) -> list:
    """The leaves of `tree` (shaped like `state`) where `state` holds arrays, in order."""
    full, treedef = jax.tree_util.tree_flatten(state)
    return [x for x, s in zip(treedef.flatten_up_to(tree), full) if is_array(s)]


def _is_key(x) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _key_data(flat: list) -> list:
    """Typed PRNG keys as their raw uint32 data: `put` places any array on a mesh (in a
    multi-process job through numpy, which has no key dtype); `_part_fn` wraps them again."""
    return [jax.random.key_data(x) if _is_key(x) else x for x in flat]


def _part_fn(create_state, args_tree, impls, idx, weak) -> Callable:
    """`create_state` keeping the state leaves `idx` (weakly typed ones made strong)."""
    def fn(*flat_args):
        flat_args = [x if impl is None else jax.random.wrap_key_data(x, impl=impl)
                     for x, impl in zip(flat_args, impls)]
        out = jax.tree_util.tree_leaves(with_static(create_state(
            *jax.tree_util.tree_unflatten(args_tree, flat_args))))
        return tuple(jax.lax.convert_element_type(out[i], jax.numpy.result_type(out[i]))
                     if w else out[i] for i, w in zip(idx, weak))
    return fn


def _check_state_argnum(step, state_argnum, num_example_args: int) -> None:
    n = num_example_args + 1
    if isinstance(state_argnum, bool) or not isinstance(state_argnum, int) \
            or not 0 <= state_argnum < n:
        raise InvalidArgumentError(
            f"init_sharded: state_argnum={state_argnum!r} must be an int in [0, {n - 1}] (the "
            f"step takes the state plus {num_example_args} example argument(s)). Fix: pass "
            f"the position of the state among the step's arguments.")
    for name, nums in (("static_argnums", step._static), ("batch_argnums", step._batch)):
        if state_argnum in nums:
            raise InvalidArgumentError(
                f"init_sharded: state_argnum={state_argnum} is listed in the step's {name} "
                f"{nums}; the state is a pytree of arrays the step carries. Fix: pass the "
                f"state's position, or remove it from {name}.")


def _leaf_texts(fun, args, state_argnum) -> list[tuple[str, tuple, str]]:
    name = arg_names(fun, len(args))[state_argnum]
    return [(name + jax.tree_util.keystr(path), tuple(x.shape), dtype_name(x))
            for path, x in jax.tree_util.tree_flatten_with_path(
                with_static(args[state_argnum]))[0]]


def _check_matches(step, args, state_argnum) -> None:
    """The state must be the one the step already expects, if it expects one: the state
    argument of its saved plan, or of the plan it made last for the same other arguments."""
    plan, source = step._saved_plan, "its saved plan (parallelize(plan=...))"
    fix = "re-plan (parallelize without plan=)"
    if plan is None:
        with step._front.bind(args, {}) as call:
            key = step._key(call.args)
        if key in step._cache:
            return
        same = [e for k, e in step._cache.items() if len(k) == len(key) and all(
            k[i] == key[i] for i in range(len(key)) if i != state_argnum)]
        if not same:
            return
        plan, source = same[-1].plan, "the plan it already made for these other arguments"
        fix = "create it with a fresh step for the new model (step.with_mesh(step.mesh))"
    count = lambda i: (0 if i in step._static else
                       len(jax.tree_util.tree_leaves(with_static(args[i]))))
    before = sum(count(i) for i in range(state_argnum))
    after = sum(count(i) for i in range(state_argnum + 1, len(args)))
    want = [(t.path, tuple(t.shape), t.dtype)
            for t in plan.inputs[before:len(plan.inputs) - after]]
    got = _leaf_texts(step._fun, args, state_argnum)
    for i in range(max(len(want), len(got))):
        w = want[i] if i < len(want) else None
        g = got[i] if i < len(got) else None
        if w == g:
            continue
        same = w is not None and g is not None and w[0] == g[0]
        fun = getattr(step._fun, "__name__", "step")
        raise InvalidArgumentError(
            f"init_sharded: create_state returns a state that differs from what `{fun}` "
            f"expects as argument {state_argnum} according to {source}: first differing leaf "
            f"`{(g or w)[0]}` (flat leaf {i}): create_state gives `{_leaf_text(g, not same)}`, "
            f"the step expects `{_leaf_text(w, not same)}`. Fix: make create_state return the "
            f"state the step was planned for, or {fix}.")


def _leaf_text(leaf, with_path: bool) -> str:
    if leaf is None:
        return "no such leaf"
    path, shape, dtype = leaf
    return f"{path + ' ' if with_path else ''}{dtype}{list(shape)}"
