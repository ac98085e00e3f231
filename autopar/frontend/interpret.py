"""The graph interpreter: evaluates an `OpGraph`'s equations in order; under a trace it
re-emits them (each with its scope and source line), with the plan's sharding constraints and
reshardings, loop regions around their bodies and remat regions under `jax.checkpoint`. The
lowering of a plan and the tracing of pipeline stages both run the graph through it."""
from __future__ import annotations

import functools
import itertools
from typing import Any

import jax

from autopar.core import _compat
from autopar.core.errors import AutoparError
from autopar.core.graph import OpGraph
from autopar.frontend.interpret_loops import run_region
from autopar.frontend.loops import PSEUDO_PRIMITIVES, region_at

RESULT = -1                                      # `Reshard.node` of a step's result


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
                       functools.partial(run_nodes, entered=entered | {region.id}), resharded)
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
                        resharded(env, n.inputs[0], reshard.get((n.id, 0))) for n in group))
                    barred.update(zip((n.id for n in group), values))
                outs = (barred.pop(node.id),)
            else:
                args = [resharded(env, t, reshard.get((node.id, i)))
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


class Reemitted:
    """An equation bound through another primitive: a node whose `eqn` is one of these runs
    `primitive.bind(*operands, **eqn.params)` in `run_nodes` (the equation's scope, source
    line and parameters kept)."""

    def __init__(self, eqn, primitive):
        self._eqn, self.primitive = eqn, primitive

    def __getattr__(self, name):
        return getattr(self._eqn, name)


def resharded(env: dict, tid: int, path) -> Any:
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


def interpret(graph: OpGraph, flat_args, constrain: dict[int, Any] | None = None,
              reshard: dict[tuple[int, int], tuple] | None = None) -> list:
    """Evaluate the graph's equations in order (under a trace, this re-emits them)."""
    env: dict[Any, Any] = dict(graph.const_values)
    env.update(zip(graph.inputs, flat_args))
    run_nodes(graph, graph.nodes, env, constrain, reshard)
    reshard = reshard or {}
    return [resharded(env, t, reshard.get((RESULT, pos)))
            for pos, t in enumerate(graph.outputs)]
