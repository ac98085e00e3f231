"""Heuristics and reductions for the intra-op ILP (no JAX): the greedy plan with local
improvement, the LP solution rounded to a plan that fits (`lp_rounded`), dominated
strategies, and the plan a solve starts from.

A strategy i of group g is *dominated* by strategy j when j costs no more at the node, on every
edge against every strategy of the neighbour, and in bytes at every memory row (and is cheaper
somewhere or comes first): swapping i for j in any plan never costs more or needs more memory,
so an optimum without i exists. Identical strategies (equal cost rows everywhere) are the tie
case: all but the first are dominated. The MIP fixes dominated columns to 0.

    >>> reps = dominators(red)      # {group: representative strategy of each strategy}
"""
from __future__ import annotations

import numpy as np

from autopar.core.errors import InvalidArgumentError
from autopar.intra_op.memory_points import point_rows
from autopar.intra_op.mip import Mip, columns_of
from autopar.intra_op.reduced import _Reduced

IMPROVE_PASSES = 10       # local-improvement sweeps after greedy (stops early when stable)


class _Loads:
    """A choice of the reduced problem with what moving one group costs: its neighbours on the
    edges and its bytes at every memory row, the rows' loads kept as groups move."""

    def __init__(self, red: _Reduced, choice: np.ndarray):
        self.red, self.choice = red, choice
        self.adj: dict[int, list[tuple[int, np.ndarray]]] = {g: [] for g in red.var_groups}
        for u, v, r in red.edges:
            self.adj[u].append((v, r))
            self.adj[v].append((u, r.T))
        self.mem_of: dict[int, list[tuple[int, np.ndarray]]] = {g: [] for g in red.var_groups}
        for row, (terms, _) in enumerate(red.mem_rows):
            for g, b in terms:
                self.mem_of[g].append((row, b))
        self.rhs = np.array([r for _, r in red.mem_rows], float)
        self.load = np.zeros(self.rhs.size)
        for row, (terms, _) in enumerate(red.mem_rows):   # groups already chosen
            self.load[row] += sum(float(b[choice[g]]) for g, b in terms if choice[g] >= 0)

    def cost_of(self, g: int) -> np.ndarray:
        """Group g's cost per strategy: its node cost plus its edges to the chosen neighbours."""
        return self.red.node_costs[g] + sum(
            (m[:, self.choice[n]] for n, m in self.adj[g] if self.choice[n] >= 0),
            np.zeros(self.red.node_costs[g].size))

    def set(self, g: int, i: int) -> None:
        cur = self.choice[g]
        for row, b in self.mem_of[g]:
            self.load[row] += b[i] - (b[cur] if cur >= 0 else 0.0)
        self.choice[g] = int(i)

    def improve(self, movable) -> None:
        """Single-group moves to a cheaper strategy that put no row further over its budget,
        until none is left (at most IMPROVE_PASSES sweeps)."""
        choice, load, rhs = self.choice, self.load, self.rhs
        for _ in range(IMPROVE_PASSES):
            changed = False
            for g in movable:
                cost, cur = self.cost_of(g), choice[g]
                for i in np.argsort(cost, kind="stable"):
                    if cost[i] >= cost[cur]:
                        break
                    if all(load[r] + b[i] - b[cur] <= max(rhs[r], load[r])
                           for r, b in self.mem_of[g]):
                        self.set(g, i)
                        changed = True
                        break
            if not changed:
                break


def greedy(red: _Reduced, choice: np.ndarray | None = None, *, movable=None) -> np.ndarray:
    """Visit unset (-1) variable groups in index order; pick the cheapest strategy (node cost plus
    edges to chosen neighbours) that keeps memory rows within budget assuming unvisited groups
    take their smallest bytes; then a few passes of single-group local improvement over
    `movable` (default: the groups that were unset)."""
    plan = _Loads(red, red.choice.copy() if choice is None else choice.copy())
    free = [g for g in red.var_groups if plan.choice[g] < 0]
    for g in free:
        cost, over = plan.cost_of(g), np.full(red.node_costs[g].size, -np.inf)
        for row, b in plan.mem_of[g]:
            over = np.maximum(over, plan.load[row] + b - plan.rhs[row])
        plan.set(g, int(np.argmin(np.where(over <= 0, cost, np.inf))) if (over <= 0).any()
                 else int(np.argmin(over)))
    plan.improve(free if movable is None else movable)
    return plan.choice


ROUNDING_MOVES = 64     # repairs of an LP solution's rounding that a memory row exceeds


