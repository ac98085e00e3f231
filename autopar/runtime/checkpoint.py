"""Checkpoints of training state on orbax-checkpoint: an atomic, blocking save of a pytree of
(sharded, possibly multi-process global) `jax.Array`s, and a restore onto any layout: another
mesh, a pipeline's stage submeshes, or the shardings a `ParallelPlan` gives its arguments.

Each checkpoint is a numbered directory `path/<step>`. A save writes into
`path/<step>.orbax-checkpoint-tmp` and renames it on commit (on object stores such as `gs://`
orbax writes in place and marks the commit with `commit_success.txt`), so a save cut off
mid-write leaves the earlier checkpoints intact, and `latest_step` and `restore_checkpoint`
never see the unfinished one. With `jax.distributed` initialized, call both functions on every
process with the same arguments and a `path` every process can reach: each process writes and
reads only its own shards.

Example (save under one plan, resume under another on the same or another cluster):
    >>> autopar.save_checkpoint("/ckpt/run1", state, step=1000, keep=3)
    >>> step_fn = autopar.parallelize(train_step, mesh=mesh, method=autopar.PipeshardParallel(...))
    >>> shardings = step_fn.input_shardings(state_template, batch)[0]
    >>> state = autopar.restore_checkpoint("/ckpt/run1", shardings)       # latest step
"""
from __future__ import annotations

import functools
import logging
import numbers
import os
import time
from typing import Any

import jax
import numpy as np
from etils import epath

from autopar.core._format import format_bytes, format_time
from autopar.core.errors import InvalidArgumentError
from autopar.core.plan import ParallelPlan
from autopar.frontend.checks import check_array_tree
from autopar.lowering.single_mesh import plan_input_shardings

log = logging.getLogger(__name__)

def _ocp():
    """`orbax.checkpoint`, imported on first use (importing it is slow, and logs)."""
    import orbax.checkpoint as ocp
    return ocp


def _keeps_root_logging(fn):
    """orbax logs through absl, whose first log call runs `logging.basicConfig()` (a root
    handler with its format) when the root has none: neither `import autopar` nor a
    checkpoint call may leave that behind to reformat the user's logging."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        before = list(logging.root.handlers)
        try:
            return fn(*args, **kwargs)
        finally:
            for h in [h for h in logging.root.handlers if h not in before]:
                logging.root.removeHandler(h)
    return run


_TMP_SUFFIX = ".orbax-checkpoint-tmp"   # orbax's name for a step directory not yet committed


@_keeps_root_logging
def save_checkpoint(path, state, step: int, *, keep: int | None = None) -> str:
    """Save the pytree `state` as checkpoint number `step` under the directory `path`, and
    return the checkpoint's directory (`path/<step>`).

    Blocks until the checkpoint is committed. The commit is atomic: a save interrupted
    mid-write leaves the previous checkpoints restorable and is ignored by `latest_step` and
    `restore_checkpoint` (the next save removes its leftovers). `step` must exceed every step
    already saved under `path`. `keep=N` then deletes all but the newest N checkpoints.
    Leaves may be sharded `jax.Array`s (each process writes its own shards), numpy arrays
    or Python scalars.

    Example:
        >>> autopar.save_checkpoint("/ckpt/run1", state, step=1000, keep=3)
        '/ckpt/run1/1000'
    """
    step = _check_step("save_checkpoint", step)
    check_array_tree(state, "save_checkpoint: state", "save arrays and numbers only; keep "
                     "strings and objects (configs, names) in your own metadata file.")
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, numbers.Integral)
                             or keep < 1):
        raise InvalidArgumentError(
            f"save_checkpoint: keep={keep!r} must be a positive int (how many of the newest "
            "checkpoints to keep) or None to keep all. Fix: pass e.g. keep=3.")
    leaves = jax.tree_util.tree_leaves(state)
    if not leaves:
        raise InvalidArgumentError(
            f"save_checkpoint: state {type(state).__name__} has no array leaves, so there is "
            "nothing to save. Fix: pass the training state pytree (e.g. a TrainState).")
    t0 = time.perf_counter()
    directory = _directory(path)
    ocp = _ocp()
    options = ocp.CheckpointManagerOptions(
        enable_async_checkpointing=False, cleanup_tmp_directories=True,
        preservation_policy=ocp.checkpoint_managers.LatestN(keep) if keep else None)
    with ocp.CheckpointManager(directory, item_handlers=ocp.StandardCheckpointHandler(),
                               options=options) as manager:
        latest = manager.latest_step()
        if latest is not None and step <= latest:
            raise InvalidArgumentError(
                f"save_checkpoint: step={step} is not after the latest checkpoint {latest} "
                f"in {directory} (steps there: {sorted(manager.all_steps())}); orbax only "
                f"adds newer steps. Fix: pass a step greater than {latest}, or first delete "
                f"the checkpoint directories numbered {step} and above.")
        manager.save(step, args=ocp.args.StandardSave(_savable(state)), force=True)
        manager.wait_until_finished()
        kept = list(manager.all_steps())
    nbytes = sum(int(getattr(x, "nbytes", 0)) for x in leaves)
    log.info("autopar: saved checkpoint %d (%d leaves, %s) to %s in %s; steps kept: %s",
             step, len(leaves), format_bytes(nbytes), directory,
             format_time(time.perf_counter() - t0), kept)
    return str(directory / str(step))


def _savable(state):
    """Orbax writes, in a multi-process job, only arrays that span every process (others look
    host-local to it): a leaf a pipeline keeps on one stage's devices is saved as a copy
    replicated on every device."""
    if jax.process_count() == 1:
        return state
    from autopar.runtime.distributed import to_host
    everywhere = _everywhere()

    def leaf(x):
        if not isinstance(x, jax.Array) or _spans_all(x.sharding):
            return x
        value = to_host(x)
        return jax.make_array_from_callback(value.shape, everywhere, lambda idx: value[idx],
                                            dtype=value.dtype)
    return jax.tree_util.tree_map(leaf, state)


def _everywhere():
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    return NamedSharding(Mesh(np.array(jax.devices()), ("all",)), PartitionSpec())


def _spans_all(sharding) -> bool:
    return {d.process_index for d in sharding.device_set} == set(range(jax.process_count()))


def _spanning(abstract):
    """Orbax restores, in a multi-process job, only onto shardings that span every process:
    a leaf bound for one pipeline stage is read replicated on every device first."""
    if jax.process_count() == 1:
        return abstract
    return jax.tree_util.tree_map(
        lambda a: a if _spans_all(a.sharding) else
        jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=_everywhere()), abstract)


def _narrow(x, want):
    """`x` (restored replicated on every device) on `want.sharding`, built from this
    process's replica (a process with no device there contributes nothing)."""
    if x.sharding == want.sharding or jax.process_count() == 1:
        return x
    value = np.asarray(x.addressable_data(0))
    return jax.make_array_from_callback(value.shape, want.sharding, lambda idx: value[idx],
                                        dtype=value.dtype)


