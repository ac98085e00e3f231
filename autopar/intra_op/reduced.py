"""Presolve (`_presolve`) and the ILP after it (`_Reduced`), which the MIP builder and the
heuristics read. No solver here."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from autopar.intra_op.memory_points import _fold_point

_SEPARABLE_RTOL = 1e-12   # R[i,j] = a[i] + b[j] up to this fraction of max|R| counts as separable


@dataclass(frozen=True, slots=True, kw_only=True)
class _Reduced:
    """The problem after presolve. Groups with `choice[g] >= 0` are fixed; `var_groups` keep
    variables. Memory rows are (terms with bytes shifted to min 0, rhs = budget - constant)."""
    choice: np.ndarray
    var_groups: tuple[int, ...]
    node_costs: tuple[np.ndarray, ...]
    edges: tuple[tuple[int, int, np.ndarray], ...]
    mem_rows: tuple[tuple[tuple[tuple[int, np.ndarray], ...], float], ...]
    infeasible: bool


def _presolve(problem) -> _Reduced:
    """Apply the presolve rules to `problem` (an `ilp.IlpProblem`): fold single-strategy
    groups (1), sum parallel edges (2), fold separable edges (3), drop memory points that
    always fit (5), fix isolated groups (6)."""
    ks = problem.num_strategies
    nc = [np.array(c, float) for c in problem.node_costs]
    merged: dict[tuple[int, int], np.ndarray] = {}
    for e in problem.edges:
        u, v, r = e.u, e.v, np.asarray(e.cost, float)
        if u > v:
            u, v, r = v, u, r.T
        merged[(u, v)] = merged[(u, v)] + r if (u, v) in merged else r.copy()
    edges = []
    for (u, v), r in merged.items():
        if ks[u] == 1:
            nc[v] += r[0, :]
        elif ks[v] == 1:
            nc[u] += r[:, 0]
        elif np.abs(r - r[:, :1] - r[:1, :] + r[0, 0]).max() <= _SEPARABLE_RTOL * np.abs(r).max():
            nc[u] += r[:, 0] - r[0, 0]    # R[i, j] = (R[i, 0] - R[0, 0]) + R[0, j]
            nc[v] += r[0, :]
        else:
            edges.append((u, v, r))
    mem_rows, infeasible = [], False
    budget = problem.memory_budget_bytes
    if budget is not None:
        for p in problem.memory_points:
            if p.folded:      # its constant and most are known
                if p.max_bytes <= budget:
                    continue
                const, terms = p.constant_bytes, p.terms
            else:
                const, merged = _fold_point(p, ks)
                if const + sum(float(b.max()) for b in merged.values()) <= budget:
                    continue
                terms = tuple(merged.items())
            infeasible |= const > budget
            mem_rows.append((terms, budget - const))
    linked = {g for u, v, _ in edges for g in (u, v)}
    linked |= {g for terms, _ in mem_rows for g, _ in terms}
    choice = np.full(len(ks), -1, dtype=np.int64)
    for g, k in enumerate(ks):
        if k == 1 or g not in linked:
            choice[g] = int(np.argmin(nc[g]))
    var_groups = tuple(g for g in range(len(ks)) if choice[g] < 0)
    return _Reduced(choice=choice, var_groups=var_groups, node_costs=tuple(nc), edges=tuple(edges),
                    mem_rows=tuple(mem_rows), infeasible=infeasible)
