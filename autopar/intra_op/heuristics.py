"""Heuristics and reductions for the intra-op ILP (no JAX): the greedy plan with local
improvement, dominated strategies, and the plan a solve starts from.

A strategy i of group g is *dominated* by strategy j when j costs no more at the node, on every
edge against every strategy of the neighbour, and in bytes at every memory row (and is cheaper
somewhere or comes first): swapping i for j in any plan never costs more or needs more memory,
so an optimum without i exists. Identical strategies (equal cost rows everywhere) are the tie
case: all but the first are dominated. The MIP fixes dominated columns to 0.

    >>> reps = dominators(red)      # {group: representative strategy of each strategy}
"""
from __future__ import annotations

import numpy as np

from autopar.intra_op.reduced import _Reduced

IMPROVE_PASSES = 10       # local-improvement sweeps after greedy (stops early when stable)


def greedy(red: _Reduced, choice: np.ndarray | None = None, *, movable=None) -> np.ndarray:
    """Visit unset (-1) variable groups in index order; pick the cheapest strategy (node cost plus
    edges to chosen neighbours) that keeps memory rows within budget assuming unvisited groups
    take their smallest bytes; then a few passes of single-group local improvement over
    `movable` (default: the groups that were unset)."""
    choice = red.choice.copy() if choice is None else choice.copy()
    adj: dict[int, list[tuple[int, np.ndarray]]] = {g: [] for g in red.var_groups}
    for u, v, r in red.edges:
        adj[u].append((v, r))
        adj[v].append((u, r.T))
    mem_of: dict[int, list[tuple[int, np.ndarray]]] = {g: [] for g in red.var_groups}
    for row, (terms, _) in enumerate(red.mem_rows):
        for g, b in terms:
            mem_of[g].append((row, b))
    rhs = np.array([r for _, r in red.mem_rows], float)
    load = np.zeros(rhs.size)
    for row, (terms, _) in enumerate(red.mem_rows):   # groups fixed by the caller
        load[row] += sum(float(b[choice[g]]) for g, b in terms if choice[g] >= 0)

    def cost_of(g: int) -> np.ndarray:
        return red.node_costs[g] + sum((m[:, choice[n]] for n, m in adj[g] if choice[n] >= 0),
                                       np.zeros(red.node_costs[g].size))

    free = [g for g in red.var_groups if choice[g] < 0]
    for g in free:
        cost, over = cost_of(g), np.full(red.node_costs[g].size, -np.inf)
        for row, b in mem_of[g]:
            over = np.maximum(over, load[row] + b - rhs[row])
        i = int(np.argmin(np.where(over <= 0, cost, np.inf))) if (over <= 0).any() \
            else int(np.argmin(over))
        choice[g] = i
        for row, b in mem_of[g]:
            load[row] += b[i]
    for _ in range(IMPROVE_PASSES):
        changed = False
        for g in free if movable is None else movable:
            cost, cur = cost_of(g), choice[g]
            for i in np.argsort(cost, kind="stable"):
                if cost[i] >= cost[cur]:
                    break
                if all(load[r] + b[i] - b[cur] <= max(rhs[r], load[r]) for r, b in mem_of[g]):
                    for row, b in mem_of[g]:
                        load[row] += b[i] - b[cur]
                    choice[g], changed = int(i), True
                    break
        if not changed:
            break
    return choice


def _cost_rows(red: _Reduced) -> dict[int, np.ndarray]:
    """Per variable group, one row per strategy: its node cost, its edge-matrix rows (against
    every neighbour strategy) and its bytes at every memory row, side by side."""
    cols: dict[int, list[np.ndarray]] = {g: [red.node_costs[g][:, None]] for g in red.var_groups}
    for u, v, r in red.edges:
        cols[u].append(r)
        cols[v].append(r.T)
    for terms, _ in red.mem_rows:
        for g, b in terms:
            cols[g].append(np.asarray(b, float)[:, None])
    return {g: np.concatenate(c, axis=1) for g, c in cols.items()}


def dominators(red: _Reduced) -> dict[int, np.ndarray]:
    """Per variable group with a dominated strategy: for every strategy, the undominated
    strategy that replaces it (itself where undominated)."""
    out = {}
    for g, m in _cost_rows(red).items():
        k = m.shape[0]
        le = (m[None, :, :] <= m[:, None, :]).all(axis=2)       # le[i, j]: j <= i everywhere
        lt = (m[None, :, :] < m[:, None, :]).any(axis=2)
        first = np.arange(k)[None, :] < np.arange(k)[:, None]   # j comes before i
        dom = le & (lt | first)
        np.fill_diagonal(dom, False)
        if not dom.any():
            continue
        # Dominance is a strict order (ties broken by index), so an undominated strategy
        # dominating i exists: the end of any chain up from i. Take the first.
        undominated = ~dom.any(axis=1)
        rep = np.arange(k)
        for i in np.flatnonzero(~undominated):
            rep[i] = int(np.flatnonzero(dom[i] & undominated)[0])
        out[g] = rep
    return out


def undominated_choice(choice: np.ndarray, reps: dict[int, np.ndarray]) -> np.ndarray:
    """`choice` with every dominated strategy replaced by its representative (no worse)."""
    choice = np.array(choice, copy=True)
    for g, rep in reps.items():
        if choice[g] >= 0:
            choice[g] = rep[choice[g]]
    return choice
