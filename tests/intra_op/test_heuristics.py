"""Tests for autopar.intra_op.heuristics (no JAX): dominated strategies against brute force,
the greedy plan, and the start a solve is given."""
from __future__ import annotations

import numpy as np
import pytest

from autopar.intra_op import ilp, mip
from autopar.intra_op.heuristics import dominators, greedy, undominated_choice
from autopar.intra_op.ilp import (
    IlpEdge,
    IlpProblem,
    MemoryPoint,
    SolveStatus,
    brute_force,
    evaluate,
    peak_memory_bytes,
    solve_ilp,
)


def _problem(rng, *, memory: bool, dup: bool = False) -> IlpProblem:
    """A small random problem whose strategies often dominate each other (few distinct cost
    levels), optionally with a group holding two identical strategies."""
    ks = [3, 4, 3, 2, 4]
    costs = [rng.integers(0, 3, k).astype(float) for k in ks]
    edges = [IlpEdge(u=u, v=v, cost=rng.integers(0, 3, (ks[u], ks[v])).astype(float))
             for u, v in ((0, 1), (1, 2), (2, 3), (3, 4), (0, 4), (1, 3))]
    if dup:      # group 1's strategy 3 is a copy of its strategy 1 everywhere
        costs[1][3] = costs[1][1]
        edges = [IlpEdge(u=e.u, v=e.v, cost=_copy_row(e, 1, 1, 3)) for e in edges]
    points = ()
    if memory:
        points = tuple(MemoryPoint(terms=tuple((g, rng.integers(0, 4, ks[g]).astype(float))
                                               for g in rng.choice(5, 3, replace=False)),
                                   constant_bytes=1.0) for _ in range(3))
        if dup:
            points = tuple(MemoryPoint(terms=tuple((g, _copy(b, 1, 3) if g == 1 else b)
                                                   for g, b in p.terms),
                                       constant_bytes=p.constant_bytes) for p in points)
    problem = IlpProblem(node_costs=tuple(costs), edges=tuple(edges), memory_points=points)
    if not memory:
        return problem
    peaks = [peak_memory_bytes(problem, c) for c in np.ndindex(*ks)]
    return IlpProblem(node_costs=tuple(costs), edges=tuple(edges), memory_points=points,
                      memory_budget_bytes=float(np.median(peaks)))


def _copy(b, src, dst):
    b = np.array(b, float)
    b[dst] = b[src]
    return b


def _copy_row(e: IlpEdge, g: int, src: int, dst: int) -> np.ndarray:
    c = np.array(e.cost, float)
    if e.u == g:
        c[dst, :] = c[src, :]
    if e.v == g:
        c[:, dst] = c[:, src]
    return c


@pytest.mark.parametrize("memory", [False, True])
def test_replacing_a_dominated_strategy_never_costs_more(memory):
    """Every plan, with its dominated strategies replaced by their representatives, costs no
    more, and fits the budget where it did (brute force over all plans; points that always
    fit are no rows, so bytes there may grow); and some strategies were dominated, so the
    check is not empty."""
    rng = np.random.default_rng(7)
    replaced = 0
    for _ in range(6):
        problem = _problem(rng, memory=memory)
        red = ilp._presolve(problem)
        reps = dominators(red)
        for c in np.ndindex(*problem.num_strategies):
            choice = np.asarray(c)
            better = undominated_choice(choice, reps)
            replaced += int((better != choice).any())
            assert evaluate(problem, better) <= evaluate(problem, choice) + 1e-12
            budget = problem.memory_budget_bytes
            if memory and peak_memory_bytes(problem, choice) <= budget:
                assert peak_memory_bytes(problem, better) <= budget
        for rep in reps.values():      # representatives are undominated: a fixed point
            assert (rep[rep] == rep).all()
    assert replaced > 0


def test_identical_strategies_map_to_the_first():
    rng = np.random.default_rng(3)
    for memory in (False, True):
        problem = _problem(rng, memory=memory, dup=True)
        reps = dominators(ilp._presolve(problem))
        assert 1 in reps and reps[1][3] == reps[1][1], reps.get(1)


@pytest.mark.parametrize("memory", [False, True])
def test_solve_without_dominated_columns_matches_brute_force(memory):
    rng = np.random.default_rng(11)
    for _ in range(8):
        problem = _problem(rng, memory=memory, dup=True)
        best, sol = brute_force(problem), solve_ilp(problem)
        assert sol.status is best.status is SolveStatus.OPTIMAL
        assert abs(sol.objective - best.objective) <= 1e-9 * max(1.0, abs(best.objective))
        reps = dominators(ilp._presolve(problem))
        assert all(reps[g][sol.choice[g]] == sol.choice[g] for g in reps)   # never dominated