@_keeps_root_logging
def restore_checkpoint(path, target, *, step: int | None = None, like: Any = None,
                       argnum: int = 0, devices=None):
    """Restore checkpoint `step` (default: the latest committed one) from `path`, placing
    each array where `target` says, whatever layout it was saved from.

    `target` has the saved state's tree structure; each leaf is one of
      - a `jax.sharding.Sharding`: the array's saved shape and dtype, placed so;
      - a `jax.ShapeDtypeStruct` with `.sharding` set (shape and dtype must equal the saved);
      - a `jax.Array`: its sharding (its shape and dtype must equal the saved).
    Leaves may lie on different meshes (a pipeline's stages hold disjoint submeshes).

    `target` may instead be a `ParallelPlan` with `like=` a pytree of arrays or
    `ShapeDtypeStruct`s with the state's structure and shapes: the state is restored where
    the plan places its first positional argument (`argnum=0`, the only one supported: the
    flat plan does not record where later arguments start), on `devices` (default
    `jax.devices()`).

    Raises `InvalidArgumentError` when `path` holds no checkpoint or not `step`, or when
    `target`'s structure, shapes or dtypes differ from the saved tree's: nothing is padded,
    truncated or cast silently.

    Example (resume under a new plan, e.g. a pipeline on the 8 devices a 2x4 run used):
        >>> step_fn = autopar.parallelize(train_step, mesh=mesh, method=method)
        >>> shardings = step_fn.input_shardings(state_template, batch)[0]
        >>> state = autopar.restore_checkpoint("/ckpt/run1", shardings)
        >>> # or, from a saved plan:
        >>> state = autopar.restore_checkpoint("/ckpt/run1", plan, like=state_template)
    """
    if isinstance(target, ParallelPlan):
        target = _plan_target(target, like, argnum, devices)
    elif like is not None or argnum != 0 or devices is not None:
        raise InvalidArgumentError(
            f"restore_checkpoint: like=, argnum= and devices= apply only when target is a "
            f"ParallelPlan, but target is a {type(target).__name__}. Fix: drop them, or pass "
            "the plan as target.")
    t0 = time.perf_counter()
    directory = _existing_directory(path)
    with _reader(directory) as manager:
        steps = sorted(manager.all_steps())
        if not steps:
            raise InvalidArgumentError(
                f"restore_checkpoint: no committed checkpoint in {directory} (it holds "
                f"{_listing(directory)}). Fix: pass the directory given to save_checkpoint; "
                f"a '<step>{_TMP_SUFFIX}' entry is a save that never finished.")
        if step is None:
            step = steps[-1]
        else:
            step = _check_step("restore_checkpoint", step)
            if step not in steps:
                raise InvalidArgumentError(
                    f"restore_checkpoint: no committed checkpoint {step} in {directory}; "
                    f"available steps: {steps}. Fix: pass one of them, or step=None for the "
                    "latest.")
        abstract = _abstract_target(target, _saved_leaves(manager, directory, step), step)
        wide = _spanning(abstract)
        restored = manager.restore(step, args=_ocp().args.StandardRestore(wide))
        restored = jax.tree_util.tree_map(_narrow, restored, abstract)
    leaves = jax.tree_util.tree_leaves(restored)
    log.info("autopar: restored checkpoint %d (%d leaves, %s) from %s in %s", step,
             len(leaves), format_bytes(sum(int(x.nbytes) for x in leaves)), directory,
             format_time(time.perf_counter() - t0))
    return restored


