"""Tests for autopar.intra_op.ilp: against brute force, presolve rules, limits, fallbacks."""
from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest

from autopar.core.enums import SolverBackend
from autopar.core.errors import InvalidArgumentError, UnsupportedError
from autopar.intra_op import heuristics, ilp, mip
from autopar.intra_op.ilp import (
    IlpEdge,
    IlpProblem,
    MemoryPoint,
    SolveStatus,
    brute_force,
    evaluate,
    min_peak_memory,
    peak_memory_bytes,
    solve_ilp,
)
from autopar.intra_op.mip import MipResult

BACKENDS = [SolverBackend.HIGHS, SolverBackend.CBC]


def _edge(u, v, cost):
    return IlpEdge(u=u, v=v, cost=np.asarray(cost, float))


def _random_problem(rng, *, with_memory: bool) -> IlpProblem:
    num_groups = int(rng.integers(3, 8))
    ks = rng.integers(1, 5, size=num_groups)
    node_costs = tuple(rng.random(k) for k in ks)
    edges = []
    for _ in range(int(rng.integers(1, 2 * num_groups + 1))):
        u, v = (int(g) for g in rng.choice(num_groups, 2, replace=False))
        edges.append(_edge(u, v, rng.random((ks[u], ks[v]))))
    problem = IlpProblem(node_costs=node_costs, edges=tuple(edges))
    if not with_memory:
        return problem
    points = []
    for _ in range(int(rng.integers(1, 4))):
        groups = rng.choice(num_groups, int(rng.integers(1, num_groups + 1)), replace=False)
        terms = tuple((int(g), rng.integers(0, 1000, size=ks[g]).astype(float)) for g in groups)
        points.append(MemoryPoint(terms=terms, constant_bytes=float(rng.integers(0, 500))))
    problem = IlpProblem(node_costs=node_costs, edges=tuple(edges), memory_points=tuple(points))
    peaks = _all_peaks(problem)
    budget = peaks.min() + rng.uniform(-0.2, 1.0) * (peaks.max() - peaks.min())
    return IlpProblem(node_costs=node_costs, edges=tuple(edges), memory_points=tuple(points),
                      memory_budget_bytes=float(budget))


def _all_peaks(problem: IlpProblem) -> np.ndarray:
    ks = problem.num_strategies
    return np.array([peak_memory_bytes(problem, c) for c in np.indices(ks).reshape(len(ks), -1).T])


def _assert_close(a: float, b: float) -> None:
    assert abs(a - b) <= 1e-9 * max(abs(a), abs(b), 1e-300), (a, b)


def _random_big(num_groups: int, k: int, num_edges: int, seed: int = 0) -> IlpProblem:
    rng = np.random.default_rng(seed)
    edges = []
    for _ in range(num_edges):
        u, v = (int(g) for g in rng.choice(num_groups, 2, replace=False))
        edges.append(_edge(u, v, rng.random((k, k))))
    return IlpProblem(node_costs=tuple(rng.random(k) for _ in range(num_groups)),
                      edges=tuple(edges))


# ----------------------------------------------------------------------------- evaluate

def test_evaluate_and_peak_memory_hand_example():
    problem = IlpProblem(
        node_costs=(np.array([1.0, 2.0]), np.array([10.0, 20.0, 30.0]), np.array([5.0])),
        edges=(_edge(0, 1, [[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]]), _edge(2, 1, [[7.0, 8.0, 9.0]])),
        memory_points=(
            MemoryPoint(terms=((0, np.array([100.0, 50.0])), (1, np.array([1.0, 2.0, 3.0]))),
                        constant_bytes=1000.0),
            MemoryPoint(terms=((2, np.array([2000.0])),), constant_bytes=0.0)),
        memory_budget_bytes=5000.0)
    # choice (1, 2, 0): nodes 2 + 30 + 5, edges 0.6 + 9.
    assert evaluate(problem, (1, 2, 0)) == pytest.approx(46.6, rel=1e-15)
    assert evaluate(problem, (0, 0, 0)) == pytest.approx(1 + 10 + 5 + 0.1 + 7, rel=1e-15)
    assert peak_memory_bytes(problem, (1, 2, 0)) == 2000.0   # max(1000 + 50 + 3, 2000)
    assert peak_memory_bytes(IlpProblem(node_costs=problem.node_costs, edges=()), (0, 0, 0)) == 0.0
    with pytest.raises(InvalidArgumentError):
        evaluate(problem, (2, 0, 0))
    with pytest.raises(InvalidArgumentError):
        evaluate(problem, (0, 0))


