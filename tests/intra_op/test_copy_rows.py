"""Resharded copies in the ILP's memory rows (`memory_points.CopyTerm`, `mip._add_copies`,
`ilp.solve_ilp`'s lazy copies): on random small problems every solve equals brute force, and
the MIP's columns of an integral plan count exactly the copies the plan makes."""
from __future__ import annotations

import numpy as np
import pytest

from autopar.intra_op import ilp
from autopar.intra_op.heuristics import dominators
from autopar.intra_op.ilp import CopyTerm, IlpEdge, IlpProblem, MemoryPoint, SolveStatus
from autopar.intra_op.layers import Tying, tied_problem
from autopar.intra_op.memory_points import copy_usage, point_usage
from autopar.intra_op.mip import build_mip, columns_of


def _problem(seed: int, num_points: int = 3) -> IlpProblem:
    """Groups of 2-3 strategies, edges, memory points along a program of 10 positions, and
    copies whose readers sit at sorted positions; the budget between the least and the
    fastest plan's peak (with copies)."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(4, 7))
    ks = rng.integers(2, 4, size=n)
    edges = []
    for _ in range(n + 2):
        u, v = (int(g) for g in rng.choice(n, 2, replace=False))
        edges.append(IlpEdge(u=u, v=v, cost=rng.random((ks[u], ks[v]))))
    copies = []
    for _ in range(int(rng.integers(2, 6))):
        src = int(rng.integers(n))
        m = int(rng.integers(1, 4))
        readers = tuple((int(g), rng.random(ks[g]) < 0.5)
                        for g in rng.integers(n, size=m))
        kept = rng.random(ks[src]) < 0.4
        at = tuple(int(x) for x in np.sort(rng.choice(10, m, replace=False)))
        copies.append(CopyTerm(source=src, kept=kept, readers=readers, positions=at,
                               nbytes=float(rng.integers(100, 800))))
    points = []
    for at in np.sort(rng.choice(10, num_points, replace=False)):
        groups = rng.choice(n, int(rng.integers(1, n)), replace=False)
        points.append(MemoryPoint(
            terms=tuple((int(g), rng.integers(0, 600, ks[g]).astype(float)) for g in groups),
            constant_bytes=float(rng.integers(0, 300)), at=int(at)))
    problem = IlpProblem(node_costs=tuple(rng.random(k) for k in ks), edges=tuple(edges),
                         memory_points=tuple(points), copies=tuple(copies))
    grid = np.indices(ks).reshape(n, -1).T
    peaks = np.array([ilp.peak_memory_bytes(problem, c) for c in grid])
    budget = peaks.min() + rng.uniform(0.0, 0.8) * (peaks.max() - peaks.min())
    return IlpProblem(node_costs=problem.node_costs, edges=problem.edges,
                      memory_points=problem.memory_points, copies=problem.copies,
                      memory_budget_bytes=float(budget))


def _copies_off(problem: IlpProblem) -> IlpProblem:
    return IlpProblem(node_costs=problem.node_costs, edges=problem.edges,
                      memory_points=problem.memory_points,
                      memory_budget_bytes=problem.memory_budget_bytes)


@pytest.mark.parametrize("seed", range(40))
def test_solves_with_copies_equal_brute_force(seed):
    """The lazy loop (`solve_ilp`) and the MIP with every copy at once (`_solve_once`) find
    the optimum among the plans that fit with their copies, as brute force does."""
    problem = _problem(seed)
    best = ilp.brute_force(problem)
    for sol in (ilp.solve_ilp(problem), ilp._solve_once(problem)):
        assert sol.status is best.status
        if best.status is SolveStatus.OPTIMAL:
            assert sol.objective == pytest.approx(best.objective, rel=1e-6, abs=1e-9)
            assert ilp.peak_memory_bytes(problem, sol.choice) <= problem.memory_budget_bytes


def test_copies_change_the_plan_somewhere():
    """The copies bind: on some of the random problems the plan without them breaks the budget
    once its copies are counted (so the tests above check more than the plain ILP)."""
    broke = 0
    for seed in range(40):
        problem = _problem(seed)
        plain = ilp.solve_ilp(_copies_off(problem))
        if plain.status is SolveStatus.OPTIMAL:
            broke += ilp.peak_memory_bytes(problem, plain.choice) > problem.memory_budget_bytes
    assert broke >= 5


@pytest.mark.parametrize("seed", range(10))
def test_integral_columns_count_exactly_the_copies_a_plan_makes(seed):
    """At an integral plan the copy columns `columns_of` sets satisfy every row, and each
    memory row's activity is the point's bytes with the plan's copies (`point_usage`)."""
    problem = _problem(seed)
    red = ilp._presolve(problem)
    mip = build_mip(red)
    rng = np.random.default_rng(seed)
    ks = problem.num_strategies
    for _ in range(20):
        choice = np.where(red.choice >= 0, red.choice,
                          [int(rng.integers(k)) for k in ks])
        x = columns_of(mip, choice)
        act = np.bincount(mip.rows, weights=mip.vals * x[mip.cols], minlength=mip.row_lower.size)
        assert (act >= mip.row_lower - 1e-9).all()
        usage = point_usage(problem.memory_points, problem.copies, choice)
        fits = usage[[i for i, p in enumerate(problem.memory_points)]] <= \
            problem.memory_budget_bytes + 1e-6
        assert ((act <= mip.row_upper + 1e-9).all()) == bool(fits.all())