@_keeps_root_logging
def all_steps(path) -> tuple[int, ...]:
    """The committed checkpoint steps under `path`, oldest first (empty if there are none or
    `path` does not exist); an unfinished save is not listed.

    Example:
        >>> autopar.runtime.checkpoint.all_steps("/ckpt/run1")
        (2000, 3000)
    """
    directory = _directory(path)
    if not directory.exists():
        return ()
    with _reader(directory) as manager:
        return tuple(sorted(manager.all_steps()))


@_keeps_root_logging
def latest_step(path) -> int | None:
    """The newest committed checkpoint step under `path`, or None if there is none.

    Example:
        >>> start = autopar.latest_step("/ckpt/run1")   # None on a fresh run
    """
    steps = all_steps(path)
    return steps[-1] if steps else None


def _check_step(where: str, step) -> int:
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
        raise InvalidArgumentError(
            f"{where}: step={step!r} must be a non-negative int (the checkpoint's number, "
            "usually the training step). Fix: pass e.g. step=1000.")
    return int(step)


def _directory(path) -> epath.Path:
    text = os.fspath(path)
    return epath.Path(text if "://" in text else os.path.abspath(text))


def _existing_directory(path) -> epath.Path:
    directory = _directory(path)
    if not directory.is_dir():
        parent = directory.parent
        around = (f"{parent} holds {_listing(parent)}" if parent.is_dir()
                  else f"{parent} does not exist either")
        raise InvalidArgumentError(
            f"restore_checkpoint: no checkpoint directory {directory} ({around}). Fix: pass "
            "the path given to save_checkpoint.")
    return directory


def _listing(directory: epath.Path, limit: int = 12) -> str:
    names = sorted(p.name for p in directory.iterdir())
    if not names:
        return "nothing"
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _reader(directory: epath.Path):
    """A read-only `orbax.checkpoint.CheckpointManager` of `directory`."""
    ocp = _ocp()
    options = ocp.CheckpointManagerOptions(read_only=True, create=False, save_interval_steps=0)
    return ocp.CheckpointManager(directory, item_handlers=ocp.StandardCheckpointHandler(),
                                 options=options)


def _key(path) -> tuple[str, ...]:
    """A tree path as the names orbax stores it under (a TrainState field and a dict key both
    become a name, a tuple index a number)."""
    names = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                names.append(str(getattr(k, attr)))
                break
        else:
            names.append(str(k))
    return tuple(names)


def _name(key: tuple[str, ...]) -> str:
    return "/".join(key) or "<root>"