def test_validation_errors():
    with pytest.raises(InvalidArgumentError):
        IlpProblem(node_costs=(np.array([]),), edges=())
    with pytest.raises(InvalidArgumentError):
        IlpProblem(node_costs=(np.ones(2), np.ones(3)), edges=(_edge(0, 1, np.ones((3, 2))),))
    with pytest.raises(InvalidArgumentError):
        IlpProblem(node_costs=(np.ones(2), np.ones(2)), edges=(_edge(1, 1, np.ones((2, 2))),))
    with pytest.raises(InvalidArgumentError):
        IlpProblem(node_costs=(np.ones(2),), edges=(),
                   memory_points=(MemoryPoint(terms=((0, np.ones(3)),), constant_bytes=0.0),))
    with pytest.raises(ValueError):
        brute_force(IlpProblem(node_costs=tuple(np.ones(8) for _ in range(7)), edges=()))
    with pytest.raises(InvalidArgumentError):
        solve_ilp(IlpProblem(node_costs=(np.ones(2),), edges=()), time_limit_s=0.0)


# ----------------------------------------------------------------------------- vs brute force

@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_brute_force_on_random_problems(backend):
    rng = np.random.default_rng(1234)
    statuses = set()
    for n in range(30):
        problem = _random_problem(rng, with_memory=n % 3 != 0)
        expected, got = brute_force(problem), solve_ilp(problem, backend=backend)
        statuses.add(expected.status)
        assert got.status is expected.status, (n, got, expected)
        assert got.objective == evaluate(problem, got.choice)
        if expected.status is SolveStatus.OPTIMAL:
            _assert_close(got.objective, expected.objective)
            budget = problem.memory_budget_bytes
            assert budget is None or peak_memory_bytes(problem, got.choice) <= budget
        else:
            assert peak_memory_bytes(problem, got.choice) == _all_peaks(problem).min()
    assert statuses == {SolveStatus.OPTIMAL, SolveStatus.INFEASIBLE}


def test_backends_agree_on_random_problems():
    rng = np.random.default_rng(99)
    for n in range(10):
        problem = _random_problem(rng, with_memory=n % 2 == 0)
        sols = [solve_ilp(problem, backend=b) for b in BACKENDS]
        assert len({s.status for s in sols}) == 1
        # Where the budget cannot be met, any least-peak plan is the answer (its cost aside).
        measure = (lambda s: s.objective) if sols[0].status is SolveStatus.OPTIMAL else (
            lambda s: peak_memory_bytes(problem, s.choice))
        values = [measure(s) for s in sols]
        assert max(values) - min(values) <= 1e-9 * max(abs(v) for v in values)


@pytest.mark.parametrize("backend", BACKENDS)
def test_infeasible_budget_reports_min_peak_memory(backend):
    rng = np.random.default_rng(7)
    base = _random_problem(rng, with_memory=True)
    peaks = _all_peaks(base)
    problem = IlpProblem(node_costs=base.node_costs, edges=base.edges,
                         memory_points=base.memory_points, memory_budget_bytes=peaks.min() - 1.0)
    sol = solve_ilp(problem, backend=backend)
    assert sol.status is SolveStatus.INFEASIBLE
    assert brute_force(problem).status is SolveStatus.INFEASIBLE
    assert peak_memory_bytes(problem, sol.choice) == peaks.min()
    assert "cannot be met" in sol.message
    need, choice = min_peak_memory(problem, backend=backend)
    assert need == peaks.min() == peak_memory_bytes(problem, choice)


def test_infeasible_detected_in_presolve_and_min_peak_without_points():
    problem = IlpProblem(
        node_costs=(np.array([1.0, 2.0]), np.array([3.0, 1.0])),
        edges=(_edge(0, 1, [[0.0, 1.0], [1.0, 0.0]]),),
        memory_points=(MemoryPoint(terms=((0, np.array([10.0, 20.0])),), constant_bytes=100.0),),
        memory_budget_bytes=50.0)
    sol = solve_ilp(problem)
    assert sol.status is SolveStatus.INFEASIBLE and sol.num_variables == 0
    assert min_peak_memory(problem) == (110.0, sol.choice) and sol.choice[0] == 0
    free = IlpProblem(node_costs=problem.node_costs, edges=problem.edges)
    need, choice = min_peak_memory(free)
    assert need == 0.0 and len(choice) == 2


# ----------------------------------------------------------------------------- presolve rules

def _check_optimum(problem: IlpProblem) -> ilp.IlpSolution:
    expected = brute_force(problem)
    for backend in BACKENDS:
        got = solve_ilp(problem, backend=backend)
        assert got.status is SolveStatus.OPTIMAL
        _assert_close(got.objective, expected.objective)
    return solve_ilp(problem)


