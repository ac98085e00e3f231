"""Lowering of loop regions (`frontend.loops`): a region is re-emitted as `jax.lax.scan`,
`jax.lax.while_loop` or `jax.lax.switch` (same length, direction and unroll) whose body runs
the planned body operators with their sharding constraints. Constraints inside the body are
per-iteration shardings; the carry-out is constrained to the carry-in's sharding, so the
carry keeps one layout across iterations, and each result gets the spec of its exit node.

Example (inside `frontend.interpret.run_nodes`, which calls it when it meets a region's first node):
    >>> run_region(graph, region, env, constrain, reshard, run_nodes, resharded)
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.extend.core as jcore

from autopar.core import _compat
from autopar.core.graph import LoopKind, LoopRegion, OpGraph


def run_region(graph: OpGraph, r: LoopRegion, env: dict, constrain: dict[int, Any],
               reshard: dict, run_nodes: Callable, resharded: Callable) -> None:
    """Emit region `r`, reading its operands from `env` and writing its results there."""

    def pin(tid: int, value):
        sharding = constrain.get(tid)
        for s in sharding if isinstance(sharding, tuple) else (sharding,):
            if s is not None:
                value = jax.lax.with_sharding_constraint(value, s)
        return value

    def entering(k: int, outer: int):
        """Operand `outer` moved as body input k's entry node wants it."""
        return resharded(env, outer, reshard.get((r.entry_nodes[k], 0)))

    def body_run(b: int, bound: dict[int, Any]) -> dict:
        benv = dict(env)                  # outer values are closed over by the body
        benv.update((t, pin(t, v)) for t, v in bound.items())
        first, stop = r.body_nodes[b]
        run_nodes(graph, graph.nodes[first:stop], benv, constrain, reshard)
        return benv

    def leaving(benv: dict, j: int, operand: int = 0):
        """Body result j as its exit node wants it (a carry: in the carry-in's sharding)."""
        return pin(r.outer_outputs[j] if r.kind is LoopKind.COND else _carry_in(graph, r, j),
                   resharded(benv, r.body_outputs[operand][j],
                             reshard.get((r.exit_nodes[j], operand))))

    p = r.eqn.params
    if r.kind is LoopKind.COND:
        ops = [env[t] for t in r.outer_inputs[1:]]

        def branch(b: int):
            def run(*values):
                benv = body_run(b, dict(zip(r.body_inputs[b], values)))
                return [leaving(benv, j, b) for j in range(len(r.outer_outputs))]
            return run
        results = jax.lax.switch(env[r.outer_inputs[0]],
                                 [branch(b) for b in range(len(r.body_inputs))], *ops)
    else:
        body_in = r.body_inputs[0]
        if r.kind is LoopKind.SCAN:
            (n_const, n_carry), outer = _compat.scan_counts(p), r.outer_inputs
        else:
            n_const, outer = p["body_nconsts"], r.outer_inputs[p["cond_nconsts"]:]
            n_carry = len(body_in) - n_const
        carry_ks = range(n_const, n_const + n_carry)
        init = [pin(body_in[k], entering(k, outer[k])) for k in carry_ks]
        xs = [entering(k, outer[k]) for k in range(n_const + n_carry, len(body_in))]

        def step(carry, x=()):
            bound = dict(zip([body_in[k] for k in carry_ks], carry))
            bound.update(zip(body_in[n_const + n_carry:], x))
            benv = body_run(0, bound)
            outs = [leaving(benv, j) for j in range(n_carry)]
            ys = [resharded(benv, t, reshard.get((r.exit_nodes[j], 0)))
                  for j, t in enumerate(r.body_outputs[0]) if j >= n_carry]
            return outs, ys

        if r.kind is LoopKind.SCAN:
            final, ys = jax.lax.scan(step, init, xs, length=p["length"], reverse=p["reverse"],
                                     unroll=p["unroll"])
            results = list(final) + list(ys)
        else:
            cond = jcore.jaxpr_as_fun(p["cond_jaxpr"])
            consts = [env[t] for t in r.outer_inputs[:p["cond_nconsts"]]]
            results = jax.lax.while_loop(lambda c: cond(*consts, *c)[0],
                                         lambda c: step(c)[0], init)
    for tid, value in zip(r.outer_outputs, results):
        env[tid] = pin(tid, value)


def _carry_in(graph: OpGraph, r: LoopRegion, j: int) -> int:
    """Tensor id of carry j's carry-in (its exit node's `carry_in`)."""
    return graph.nodes[r.exit_nodes[j]].eqn.params["carry_in"]


__all__ = ["run_region"]
