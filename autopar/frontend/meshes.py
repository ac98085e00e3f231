"""The user's mesh, kept: tracing under it, running outside it, results back on it.

`jax.make_mesh` types axes Explicit by default, and code written for it (`out_sharding=`,
`jax.sharding.reshard`) traces only under `jax.set_mesh`. autopar traces the step as the
caller set things up and, where that fails for want of a mesh, under the user's mesh; it
compiles and runs its own executables (Auto axes, possibly on submeshes) with no context
mesh, and hands results back as arrays on the user's mesh with the user's axis types, so
code after the step (evaluation, sampling under `jax.set_mesh`) keeps working.

Example:
    >>> graph = under_mesh_if_needed(mesh, lambda: trace(step, args))
    >>> with no_context_mesh():
    ...     out = executable(*flat)
    >>> out = on_user_mesh(out, mesh)
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

import jax
from jax.sharding import NamedSharding

from autopar.core import _compat
from autopar.core.errors import AutoparError

log = logging.getLogger(__name__)
T = TypeVar("T")


def under_mesh_if_needed(mesh: jax.sharding.Mesh | None, fn: Callable[[], T],
                         needed: list | None = None) -> T:
    """`fn()` (which traces the step) as the caller set things up; if that fails with a JAX
    error while no context mesh is set and `mesh` has an Explicit axis, `fn()` again under
    `jax.set_mesh(mesh)` (and True appended to `needed`): code written for explicit sharding
    (`out_sharding=`, `reshard`) traces only under one. The step is not traced under the mesh
    otherwise, since a context mesh changes the traced program (its types, some operators'
    forms)."""
    if mesh is None or not _compat.is_explicit(mesh) \
            or not jax.sharding.get_abstract_mesh().empty:
        return fn()
    try:
        return fn()
    except AutoparError:
        raise
    except Exception:          # a JAX tracing error: retried under the mesh, raised from there
        log.info("autopar: tracing the step without a context mesh failed; tracing it under "
                 "jax.set_mesh(mesh) (explicit axes)")
    if needed is not None:
        needed.append(True)
    with jax.set_mesh(mesh):
        return fn()


def no_context_mesh():
    """No context mesh while autopar lowers, compiles and runs its executables: they place
    values with their own shardings (Auto axes, stage submeshes), which a context mesh would
    contradict."""
    return jax.set_mesh(None)


def on_user_mesh(values: list, mesh: jax.sharding.Mesh) -> list:
    """`values` with every array that lies on `mesh`'s devices re-labelled as a
    `NamedSharding` on `mesh` itself, with its axis types (no copy). Others (a pipeline
    stage's submesh) are returned as they are."""
    if mesh is None or not _compat.is_explicit(mesh):
        return values
    return [relabel(v, NamedSharding(mesh, v.sharding.spec))
            if isinstance(getattr(v, "sharding", None), NamedSharding) else v for v in values]


def for_caller(values: list, mesh: jax.sharding.Mesh | None, needs_mesh: bool) -> list:
    """A step's results as the caller's code expects them: typed for `mesh` (its Explicit
    axes, `on_user_mesh`) where the caller works under it (under `jax.set_mesh`, or the step
    traces only under its mesh: `needs_mesh`); else as they are, plain arrays with Auto axes,
    which mix with the caller's eager code as `jax.jit`'s results do."""
    if needs_mesh or not jax.sharding.get_abstract_mesh().empty:
        return on_user_mesh(values, mesh)
    return values


def relabel(x, sharding: NamedSharding):
    """`x` as an array with `sharding` when it already lies that way on the same devices but
    under another mesh object (the same devices with other axis types): no copy. Anything
    else is returned as it is (`lowering.single_mesh.put` moves it)."""
    s = getattr(x, "sharding", None)
    if not isinstance(s, NamedSharding) or s.mesh is sharding.mesh or s == sharding:
        return x
    if s.mesh.devices.shape != sharding.mesh.devices.shape \
            or not (s.mesh.devices == sharding.mesh.devices).all() \
            or not s.is_equivalent_to(sharding, x.ndim):
        return x
    return jax.make_array_from_single_device_arrays(
        x.shape, sharding, [sh.data for sh in x.addressable_shards])