def test_single_strategy_groups_get_no_variables():
    rng = np.random.default_rng(3)
    ks = (1, 3, 1, 4)
    problem = IlpProblem(
        node_costs=tuple(rng.random(k) for k in ks),
        edges=(_edge(0, 1, rng.random((1, 3))), _edge(1, 3, rng.random((3, 4))),
               _edge(3, 2, rng.random((4, 1))), _edge(0, 2, rng.random((1, 1)))),
        memory_points=(MemoryPoint(terms=((0, np.array([500.0])), (1, np.array([1.0, 9.0, 5.0]))),
                                   constant_bytes=0.0),),
        memory_budget_bytes=505.0)
    sol = _check_optimum(problem)
    assert sol.num_variables == 3 + 4 + 3 * 4                   # groups 1 and 3 and their edge
    assert sol.num_constraints == 2 + (3 + 4 - 1) + 1           # one-hot, edge, memory
    assert sol.choice[0] == sol.choice[2] == 0


def test_parallel_edges_are_summed():
    rng = np.random.default_rng(4)
    a, b = rng.random((3, 2)), rng.random((2, 3))
    problem = IlpProblem(node_costs=(rng.random(3), rng.random(2)),
                         edges=(_edge(0, 1, a), _edge(1, 0, b), _edge(0, 1, a)))
    sol = _check_optimum(problem)
    assert sol.num_variables == 3 + 2 + 3 * 2
    assert sol.num_constraints == 2 + (3 + 2 - 1)


def test_separable_and_constant_edges_are_folded():
    rng = np.random.default_rng(5)
    sep = rng.random(3)[:, None] + rng.random(4)[None, :]
    problem = IlpProblem(node_costs=(rng.random(3), rng.random(4), rng.random(2)),
                         edges=(_edge(0, 1, sep), _edge(1, 2, np.full((4, 2), 0.7)),
                                _edge(0, 2, rng.random((3, 2)))))
    sol = _check_optimum(problem)
    assert sol.num_variables == 3 + 2 + 3 * 2                   # only the random edge 0-2 is left
    only_separable = IlpProblem(node_costs=problem.node_costs, edges=problem.edges[:2])
    sol = _check_optimum(only_separable)
    assert sol.num_variables == 0 and sol.backend is None       # every group became isolated


def test_memory_points_that_always_fit_are_dropped_and_isolated_groups_fixed():
    rng = np.random.default_rng(6)
    pts = (MemoryPoint(terms=((0, np.array([1.0, 2.0, 3.0])),), constant_bytes=20.0),
           MemoryPoint(terms=((1, np.array([1.0, 50.0])), (2, np.array([40.0, 1.0]))),
                       constant_bytes=10.0))
    kwargs = dict(node_costs=(rng.random(3), rng.random(2), rng.random(2)),
                  edges=(_edge(1, 2, [[0.0, 1.0], [1.0, 0.0]]),), memory_points=pts)
    loose = _check_optimum(IlpProblem(**kwargs, memory_budget_bytes=1000.0))
    assert (loose.num_variables, loose.num_constraints) == (2 + 2 + 4, 2 + 3)   # group 0 isolated
    no_budget = solve_ilp(IlpProblem(**kwargs))
    assert (no_budget.num_variables, no_budget.num_constraints) == (8, 5)
    tight = _check_optimum(IlpProblem(**kwargs, memory_budget_bytes=55.0))
    assert (tight.num_variables, tight.num_constraints) == (8, 6)               # point 1 binds
    tighter = _check_optimum(IlpProblem(**kwargs, memory_budget_bytes=22.0))
    assert (tighter.num_variables, tighter.num_constraints) == (3 + 8, 3 + 3 + 2)


def test_no_edges_no_memory_needs_no_solver():
    costs = (np.array([3.0, 1.0, 2.0]), np.array([5.0]), np.array([0.5, 0.25]))
    sol = solve_ilp(IlpProblem(node_costs=costs, edges=()))
    assert sol.choice == (1, 0, 1) and sol.objective == 6.25
    assert sol.status is SolveStatus.OPTIMAL and sol.backend is None and sol.num_variables == 0
    empty = solve_ilp(IlpProblem(node_costs=(), edges=()))
    assert empty.choice == () and empty.objective == 0.0
    assert brute_force(IlpProblem(node_costs=(), edges=())).choice == ()


# ----------------------------------------------------------------------------- limits, fallbacks

def _check_stopped_early(problem: IlpProblem, sol: ilp.IlpSolution) -> None:
    assert sol.status in (SolveStatus.FEASIBLE, SolveStatus.FALLBACK), sol.message
    assert len(sol.choice) == len(problem.node_costs)
    assert all(0 <= c < k for c, k in zip(sol.choice, problem.num_strategies))
    assert sol.objective == evaluate(problem, sol.choice)
    assert "time limit" in sol.message


