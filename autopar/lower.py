"""Lower pass: OpGraph + ParallelPlan + mesh -> one `jax.jit` with shardings.

The graph's equations are re-emitted in order inside `jax.jit`; every intermediate the plan
constrains gets `jax.lax.with_sharding_constraint`, arguments and results get
`in_shardings` / `out_shardings`. XLA's partitioner then inserts the collectives. An operand
that a node's strategy wants in another layout (`plan.reshards`) is moved there explicitly,
one constraint per step of `intra_op.predict.reshard_path` (one collective each), so XLA never
replicates a tensor to change its layout and compiles the collectives the plan predicts.
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from . import _compat
from .errors import AutoparError, PlanMismatchError
from .frontend.loops import PSEUDO_PRIMITIVES, region_at
from .graph import OpGraph
from .intra_op.predict import RESULT, reshard_path
from .lowering.loops import run_region
from .plan import ParallelPlan
from .spec import Spec, to_names


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
    with no device on this process)."""
    if has_sharding(x, sharding):
        return x
    local = not isinstance(x, jax.Array) or isinstance(x.sharding, SingleDeviceSharding)
    if local and not sharding.is_fully_addressable:
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


def run_nodes(graph: OpGraph, nodes, env: dict, constrain: dict[int, Any] | None = None,
              reshard: dict[tuple[int, int], tuple] | None = None, *,
              entered: frozenset[int] = frozenset()) -> None:
    """Evaluate `nodes` (in order) reading and writing tensor values in `env`; under a trace,
    this re-emits their equations, each with its scope and source line. `reshard` maps
    (node id, operand position) to the layouts that operand passes through on its way to the
    spec the node's strategy wants (`reshard_paths`). `entered`: ids of the loop regions
    whose body this is."""
    constrain, reshard = constrain or {}, reshard or {}
    for _, run in itertools.groupby(nodes, lambda n: n.remat.id if n.remat else None):
        run = list(run)            # nodes of one remat region, or outside any
        if run[0].remat is None:
            _run(graph, run, env, constrain, reshard, entered)
        else:
            _run_remat(graph, run, env, constrain, reshard, entered, run[0].remat)


def _run_remat(graph, nodes, env, constrain, reshard, entered, region) -> None:
    """`nodes` (one `RematRegion`) under `jax.checkpoint` with the user's policy: the gradient
    taken of this trace recomputes them as the user's `jax.checkpoint` did."""
    produced = [t for n in nodes for t in n.outputs]
    inside = set(produced)
    reads = list(dict.fromkeys(t for n in nodes for t in n.inputs if t not in inside))

    made: list[int] = []      # the values the region makes (a loop's body values stay inside)

    def body(*values):
        local = dict(zip(reads, values))
        _run(graph, nodes, local, constrain, reshard, entered)
        made[:] = [t for t in produced if t in local]
        return [local[t] for t in made]

    outs = jax.checkpoint(body, policy=region.policy, prevent_cse=region.prevent_cse)(
        *(env[t] for t in reads))
    env.update(zip(made, outs))


