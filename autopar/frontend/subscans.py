"""Sub-scans: a `scan` over T iterations re-expressed as consecutive scans over ranges of its
iterations, so that a pipeline can put a scanned layer stack into several stages.

`split_scans(closed, pieces)` is a function that computes the closed jaxpr `closed` with every
scan of T >= 2 iterations (at its top level and inside inlined `jit` calls) run as
min(pieces, T) scans over consecutive ranges: each reads its range of the scanned-over
operands (`x[a:b]`), the carry passes from one to the next (in reverse order for a reverse
scan), and the stacked results are concatenated back. The values are the same, iteration by
iteration; the trace of it has one loop region per range, and layer clustering may cut
between them (`inter_op.pipeline.layer_boundaries`).

Example:
    >>> fn = split_scans(jax.make_jaxpr(model_loss)(params, batch), pieces=4)
    >>> graph = trace(fn, (params, batch))          # 4 scan regions of L / 4 layers each
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend.core import primitives as prims

from autopar.core import _compat


def split_scans(closed, pieces: int) -> Callable[..., list]:
    """`closed` (a ClosedJaxpr) as a function, its scans split into `pieces` ranges."""
    def run(jaxpr, consts: Sequence[Any], *args) -> list:
        env: dict = {}

        def read(atom):
            return atom.val if isinstance(atom, _compat.Literal) else env[atom]
        env.update(zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, args))
        for eqn in jaxpr.eqns:
            ins = [read(a) for a in eqn.invars]
            name = eqn.primitive.name
            with _compat.equation_context(eqn):
                if name == prims.scan_p.name and eqn.params["length"] >= 2 and pieces > 1:
                    outs = _sub_scans(eqn.params, ins, pieces)
                elif name == prims.jit_p.name and has_scan(eqn.params["jaxpr"]):
                    inner = eqn.params["jaxpr"]
                    outs = run(inner.jaxpr, inner.consts, *ins)
                else:
                    outs = eqn.primitive.bind(*ins, **eqn.params)
                    outs = outs if eqn.primitive.multiple_results else [outs]
            for v, value in zip(eqn.outvars, outs):
                if not isinstance(v, _compat.DropVar):
                    env[v] = value
        return [read(v) for v in jaxpr.outvars]

    return lambda *args: run(closed.jaxpr, closed.consts, *args)


def has_scan(closed) -> bool:
    """Whether `closed` runs a scan of two or more iterations at its top level or inside a
    `jit` call (the scans `split_scans` splits)."""
    return any((e.primitive.name == prims.scan_p.name and e.params["length"] >= 2)
               or (e.primitive.name == prims.jit_p.name and has_scan(e.params["jaxpr"]))
               for e in closed.jaxpr.eqns)


def piece_bounds(length: int, pieces: int) -> list[int]:
    """Where the ranges of `length` iterations split into min(pieces, length) near-equal
    parts start, plus the end: `piece_bounds(10, 4) == [0, 2, 5, 7, 10]`."""
    k = max(1, min(pieces, length))
    return [i * length // k for i in range(k + 1)]


def _sub_scans(params: dict, ins: list, pieces: int) -> list:
    n_const, n_carry = _compat.scan_counts(params)
    consts, carry, xs = ins[:n_const], ins[n_const:n_const + n_carry], ins[n_const + n_carry:]
    bounds = piece_bounds(params["length"], pieces)
    ranges = list(zip(bounds, bounds[1:]))
    ys: dict[tuple[int, int], list] = {}
    for a, b in reversed(ranges) if params["reverse"] else ranges:
        part = [jax.lax.slice_in_dim(x, a, b, axis=0) for x in xs]
        outs = prims.scan_p.bind(*consts, *carry, *part, **{**params, "length": b - a})
        carry, ys[(a, b)] = list(outs[:n_carry]), list(outs[n_carry:])
    stacked = [jax.lax.concatenate([ys[r][j] for r in ranges], 0)
               for j in range(len(ys[ranges[0]]))]
    return carry + stacked


__all__ = ["has_scan", "piece_bounds", "split_scans"]