def test_time_limit_highs():
    problem = _random_big(400, 8, 800)
    _check_stopped_early(problem, solve_ilp(problem, time_limit_s=0.05))


def test_time_limit_cbc():
    problem = _random_big(100, 8, 200, seed=1)
    _check_stopped_early(problem, solve_ilp(problem, backend=SolverBackend.CBC, time_limit_s=0.05))


def test_solver_exception_falls_back_to_greedy(monkeypatch):
    def boom(mip, time_limit_s):
        raise RuntimeError("solver exploded")
    monkeypatch.setattr(mip, "solve_highs", boom)
    problem = _random_big(30, 4, 60)
    sol = solve_ilp(problem)
    assert sol.status is SolveStatus.FALLBACK and "greedy" in sol.message
    assert "solver exploded" in sol.message and sol.objective == evaluate(problem, sol.choice)


def test_cbc_without_a_binary_is_a_clear_error(monkeypatch):
    """PuLP 4 bundles no CBC (PuLP 3's PULP_CBC_CMD): asking for CBC where no binary is found
    raises, naming the fix, instead of falling back to a greedy plan."""
    import pulp
    monkeypatch.delattr(pulp, "PULP_CBC_CMD", raising=False)      # as PuLP 4
    monkeypatch.setattr(pulp.COIN_CMD, "available", lambda self: False)
    with pytest.raises(UnsupportedError, match=r"(?s)SolverBackend\.CBC.*pulp\[cbc\]"):
        solve_ilp(_random_big(10, 3, 20), backend=SolverBackend.CBC)
    assert solve_ilp(_random_big(10, 3, 20)).status is SolveStatus.OPTIMAL   # HiGHS unaffected


def test_incumbent_path_rounds_and_improves(monkeypatch):
    def stopped(mip, time_limit_s):
        x = np.zeros(mip.cost.size)
        for _, start, _ in mip.group_cols:
            x[start] = 1.0                       # every group at strategy 0
        return MipResult(kind=SolveStatus.FEASIBLE, x=x, reason="time limit 1 s hit", gap=0.5)
    monkeypatch.setattr(mip, "solve_highs", stopped)
    problem = _random_big(30, 4, 60, seed=2)
    sol = solve_ilp(problem)
    assert sol.status is SolveStatus.FEASIBLE and "gap 50%" in sol.message
    assert sol.objective <= evaluate(problem, (0,) * 30)


def test_greedy_respects_memory_when_it_can(monkeypatch):
    monkeypatch.setattr(mip, "solve_highs", lambda mip, t: MipResult(
        kind=SolveStatus.FALLBACK, x=None, reason="time limit 1 s hit"))
    # Strategy 0 is cheap but big; the budget allows only one group to take it.
    problem = IlpProblem(
        node_costs=tuple(np.array([0.0, 1.0]) for _ in range(3)), edges=(),
        memory_points=(MemoryPoint(terms=tuple((g, np.array([100.0, 10.0])) for g in range(3)),
                                   constant_bytes=0.0),),
        memory_budget_bytes=120.0)
    sol = solve_ilp(problem)
    assert sol.status is SolveStatus.FALLBACK
    assert peak_memory_bytes(problem, sol.choice) <= 120.0 and sol.objective == 2.0


@pytest.mark.parametrize("seed", range(5))
def test_lazy_memory_points_are_exact(seed):
    """With more than LAZY_MEMORY_POINTS points, constraints are added as they are violated;
    the result must still be the constrained optimum."""
    rng = np.random.default_rng(100 + seed)
    k = [3, 4, 3, 4, 3, 2]
    costs = tuple(rng.uniform(0, 1, n) for n in k)
    edges = tuple(_edge(u, u + 1, rng.uniform(0, 1, (k[u], k[u + 1]))) for u in range(5))
    points = []
    for _ in range(ilp.LAZY_MEMORY_POINTS + 20):
        groups = rng.choice(6, size=3, replace=False)
        points.append(MemoryPoint(terms=tuple((int(g), rng.uniform(0, 10, k[g])) for g in groups),
                                  constant_bytes=float(rng.uniform(0, 5))))
    loose = IlpProblem(node_costs=costs, edges=edges, memory_points=tuple(points),
                       memory_budget_bytes=1e9)
    unconstrained = ilp.brute_force(loose)
    # between the least memory any plan needs and what the unconstrained optimum needs
    budget = 0.5 * (_all_peaks(loose).min() + ilp.peak_memory_bytes(loose, unconstrained.choice))
    problem = IlpProblem(node_costs=costs, edges=edges, memory_points=tuple(points),
                         memory_budget_bytes=budget)
    best = ilp.brute_force(problem)
    sol = ilp.solve_ilp(problem)
    assert sol.status is SolveStatus.OPTIMAL
    _assert_close(sol.objective, best.objective)
    assert ilp.peak_memory_bytes(problem, sol.choice) <= budget
    assert "liveness constraints needed" in sol.message