def lp_rounded(red: _Reduced, weights: dict[int, np.ndarray]) -> np.ndarray | None:
    """A plan from an LP solution (`weights[g]`: the LP's value of each strategy of variable
    group g): each group's largest strategy; then, while memory rows are over their budgets,
    the move of one group to another of its strategies that removes the most excess per unit
    of cost added; then `greedy`'s local improvement. None where the rows stay over.

    Memory-bound stage ILPs (GPT-39B layers on a 2 x 4 view) have LP optima whose largest
    strategies are a little over a memory row: this rounding lands within 0.1-0.2% of the LP
    bound, where the MIP needs its own root LP (about 10 s there) to start."""
    plan = _Loads(red, red.choice.copy())
    for g in red.var_groups:
        plan.set(g, int(np.argmax(weights[g])))
    rows = {g: (np.array([r for r, _ in m]), np.stack([b for _, b in m]))
            for g, m in plan.mem_of.items() if m}
    for _ in range(ROUNDING_MOVES):
        over = np.maximum(plan.load - plan.rhs, 0.0)
        if not over.any():
            break
        best, best_score = None, 0.0
        for g, (r, b) in rows.items():       # every strategy of g at once: b is rows x k
            cur, cost = plan.choice[g], plan.cost_of(g)
            load = plan.load[r][:, None] + b - b[:, cur][:, None]
            gain = over[r].sum() - np.maximum(load - plan.rhs[r][:, None], 0.0).sum(axis=0)
            added = np.maximum(cost - cost[cur], 1e-12)
            score = np.where(gain > 0, gain / added, 0.0)
            i = int(np.argmax(score))
            if score[i] > best_score:
                best, best_score = (g, i), float(score[i])
        if best is None:
            return None
        plan.set(*best)
    if (plan.load > plan.rhs).any():
        return None
    plan.improve(red.var_groups)
    return plan.choice


def rounded_columns(red: _Reduced, reps: dict[int, np.ndarray], mip: Mip,
                    x: np.ndarray) -> np.ndarray | None:
    """The MIP's columns of `lp_rounded`'s plan from its LP solution `x` (dominated
    strategies replaced, as the MIP fixes them to 0), or None (`Mip.rounding`)."""
    choice = lp_rounded(red, {g: x[s:s + k] for g, s, k in mip.group_cols})
    return None if choice is None else columns_of(mip, undominated_choice(choice, reps))


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


def polish_ties(problem, choice, tie_bytes: dict[int, np.ndarray]) -> tuple[int, ...]:
    """Break ties by memory (`problem`: an `ilp.IlpProblem`): `choice` with each group g of
    `tie_bytes` moved, in index order, to the strategy holding the fewest `tie_bytes[g]`
    bytes among those that cost no more than its current one (its node cost plus its edges
    to the other groups' choices), as long as the memory points still fit the budget. The
    objective never grows; a plan changes only where two strategies cost the same, e.g. a
    matrix read sliced by its one consumer, whole or split at no extra cost: the split one
    is kept.

        >>> choice = polish_ties(problem, sol.choice, {g: bytes_per_strategy})
    """
    c = [int(i) for i in choice]
    if len(c) != len(problem.node_costs):
        raise InvalidArgumentError(f"polish_ties: choice has {len(c)} entries; the problem has "
                                   f"{len(problem.node_costs)} groups (one strategy each).")
    adj: dict[int, list[tuple[int, np.ndarray]]] = {g: [] for g in tie_bytes}
    for e in problem.edges:
        if e.u in adj:
            adj[e.u].append((e.v, np.asarray(e.cost)))
        if e.v in adj:
            adj[e.v].append((e.u, np.asarray(e.cost).T))
    budget = problem.memory_budget_bytes
    rows = point_rows(problem.memory_points) if problem.memory_points and budget else None
    peak = rows.usage(c).max() if rows is not None else 0.0    # of the plan as it stands
    for g, held in tie_bytes.items():
        cost = np.array(problem.node_costs[g], float)
        for v, r in adj[g]:
            cost = cost + r[:, c[v]]
        now = c[g]
        tied = np.flatnonzero(cost <= cost[now] + 1e-12 * abs(cost[now]))
        best = int(tied[np.argmin(np.asarray(held, float)[tied])])
        if held[best] >= held[now]:
            continue
        c[g] = best
        if rows is not None:
            moved = rows.usage(c).max()
            if moved > max(budget, peak):
                c[g] = now
            else:
                peak = moved
    return tuple(c)
