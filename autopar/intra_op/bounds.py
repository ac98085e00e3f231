"""LP lower bounds of an intra-op ILP (`ilp.IlpProblem`): what any plan costs at least, with
or without its memory rows, at a fraction of the MIP's time. The search prices options it has
not solved by them (`solve.latency_bound`).

    >>> lp_bound(problem)                 # every plan's `evaluate` is at least this
    >>> lp_bound(problem, memory=True)    # of the plans that fit its memory budget
"""
from __future__ import annotations

import math

from autopar.intra_op.ilp import IlpProblem, evaluate, lp_rounds, point_rows


def lp_bound(problem: IlpProblem, memory: bool = False) -> float:
    """A lower bound, in seconds, of every plan's `evaluate`: the LP relaxation without memory
    rows (usually tight: often the optimum); `memory=True`: with its memory rows at its budget,
    of the plans that fit it (-inf where no fractional plan fits: then no plan does). The rows
    join as the LP breaks them (`LAZY_BATCH` per round): the LP with every row, where a
    whole-model stage has thousands."""
    rows = point_rows(problem.memory_points) if memory and problem.memory_points else None
    lp, _ = lp_rounds(problem, rows)
    if lp is None:                # no fractional plan fits, or the LP has no optimal value
        return -math.inf
    if lp.mip is None:
        return evaluate(problem, lp.red.choice)
    return float((lp.mip.cost @ lp.x + lp.mip.offset) * lp.mip.scale)


__all__ = ["lp_bound"]