def _many_points(rng, k, count):
    return [MemoryPoint(terms=tuple((int(g), rng.uniform(0, 10, k[g]))
                                    for g in rng.choice(len(k), size=3, replace=False)),
                        constant_bytes=float(rng.uniform(0, 5))) for _ in range(count)]


def test_lazy_min_peak_memory_is_exact(monkeypatch):
    """min_peak_memory adds points as the choice exceeds the optimum over those taken: it
    must still give the least peak of every plan (brute force over all of them)."""
    rounds, real = [], ilp._min_peak_choice
    monkeypatch.setattr(ilp, "_min_peak_choice", lambda *a: rounds.append(1) or real(*a))
    per_seed = []
    for seed in range(8):
        rng = np.random.default_rng(300 + seed)
        k = [3, 4, 3, 4, 3, 2, 3]
        problem = IlpProblem(node_costs=tuple(rng.uniform(0, 1, n) for n in k), edges=(),
                             memory_points=tuple(_many_points(rng, k, 3 * ilp.LAZY_MEMORY_POINTS)))
        rounds.clear()
        need, choice = min_peak_memory(problem)
        _assert_close(need, _all_peaks(problem).min())
        assert need == peak_memory_bytes(problem, choice)
        per_seed.append(len(rounds))
    assert max(per_seed) > 1          # some seed needed points beyond the first batch


def test_min_peak_memory_needs_no_mip_where_the_lean_plan_meets_every_floor(monkeypatch):
    """Where each group is leanest in the same strategy at every point (a tensor split ever
    finer, counted once or several times), the plan of those strategies puts every point at
    its floor (its constant once folded): that is the least peak, and no MIP runs. Where a
    group is leanest in different strategies at different points, the MIP decides. Both are
    exact (brute force)."""
    rounds, real = [], ilp._min_peak_choice
    monkeypatch.setattr(ilp, "_min_peak_choice", lambda *a: rounds.append(1) or real(*a))
    rng = np.random.default_rng(21)
    k = [3, 4, 3, 4, 3, 2]
    split = [rng.permutation(np.linspace(1.0, 1.0 / n, n)) * rng.uniform(1, 9) for n in k]
    costs = tuple(rng.uniform(0, 1, n) for n in k)
    points = tuple(MemoryPoint(terms=tuple((int(g), rng.integers(1, 4) * split[g])
                                           for g in rng.choice(len(k), 3, replace=False)),
                               constant_bytes=float(rng.uniform(0, 5))) for _ in range(40))
    problem = IlpProblem(node_costs=costs, edges=(), memory_points=points)
    need, choice = min_peak_memory(problem)
    _assert_close(need, _all_peaks(problem).min())
    assert need == peak_memory_bytes(problem, choice) and not rounds
    mixed = replace(problem, memory_points=tuple(_many_points(rng, k, 40)))
    need, _ = min_peak_memory(mixed)
    _assert_close(need, _all_peaks(mixed).min())
    assert rounds


def test_folded_points_solve_like_the_points_they_fold():
    """`folded_point` moves each group's minimum into the constant; the ILP must not see a
    difference (objective, peak, and the least memory)."""
    rng = np.random.default_rng(11)
    k = [3, 4, 3, 4, 3, 2]
    costs = tuple(rng.uniform(0, 1, n) for n in k)
    edges = tuple(_edge(u, u + 1, rng.uniform(0, 1, (k[u], k[u + 1]))) for u in range(5))
    points = _many_points(rng, k, 12)
    folded = [ilp.folded_point(dict(p.terms), p.constant_bytes) for p in points]
    assert all(f.folded and f.max_bytes >= f.constant_bytes for f in folded)
    plain = IlpProblem(node_costs=costs, edges=edges, memory_points=tuple(points))
    budget = float(np.median(_all_peaks(plain)))
    a, b = (ilp.solve_ilp(IlpProblem(node_costs=costs, edges=edges, memory_points=tuple(ps),
                                     memory_budget_bytes=budget)) for ps in (points, folded))
    _assert_close(a.objective, b.objective)
    _assert_close(min_peak_memory(plain)[0], min_peak_memory(IlpProblem(
        node_costs=costs, edges=edges, memory_points=tuple(folded)))[0])


# ----------------------------------------------------------------------------- LP first

def _count_highs(monkeypatch) -> list[bool]:
    calls, real = [], mip._highs
    monkeypatch.setattr(mip, "_highs", lambda m, t, *, relaxed: calls.append(relaxed) or
                        real(m, t, relaxed=relaxed))
    return calls