def test_dominance_keeps_the_strategy_that_avoids_a_copy():
    """Two strategies of a reader that cost the same, one wanting a copy: without the copy
    they would be identical (the first kept); with it, the other dominates it, and the plan
    is brute force's."""
    copy = CopyTerm(source=0, kept=np.array([False, True]),
                    readers=((1, np.array([True, False])),), positions=(3,), nbytes=500.0)
    problem = IlpProblem(
        node_costs=(np.array([0.0, 1.0]), np.array([1.0, 1.0])), edges=(),
        memory_points=(MemoryPoint(terms=((0, np.array([100.0, 0.0])),), constant_bytes=0.0,
                                   at=3),),
        copies=(copy,), memory_budget_bytes=450.0)
    assert list(dominators(ilp._presolve(problem))[1]) == [1, 1]
    sol = ilp._solve_once(problem)
    assert sol.choice == ilp.brute_force(problem).choice == (0, 1)
    assert ilp.peak_memory_bytes(problem, (0, 0)) == 600.0


def test_tied_problem_maps_the_copies():
    """Tying maps a copy's value and readers onto the tied variables; the tied plan's peak
    with copies is the untied plan's for the same strategies."""
    problem = _problem(3)
    n = len(problem.num_strategies)
    rep = np.arange(n)
    tied = tied_problem(problem, Tying(family="x", num_layers=1, period=1, rep=rep, num_tied=0))
    for c, t in zip(problem.copies, tied.copies):
        assert t.source == c.source and [g for g, _ in t.readers] == [g for g, _ in c.readers]
    choice = tuple(0 for _ in range(n))
    assert ilp.peak_memory_bytes(tied, choice) == pytest.approx(
        ilp.peak_memory_bytes(problem, choice))


@pytest.mark.parametrize("seed", range(10))
def test_copy_usage_is_the_copies_live_at_each_point(seed):
    """`copy_usage` (flat arrays, a sweep over positions) adds at each point the bytes of the
    copies one of whose readers at or before it and one at or after it need them."""
    problem = _problem(seed, num_points=6)
    rng = np.random.default_rng(seed)
    for _ in range(10):
        choice = [int(rng.integers(k)) for k in problem.num_strategies]
        want = [sum(c.nbytes for c in problem.copies
                    if c.positions[0] <= p.at <= c.positions[-1]
                    and any(c.needs(choice)[k] for k, q in enumerate(c.positions) if q <= p.at)
                    and any(c.needs(choice)[k] for k, q in enumerate(c.positions) if q >= p.at))
                for p in problem.memory_points]
        np.testing.assert_allclose(copy_usage(problem.memory_points, problem.copies, choice),
                                   want)
