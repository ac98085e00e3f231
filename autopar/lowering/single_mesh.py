"""Lower pass: OpGraph + ParallelPlan + mesh -> one `jax.jit` with shardings.

The graph's equations are re-emitted in order inside `jax.jit`; every intermediate the plan
constrains gets `jax.lax.with_sharding_constraint`, arguments and results get
`in_shardings` / `out_shardings`. XLA's partitioner then inserts the collectives. An operand
that a node's strategy wants in another layout (`plan.reshards`) is moved there explicitly,
one constraint per step of `intra_op.predict.reshard_path` (one collective each), so XLA never
replicates a tensor to change its layout and compiles the collectives the plan predicts.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from autopar.core import _compat
from autopar.core.errors import PlanMismatchError
from autopar.core.graph import OpGraph
from autopar.core.plan import ParallelPlan
from autopar.core.spec import Spec, to_names
from autopar.frontend.interpret import RESULT, interpret
from autopar.intra_op.predict import reshard_path


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Lowered:
    jitted: Callable                       # flat args -> flat results
    in_shardings: tuple[NamedSharding, ...]
    out_shardings: tuple[NamedSharding, ...]
    mesh: jax.sharding.Mesh


def named(mesh, spec: Spec) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec(*to_names(spec, mesh.axis_names)))


def has_sharding(x, sharding) -> bool:
    """Whether `x` already lies as `sharding` says; equivalent shardings count (`P()` and
    `P(None, None)` are one layout), so no copy is made for a difference in spelling."""
    current = getattr(x, "sharding", None)
    return current is not None and (current == sharding
                                    or current.is_equivalent_to(sharding, len(np.shape(x))))


def put(x, sharding):
    """`x` on `sharding`: itself if it is already there, else a copy. In a multi-process job a
    host-local value (numpy, or an array on one device) is taken as the same value on every
    process, and each process places its own shards (`jax.device_put` refuses a sharding
    with no device on this process), as a strongly typed array on every process."""
    if has_sharding(x, sharding):
        return x
    local = not isinstance(x, jax.Array) or isinstance(x.sharding, SingleDeviceSharding)
    # Every process of a job places a host-local value the same way, so that the array has
    # one type everywhere: `jax.device_put` keeps a weak type (a Python-int step counter)
    # where the sharding is this process's, the callback does not where it is another's; one
    # process would then see a changed signature at the next call and re-plan alone.
    if local and (not sharding.is_fully_addressable or jax.process_count() > 1):
        value = np.asarray(x)
        value = value.astype(jax.dtypes.canonicalize_dtype(value.dtype), copy=False)
        return jax.make_array_from_callback(value.shape, sharding, lambda idx: value[idx],
                                            dtype=value.dtype)
    if not local and jax.process_count() > 1 and x.sharding.device_set != sharding.device_set \
            and not _same_layout(x.sharding, sharding):
        # Across processes JAX moves an array only between shardings of one layout: go
        # through replicated copies, resharding on each side. Each reshard is a collective:
        # wait on it, so that putting a many-leaf tree never has more in flight than the CPU
        # runtime holds (it hangs past ~32 calls, see JAX_NOTES). The pipeline's own
        # transfers (one layout on both sides) stay asynchronous.
        whole = lambda s: NamedSharding(s.mesh, PartitionSpec())
        x = jax.device_put(jax.device_put(x, whole(x.sharding)).block_until_ready(),
                           whole(sharding)).block_until_ready()
    return jax.device_put(x, sharding)


def _same_layout(a, b) -> bool:
    return (isinstance(a, NamedSharding) and isinstance(b, NamedSharding)
            and a.mesh.devices.shape == b.mesh.devices.shape and a.spec == b.spec)


def reshard_paths(graph: OpGraph, src: dict[int, Spec], reshards, mesh_shape,
                  mesh) -> dict[tuple[int, int], tuple]:
    """(node, operand) -> ((spec, sharding), ...): the layouts each planned resharding
    (node, operand, wanted spec) passes through, one collective each
    (`intra_op.predict.reshard_path`); node -1 is a result position. `src`: the spec of
    every tensor the lowering pins (its inputs and constrained intermediates); an operand
    not pinned is left to XLA."""
    out = {}
    for node, operand, dst in reshards:
        tid = graph.outputs[operand] if node == RESULT else graph.nodes[node].inputs[operand]
        t = graph.tensors[tid]
        if tid in src:
            steps = reshard_path(t.shape, t.itemsize, src[tid], dst, mesh_shape)
            out[(node, operand)] = tuple((s.dst, named(mesh, s.dst)) for s in steps)
    return out


def plan_input_shardings(plan: ParallelPlan, devices=None) -> tuple[NamedSharding, ...]:
    """The sharding of every flat (non-static) argument leaf, as the plan places it: on the
    plan's mesh, or for a pipeline on the submesh of the stage holding the leaf. `devices`
    (default `jax.devices()`) must contain every device id the plan names.

    Example:
        >>> shardings = plan_input_shardings(plan)   # e.g. to restore a checkpoint onto
    """
    by_id = {int(d.id): d for d in (jax.devices() if devices is None else devices)}
    missing = sorted(set(plan.device_ids) - set(by_id))
    if missing:
        raise PlanMismatchError(
            f"the plan names devices {missing[:8]} that are not among this runtime's devices "
            f"{sorted(by_id)[:8]}{'...' if len(by_id) > 8 else ''}. Fix: re-plan for this "
            "mesh (a plan is tied to the devices it was made for).")

    def mesh_of(ids, shape, names):
        devs = np.array([by_id[i] for i in ids], dtype=object).reshape(shape)
        return jax.sharding.Mesh(devs, tuple(names))

    if plan.pipeline:
        meshes = [mesh_of(s.device_ids, s.logical_mesh_shape, s.axis_names) for s in plan.stages]
        return tuple(named(meshes[t.stage], t.spec) for t in plan.inputs)
    mesh = mesh_of(plan.device_ids, plan.mesh_shape, plan.axis_names)
    return tuple(named(mesh, t.spec) for t in plan.inputs)


def lower(graph: OpGraph, plan: ParallelPlan, mesh: jax.sharding.Mesh) -> Lowered:
    if tuple(mesh.devices.shape) != tuple(plan.mesh_shape):
        raise PlanMismatchError(
            f"plan was made for mesh shape {plan.mesh_shape}, but the mesh has shape "
            f"{tuple(mesh.devices.shape)}. Fix: re-plan for this mesh or pass a matching mesh.")
    jmesh = _compat.auto_mesh(mesh)
    in_sh = tuple(named(jmesh, t.spec) for t in plan.inputs)
    out_sh = tuple(named(jmesh, t.spec) for t in plan.outputs)
    constrain = {tid: named(jmesh, spec) for tid, spec in plan.constraints}
    for c in plan.collectives:   # reduced whole first, then sliced (XLA:GPU fuses the two
        if c.kind == "reduce-scatter" and c.tensor in constrain \
                and len(c.src) == graph.tensors[c.tensor].rank:     # into a reduce-scatter)
            constrain[c.tensor] = (named(jmesh, c.src), constrain[c.tensor])
    donate = tuple(sorted(graph.donated_inputs))
    src = dict(plan.constraints)
    src.update((t, p.spec) for t, p in zip(graph.inputs, plan.inputs))
    reshard = reshard_paths(graph, src, plan.reshards, plan.mesh_shape, jmesh)

    def run(*flat_args):
        return tuple(interpret(graph, flat_args, constrain, reshard))

    jitted = jax.jit(run, in_shardings=in_sh, out_shardings=out_sh, donate_argnums=donate)
    return Lowered(jitted=jitted, in_shardings=in_sh, out_shardings=out_sh, mesh=jmesh)