def test_integral_lp_relaxation_is_the_answer(monkeypatch):
    """On a path (a tree) the edge LP is integral: the LP relaxation answers, no MIP runs."""
    calls = _count_highs(monkeypatch)
    rng = np.random.default_rng(4)
    k = [3, 4, 3, 4, 3]
    problem = IlpProblem(node_costs=tuple(rng.random(n) for n in k),
                         edges=tuple(_edge(u, u + 1, rng.random((k[u], k[u + 1])))
                                     for u in range(4)))
    sol = solve_ilp(problem)
    assert calls == [True] and sol.status is SolveStatus.OPTIMAL
    _assert_close(sol.objective, brute_force(problem).objective)


def test_fractional_lp_relaxation_goes_on_to_the_mip(monkeypatch):
    """A frustrated triangle (each edge wants its two ends to differ, of two strategies): the
    LP takes every strategy at 1/2 for cost 0; the MIP must pay 1 on some edge."""
    calls = _count_highs(monkeypatch)
    differ = [[1.0, 0.0], [0.0, 1.0]]
    problem = IlpProblem(node_costs=tuple(np.array([0.0, 0.001 * g]) for g in range(3)),
                         edges=(_edge(0, 1, differ), _edge(1, 2, differ), _edge(0, 2, differ)))
    sol = solve_ilp(problem)
    assert calls == [True, False] and sol.status is SolveStatus.OPTIMAL
    _assert_close(sol.objective, brute_force(problem).objective)
    assert sol.objective >= 1.0


def test_dive_reaches_a_feasible_integral_plan():
    """The LP dive fixes the last fractional group and re-solves until the LP is integral:
    on the frustrated triangle that is a feasible plan, and here an optimal one."""
    differ = [[1.0, 0.0], [0.0, 1.0]]
    problem = IlpProblem(node_costs=tuple(np.array([0.0, 0.001 * g]) for g in range(3)),
                         edges=(_edge(0, 1, differ), _edge(1, 2, differ), _edge(0, 2, differ)))
    red = ilp._presolve(problem)
    model = mip.build_mip(red)
    h = mip._highs(model, 10.0, relaxed=True)
    h.run()
    x0 = np.asarray(h.getSolution().col_value)
    assert not mip.is_integral(model, x0)
    x = mip._dive(h, model, x0, deadline=float("inf"))
    assert x is not None and mip.is_integral(model, x)
    act = np.bincount(model.rows, weights=model.vals * x[model.cols],
                      minlength=model.row_lower.size)
    assert (act >= model.row_lower - 1e-9).all() and (act <= model.row_upper + 1e-9).all()
    choice = mip.round_solution(model, x, red.choice)
    _assert_close((model.cost @ x + model.offset) * model.scale, evaluate(problem, choice))
    _assert_close(evaluate(problem, choice), brute_force(problem).objective)


def test_point_rows_price_every_point_at_once():
    """`point_rows(points).usage(choice)` is each point's constant plus the chosen bytes of
    its terms (repeated groups summed), the vector `solve_ilp`'s lazy rounds and
    `peak_memory_bytes` read."""
    rng = np.random.default_rng(7)
    for _ in range(20):
        problem = _random_problem(rng, with_memory=True)
        points = problem.memory_points + (MemoryPoint(terms=(), constant_bytes=3.0),)
        rows = ilp.point_rows(points)
        assert ilp.point_rows(points) is rows                      # cached by the tuple
        for c in np.indices(problem.num_strategies).reshape(len(problem.num_strategies), -1).T:
            want = [p.constant_bytes + sum(float(b[c[g]]) for g, b in p.terms) for p in points]
            np.testing.assert_allclose(rows.usage(c), want, rtol=1e-12)
            _assert_close(peak_memory_bytes(problem, c), max(want[:-1]))


def test_point_rows_price_a_mixed_plan():
    """`PointRows.mixed_usage` (what `solve_ilp` prices the LP relaxation with) is the
    weighted sum of the strategies' bytes at every point: `usage` for one-hot weights."""
    rng = np.random.default_rng(11)
    for _ in range(10):
        problem = _random_problem(rng, with_memory=True)
        rows, ks = ilp.point_rows(problem.memory_points), problem.num_strategies
        weights = {g: rng.dirichlet(np.ones(k)) for g, k in enumerate(ks)}
        want = [p.constant_bytes + sum(float(b @ weights[g]) for g, b in p.terms)
                for p in problem.memory_points]
        np.testing.assert_allclose(rows.mixed_usage(weights), want, rtol=1e-12)
        c = [int(rng.integers(k)) for k in ks]
        np.testing.assert_allclose(rows.mixed_usage({g: np.eye(k)[c[g]] for g, k in
                                                     enumerate(ks)}), rows.usage(c))


