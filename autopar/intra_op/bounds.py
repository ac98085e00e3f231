"""LP lower bounds of an intra-op ILP (`ilp.IlpProblem`): what any plan costs at least, with
or without its memory rows, at a fraction of the MIP's time. The search prices options it has
not solved by them (`solve.latency_bound`).

    >>> lp_bound(problem)                 # every plan's `evaluate` is at least this
    >>> lp_bound(problem, memory=True)    # of the plans that fit its memory budget
"""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from autopar.intra_op.ilp import (
    LAZY_BATCH,
    IlpProblem,
    _presolve,
    _relaxed,
    build_mip,
    evaluate,
    point_rows,
)


def lp_bound(problem: IlpProblem, memory: bool = False) -> float:
    """A lower bound, in seconds, of every plan's `evaluate`: the LP relaxation without memory
    rows (usually tight: often the optimum); `memory=True`: with its memory rows at its budget,
    of the plans that fit it (-inf where no fractional plan fits: then no plan does). The rows
    join as the LP breaks them (`LAZY_BATCH` per round): the LP with every row, where a
    whole-model stage has thousands."""
    active: list[int] = []
    rows = point_rows(problem.memory_points) if memory and problem.memory_points else None
    while True:
        red = _presolve(replace(problem, memory_points=tuple(
            problem.memory_points[i] for i in active)))
        if red.infeasible:          # a relaxation of the whole: no plan fits
            return -math.inf
        mip = build_mip(red) if red.var_groups else None
        if mip is None:
            value = evaluate(problem, red.choice)
        else:
            x = _relaxed(mip, 60.0)
            if x is None:                        # only an optimal LP value bounds
                return -math.inf
            value = float((mip.cost @ x + mip.offset) * mip.scale)
        if rows is None:
            return value
        weights = {g: np.eye(k)[red.choice[g]] if red.choice[g] >= 0 else None
                   for g, k in enumerate(problem.num_strategies)}
        for g, s0, k in (mip.group_cols if mip is not None else ()):
            weights[g] = x[s0:s0 + k]
        usage = rows.mixed_usage(weights)
        usage[active] = -np.inf
        over = np.flatnonzero(usage > problem.memory_budget_bytes * (1 + 1e-9))
        if not over.size:
            return value
        active += [int(i) for i in over[np.argsort(-usage[over])][:LAZY_BATCH]]


__all__ = ["lp_bound"]