def _saved_leaves(manager, directory, step: int) -> dict[tuple[str, ...], Any]:
    """Leaf path -> orbax metadata (with .shape and .dtype) of the saved tree."""
    metadata = manager.item_metadata(step)
    tree = getattr(metadata, "tree", metadata)
    if tree is None:
        raise InvalidArgumentError(
            f"restore_checkpoint: checkpoint {step} in {directory} has no readable tree "
            f"metadata (it holds {_listing(directory / str(step))}). Fix: restore only "
            "checkpoints written by autopar.save_checkpoint (one pytree item).")
    return {_key(p): m for p, m in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _abstract_target(target, saved: dict, step: int):
    """`target` with every leaf turned into a `ShapeDtypeStruct` carrying its sharding, after
    checking the leaves, shapes and dtypes against the saved tree."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(target)
    keys = [_key(p) for p, _ in flat]
    key_set = set(keys)
    missing = [k for k in saved if k not in key_set]
    extra = [k for k in keys if k not in saved]
    if missing or extra:
        show = lambda ks: ", ".join(_name(k) for k in ks[:5]) + (" ..." if len(ks) > 5 else "")
        raise InvalidArgumentError(
            f"restore_checkpoint: target's tree does not match checkpoint {step}'s "
            f"({len(keys)} target leaves, {len(saved)} saved)."
            + (f" Saved but not in target: {show(missing)}." if missing else "")
            + (f" In target but not saved: {show(extra)}." if extra else "")
            + " Fix: build target from the same state structure that was saved (e.g. "
            "step_fn.input_shardings(state, batch)[0] for the same model and optimizer).")
    return jax.tree_util.tree_unflatten(
        treedef, [_abstract_leaf(k, leaf, saved[k]) for k, (_, leaf) in zip(keys, flat)])


def _abstract_leaf(key, leaf, meta) -> jax.ShapeDtypeStruct:
    shape, dtype = tuple(meta.shape), jax.dtypes.canonicalize_dtype(meta.dtype)
    where = f"restore_checkpoint: target leaf {_name(key)}"
    if isinstance(leaf, jax.sharding.Sharding):
        sharding = leaf
    elif isinstance(leaf, (jax.ShapeDtypeStruct, jax.Array)):
        sharding = leaf.sharding
        if sharding is None:
            raise InvalidArgumentError(
                f"{where} is a ShapeDtypeStruct without a sharding, so there is no telling "
                "where to put it. Fix: pass ShapeDtypeStruct(shape, dtype, sharding=...) or "
                "just the Sharding.")
        if tuple(leaf.shape) != shape:
            raise InvalidArgumentError(
                f"{where} has shape {tuple(leaf.shape)} but the saved array has shape {shape}; "
                "orbax would not pad or truncate it. Fix: restore into a state of the saved "
                "shapes (the same model config), or pass the Sharding alone to take the saved "
                "shape.")
        if jax.dtypes.canonicalize_dtype(leaf.dtype) != dtype:
            raise InvalidArgumentError(
                f"{where} has dtype {np.dtype(leaf.dtype).name} but the saved array is "
                f"{dtype.name}; restoring would cast it. Fix: pass the Sharding alone (keeps "
                "the saved dtype) and cast after restoring if that is what you want.")
    else:
        raise InvalidArgumentError(
            f"{where} is a {type(leaf).__name__}; a leaf must be a jax.sharding.Sharding, a "
            "ShapeDtypeStruct with .sharding, or a jax.Array. Fix: e.g. "
            "jax.tree.map(lambda x: x.sharding, placed_state), or "
            "step_fn.input_shardings(state, batch)[0].")
    try:
        sharding.shard_shape(shape)
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    except ValueError as e:
        raise InvalidArgumentError(
            f"{where}: its sharding {sharding} cannot hold the saved shape {shape} ({e}). Fix: "
            "pass a sharding made for an array of that shape.") from None


def _plan_target(plan: ParallelPlan, like, argnum: int, devices):
    """The shardings `plan` gives the leaves of its first positional argument, shaped as
    `like`."""
    if like is None:
        raise InvalidArgumentError(
            "restore_checkpoint: target is a ParallelPlan but like= is missing; the plan lists "
            "flat argument leaves, not the state's tree. Fix: pass like=state_template (the "
            "state's arrays or ShapeDtypeStructs).")
    if argnum != 0:
        raise InvalidArgumentError(
            f"restore_checkpoint: argnum={argnum!r}, but only argnum=0 is supported with a "
            "ParallelPlan (the plan does not record where later arguments' leaves start). Fix: "
            f"use step_fn.input_shardings(*args)[{argnum}] as target.")
    shardings = plan_input_shardings(plan, devices)
    flat, treedef = jax.tree_util.tree_flatten_with_path(like)
    if len(flat) > len(shardings):
        raise InvalidArgumentError(
            f"restore_checkpoint: like= has {len(flat)} leaves but the plan's step takes only "
            f"{len(shardings)} array leaves in all. Fix: pass like= the step's first argument "
            "(the state) as planned.")
    for i, ((p, x), t) in enumerate(zip(flat, plan.inputs)):
        shape = tuple(x.shape) if hasattr(x, "shape") else np.shape(x)
        if tuple(shape) != tuple(t.shape):
            raise InvalidArgumentError(
                f"restore_checkpoint: like= leaf {_name(_key(p))} has shape {tuple(shape)} "
                f"but the plan's argument leaf {i} "
                f"(`{t.path}`) has shape {tuple(t.shape)}. Fix: pass like= the state the plan "
                "was made for (its step's first positional argument).")
    return jax.tree_util.tree_unflatten(treedef, list(shardings[:len(flat)]))