def test_lazy_points_start_from_the_lp_that_fits_them(monkeypatch):
    """The lazy rounds start with the points the LP relaxation needs (and those it nearly
    fills): fewer MIPs than adding points only as integral plans break them (`_lp_points`
    returning nothing, as before), the same optimum (brute force)."""
    solves, real, lp_points = [], ilp._solve_once, ilp._lp_points
    monkeypatch.setattr(ilp, "_solve_once", lambda *a, **k: solves.append(1) or real(*a, **k))
    counts = {True: [], False: []}
    for seed in range(6):
        rng = np.random.default_rng(100 + seed)
        k = [3, 4, 3, 4, 3, 2]
        costs = tuple(rng.uniform(0, 1, n) for n in k)
        edges = tuple(_edge(u, u + 1, rng.uniform(0, 1, (k[u], k[u + 1]))) for u in range(5))
        points = tuple(_many_points(rng, k, ilp.LAZY_MEMORY_POINTS + 20))
        loose = IlpProblem(node_costs=costs, edges=edges, memory_points=points,
                           memory_budget_bytes=1e9)
        free = ilp.peak_memory_bytes(loose, ilp.brute_force(loose).choice)
        problem = replace(loose, memory_budget_bytes=0.5 * (_all_peaks(loose).min() + free))
        best = ilp.brute_force(problem).objective
        for from_lp in (True, False):
            monkeypatch.setattr(ilp, "_lp_points",
                                lp_points if from_lp else lambda *a: ([], None))
            solves.clear()
            sol = ilp.solve_ilp(problem)
            _assert_close(sol.objective, best)
            counts[from_lp].append(len(solves))
    assert all(a <= b for a, b in zip(counts[True], counts[False])), counts
    assert sum(counts[True]) < sum(counts[False]), counts


def test_an_integral_lp_that_fits_every_point_needs_no_mip(monkeypatch):
    """Where the LP relaxation comes out integral and fits every memory point, it is the
    optimum: `solve_ilp` returns it without a MIP (brute force agrees)."""
    solves, real = [], ilp._solve_once
    monkeypatch.setattr(ilp, "_solve_once", lambda *a, **k: solves.append(1) or real(*a, **k))
    rng = np.random.default_rng(5)
    k = [3, 4, 3, 4]
    points = tuple(_many_points(rng, k, ilp.LAZY_MEMORY_POINTS + 5))
    problem = IlpProblem(node_costs=tuple(rng.uniform(0, 1, n) for n in k), edges=(),
                         memory_points=points, memory_budget_bytes=1e9)
    sol = ilp.solve_ilp(problem)
    assert not solves and sol.status is SolveStatus.OPTIMAL and "LP relaxation" in sol.message
    _assert_close(sol.objective, ilp.brute_force(problem).objective)


def test_with_extra_bytes_is_the_points_with_the_bytes_added():
    """`with_extra_bytes` (summed and folded as flat arrays) prices every choice as the
    original points plus the extra bytes of the chosen strategies, at every point."""
    rng = np.random.default_rng(3)
    ks = (3, 1, 4, 2, 5)
    points = tuple(ilp.MemoryPoint(
        terms=tuple((g, rng.uniform(0, 100, ks[g])) for g in rng.choice(5, 3, replace=False))
        + ((0, rng.uniform(0, 100, 3)),), constant_bytes=float(rng.uniform(0, 50)))
        for _ in range(7))
    problem = ilp.IlpProblem(node_costs=tuple(np.zeros(k) for k in ks), edges=(),
                             memory_points=points, memory_budget_bytes=1e9)
    extra = {0: rng.uniform(0, 10, 3), 1: np.array([4.0]), 4: rng.uniform(0, 10, 5)}
    held = ilp.with_extra_bytes(problem, extra)
    assert all(p.folded for p in held.memory_points)
    for choice in itertools.product(*(range(k) for k in ks)):
        add = sum(float(b[choice[g]]) for g, b in extra.items())
        want = ilp.point_rows(points).usage(choice) + add
        got = ilp.point_rows(held.memory_points).usage(choice)
        assert np.allclose(got, want, rtol=1e-12)
    for p in held.memory_points:
        assert all(b.min() == 0 and b.max() > 0 for _, b in p.terms)
        assert np.isclose(p.max_bytes, p.constant_bytes + sum(b.max() for _, b in p.terms))