def test_undominated_choice_leaves_unset_groups():
    reps = {0: np.array([0, 0, 2]), 2: np.array([1, 1])}
    got = undominated_choice(np.array([1, -1, 0]), reps)
    assert got.tolist() == [0, -1, 1]


def test_greedy_is_a_full_plan_within_budget_when_one_exists():
    rng = np.random.default_rng(5)
    for _ in range(5):
        problem = _problem(rng, memory=True)
        red = ilp._presolve(problem)
        choice = greedy(red)
        assert (choice >= 0).all() and len(choice) == len(problem.node_costs)
        assert evaluate(problem, choice) >= brute_force(problem).objective - 1e-12


def test_the_solver_starts_from_a_feasible_plan(monkeypatch):
    """The MIP gets a start: the column vector of a plan that satisfies every row, whose
    objective (with the model's offset, in seconds) is the plan's cost."""
    seen = []
    real = mip.solve_highs

    def spy(model, time_limit_s):
        seen.append(model)
        return real(model, time_limit_s)
    monkeypatch.setattr(mip, "solve_highs", spy)
    rng = np.random.default_rng(9)
    for memory in (False, True):
        problem = _problem(rng, memory=memory)
        solve_ilp(problem)
    assert seen and all(m.start is not None for m in seen)
    for m in seen:
        x = m.start
        act = np.bincount(m.rows, weights=m.vals * x[m.cols], minlength=m.row_lower.size)
        assert (act >= m.row_lower - 1e-9).all() and (act <= m.row_upper + 1e-9).all()
        assert (x <= m.upper + 1e-12).all()       # no dominated (fixed to 0) column is used


def test_columns_of_prices_a_plan_like_evaluate():
    rng = np.random.default_rng(2)
    problem = _problem(rng, memory=False)
    red = ilp._presolve(problem)
    model = mip.build_mip(red)
    for c in list(np.ndindex(*problem.num_strategies))[::7]:
        choice = np.where(red.choice >= 0, red.choice, np.asarray(c))
        objective = (model.cost @ mip.columns_of(model, choice) + model.offset) * model.scale
        assert abs(objective - evaluate(problem, choice)) <= 1e-9 * max(1.0, objective)


def test_same_plan_run_to_run_and_same_optimum_from_any_hint():
    """Determinism: a solve returns the same plan run to run; a different start (hint) may
    pick another of tied optima, never a worse plan."""
    rng = np.random.default_rng(21)
    for memory in (False, True):
        for _ in range(4):
            problem = _problem(rng, memory=memory)
            plain, again = solve_ilp(problem), solve_ilp(problem)
            assert plain.choice == again.choice
            for hint in ((0,) * 5, tuple(k - 1 for k in problem.num_strategies)):
                hinted = ilp._solve_once(problem, hint=hint)
                assert abs(hinted.objective - plain.objective) <= 1e-9 * max(1.0, plain.objective)


def test_lp_rounding_fits_the_budget_and_is_priced_like_evaluate():
    """`lp_rounded` of the LP relaxation on random problems with binding memory: every plan it
    returns fits the budget, and `rounded_columns` prices it as `evaluate` does; on most
    problems it returns one (the check is not empty)."""
    from autopar.intra_op.heuristics import lp_rounded, rounded_columns
    rng = np.random.default_rng(11)
    found = 0
    for _ in range(12):
        problem = _problem(rng, memory=True)
        red = ilp._presolve(problem)
        if not red.var_groups or red.infeasible:
            continue
        reps = dominators(red)
        model = mip.build_mip(red, reps)
        h = mip._highs(model, 10.0, relaxed=True)
        h.run()
        x = np.asarray(h.getSolution().col_value)
        choice = lp_rounded(red, {g: x[s:s + k] for g, s, k in model.group_cols})
        if choice is None:
            continue
        found += 1
        assert peak_memory_bytes(problem, choice) <= problem.memory_budget_bytes
        cols = rounded_columns(red, reps, model, x)
        better = undominated_choice(choice, reps)
        assert np.isclose((model.cost @ cols + model.offset) * model.scale,
                          evaluate(problem, better))
        assert evaluate(problem, better) <= evaluate(problem, choice) + 1e-12
    assert found >= 6