def _run(graph, nodes, env, constrain, reshard, entered) -> None:
    """`run_nodes` outside remat regions: loops re-emitted around their bodies, a remat's
    barrier group as one optimization barrier, annotations as the identity."""
    barriers: dict[int, list] = {}       # a remat's barrier group -> its nodes run here
    for node in nodes:
        if node.barrier is not None:
            barriers.setdefault(node.barrier, []).append(node)
    barred: dict[int, Any] = {}          # node id -> its value behind the group's barrier
    regions, skip_to = region_at(graph), -1
    for node in nodes:
        if node.id < skip_to:         # inside a loop region emitted below
            continue
        region = next((r for r in regions.get(node.id, ()) if r.id not in entered), None)
        if region is not None:        # a scan / while / cond: re-emitted around its body
            run_region(graph, region, env, constrain, reshard,
                       functools.partial(run_nodes, entered=entered | {region.id}), _resharded)
            skip_to = region.stop
            continue
        if node.primitive in PSEUDO_PRIMITIVES:
            raise AutoparError(
                f"node {node.id} '{node.primitive}' belongs to a loop whose first node is not "
                f"evaluated here: a stage or slice of the graph cut through a loop region (an "
                f"internal autopar error; please report it).")
        eqn = node.eqn
        with _compat.equation_context(eqn):   # keeps the op's scope and line in HLO metadata
            if node.barrier is not None:     # one barrier for the group, as jax.checkpoint
                if node.id not in barred:
                    group = barriers[node.barrier]
                    values = jax.lax.optimization_barrier(tuple(
                        _resharded(env, n.inputs[0], reshard.get((n.id, 0))) for n in group))
                    barred.update(zip((n.id for n in group), values))
                outs = (barred.pop(node.id),)
            else:
                args = [_resharded(env, t, reshard.get((node.id, i)))
                        for i, t in enumerate(node.inputs)]
                params = _compat.lowering_params(eqn)
                if params is None:           # an annotation: the plan placed the value
                    outs = args[:len(node.outputs)]
                else:
                    outs = eqn.primitive.bind(*args, **params)
                    if not eqn.primitive.multiple_results:
                        outs = (outs,)
            for tid, val in zip(node.outputs, outs):
                sharding = constrain.get(tid)
                for s in sharding if isinstance(sharding, tuple) else (sharding,):
                    if s is not None:
                        val = jax.lax.with_sharding_constraint(val, s)
                env[tid] = val


def _resharded(env: dict, tid: int, path) -> Any:
    """Tensor `tid` moved through the layouts of `path` ((spec, sharding) pairs), one
    constraint per step; each intermediate is kept (under the key (tid, spec)) so consumers
    wanting the same layout share the collective."""
    value = env[tid]
    for spec, sharding in path or ():
        key = (tid, spec)
        if key not in env:
            env[key] = jax.lax.with_sharding_constraint(value, sharding)
        value = env[key]
    return value


def reshard_paths(graph: OpGraph, plan: ParallelPlan, mesh) -> dict[tuple[int, int], tuple]:
    """(node, operand) -> ((spec, sharding), ...): the layouts each planned resharding
    (`plan.reshards`) passes through, one collective each (`intra_op.predict.reshard_path`);
    node -1 is a result position."""
    src = dict(plan.constraints)
    src.update((t, p.spec) for t, p in zip(graph.inputs, plan.inputs))
    out = {}
    for node, operand, dst in plan.reshards:
        tid = graph.outputs[operand] if node == RESULT else graph.nodes[node].inputs[operand]
        t = graph.tensors[tid]
        if tid in src:
            steps = reshard_path(t.shape, t.itemsize, src[tid], dst, plan.mesh_shape)
            out[(node, operand)] = tuple((s.dst, named(mesh, s.dst)) for s in steps)
    return out


def interpret(graph: OpGraph, flat_args, constrain: dict[int, Any] | None = None,
              reshard: dict[tuple[int, int], tuple] | None = None) -> list:
    """Evaluate the graph's equations in order (under a trace, this re-emits them)."""
    env: dict[Any, Any] = dict(graph.const_values)
    env.update(zip(graph.inputs, flat_args))
    run_nodes(graph, graph.nodes, env, constrain, reshard)
    reshard = reshard or {}
    return [_resharded(env, t, reshard.get((RESULT, pos)))
            for pos, t in enumerate(graph.outputs)]


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
    reshard = reshard_paths(graph, plan, jmesh)

    def run(*flat_args):
        return tuple(interpret(graph, flat_args, constrain, reshard))

    jitted = jax.jit(run, in_shardings=in_sh, out_shardings=out_sh, donate_argnums=donate)
    return Lowered(jitted=jitted, in_shardings=in_sh, out_shardings=out_sh, mesh=jmesh)