def test_highs_writes_no_banner_to_stdout():
    """HiGHS's constructor prints a copyright banner on file descriptor 1 (once per process);
    autopar's solves leave stdout to the user. In fresh processes: the plain constructor
    prints it, autopar's does not."""
    import subprocess
    import sys

    def run(code):
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=120, check=True).stdout
    assert "HiGHS" in run("import highspy; highspy.Highs()")
    out = run("from autopar.intra_op.mip import _quiet_highs; _quiet_highs(); print('after')")
    assert "HiGHS" not in out and "Copyright" not in out and out.strip() == "after"


def test_polish_ties_takes_the_leaner_of_equally_cheap_strategies():
    """Issue 24 (ties): group 0's strategies 0 and 1 cost the same with group 1's choice, and
    strategy 1 holds fewer bytes: it is taken; strategy 2 holds fewest but costs more: never.
    A move that would break the memory budget is not made; the objective never grows."""
    edges = (ilp.IlpEdge(u=0, v=1, cost=np.array([[0.0, 1.0], [0.0, 1.0], [5.0, 5.0]])),)
    problem = IlpProblem(node_costs=(np.array([1.0, 1.0, 1.0]), np.array([0.0, 3.0])),
                         edges=edges)
    held = {0: np.array([400.0, 100.0, 50.0])}
    got = heuristics.polish_ties(problem, (0, 0), held)
    assert got == (1, 0) and ilp.evaluate(problem, got) == ilp.evaluate(problem, (0, 0))
    # strategy 1 needs more at a memory point than the budget allows: the plan stays
    point = MemoryPoint(terms=((0, np.array([10.0, 90.0, 0.0])),), constant_bytes=0.0)
    tight = IlpProblem(node_costs=problem.node_costs, edges=edges, memory_points=(point,),
                       memory_budget_bytes=50.0)
    assert heuristics.polish_ties(tight, (0, 0), held) == (0, 0)
    # a cheaper strategy is never traded for bytes (group 1's strategy 1 costs 4 more)
    assert heuristics.polish_ties(problem, (0, 0), {1: np.array([100.0, 1.0])}) == (0, 0)


def _knapsack(n: int, budget_fast: float) -> IlpProblem:
    """n groups of a fast strategy (cost 0, 10 bytes) and a lean one (cost 1 + g / 1000, no
    bytes), one memory point, a budget for `budget_fast` fast groups: the LP takes the cheapest
    lean groups whole and half of the next one."""
    return IlpProblem(
        node_costs=tuple(np.array([1000.0, 1001.0 + g / 1000]) for g in range(n)), edges=(),
        memory_points=(MemoryPoint(terms=tuple((g, np.array([10.0, 0.0])) for g in range(n)),
                                   constant_bytes=0.0),),
        memory_budget_bytes=10.0 * budget_fast)


def test_a_rounding_within_the_gap_of_the_lp_needs_no_mip(monkeypatch):
    """Where the LP solution, rounded and repaired to fit the memory rows, is within the MIP's
    relative gap of the LP bound, it is the answer (optimal within the gap): no MIP runs. With
    the exact gap of small models the same problem goes on to the MIP, and both answers are
    the brute-force optimum here."""
    problem = _knapsack(12, 7.5)      # 4.5 lean groups in the LP: 5 of them
    best = brute_force(problem).objective
    calls = _count_highs(monkeypatch)
    sol = solve_ilp(problem)                       # 12 binaries: the exact gap
    assert calls == [True, False] and sol.status is SolveStatus.OPTIMAL
    _assert_close(sol.objective, best)
    monkeypatch.setattr(mip, "EXACT_MAX_BINARIES", 0)     # the 0.1% gap of large models
    calls.clear()
    sol = solve_ilp(problem)
    assert calls == [True] and sol.status is SolveStatus.OPTIMAL
    _assert_close(sol.objective, best)
    assert peak_memory_bytes(problem, sol.choice) <= problem.memory_budget_bytes


@pytest.mark.parametrize("ipm", [True, False])
def test_memory_bound_problems_solve_alike_by_interior_point_or_simplex(monkeypatch, ipm):
    """The LP relaxation with memory rows by the interior-point method (with crossover, so
    the dive and the rounding start from a vertex) or by dual simplex: the same optimum on
    random memory-bound problems (brute force)."""
    monkeypatch.setattr(mip, "LP_IPM_WITH_MEMORY_ROWS", ipm)
    monkeypatch.setattr(mip, "LP_IPM_MIN_COLUMNS", 0)
    rng = np.random.default_rng(21)
    checked = 0
    while checked < 4:
        problem = _random_problem(rng, with_memory=True)
        best = brute_force(problem)
        if best.status is SolveStatus.OPTIMAL:
            _assert_close(solve_ilp(problem).objective, best.objective)
            checked += 1
    _assert_close(solve_ilp(_knapsack(12, 7.5)).objective,
                  brute_force(_knapsack(12, 7.5)).objective)
