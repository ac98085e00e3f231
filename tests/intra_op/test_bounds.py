"""LP lower bounds of an intra-op ILP (intra_op/bounds.py): with the memory rows joining as
the LP breaks them, the bound is the LP with every row, and below every plan that fits."""
import math

import numpy as np
import pytest

from autopar.intra_op import ilp
from autopar.intra_op.bounds import lp_bound
from autopar.intra_op.ilp import IlpEdge, IlpProblem, MemoryPoint, SolveStatus


def _every_row_lp(problem: IlpProblem) -> float:
    """The LP relaxation with all memory rows at once (what `lp_bound` must equal)."""
    red = ilp._presolve(problem)
    if not red.var_groups:
        return -math.inf if red.infeasible else ilp.evaluate(problem, red.choice)
    model = ilp.build_mip(red)
    x = ilp._relaxed(model, 60.0)
    return -math.inf if x is None else float((model.cost @ x + model.offset) * model.scale)


def _problem(seed: int, num_points: int = 90) -> IlpProblem:
    """Memory-bound: many points (more than one lazy batch), a budget between the least and
    the largest peak of the cheapest-per-group choice."""
    rng = np.random.default_rng(seed)
    ks = rng.integers(2, 4, size=7)
    node_costs = tuple(rng.random(k) * (1 + np.arange(k)[::-1]) for k in ks)
    edges = tuple(IlpEdge(u=g, v=g + 1, cost=rng.random((ks[g], ks[g + 1])))
                  for g in range(len(ks) - 1))
    points = tuple(MemoryPoint(terms=tuple(
        (int(g), rng.integers(0, 1000, size=ks[g]).astype(float))
        for g in rng.choice(len(ks), int(rng.integers(2, len(ks) + 1)), replace=False)),
        constant_bytes=float(rng.integers(0, 300))) for _ in range(num_points))
    free = IlpProblem(node_costs=node_costs, edges=edges, memory_points=points)
    least = ilp.min_peak_memory(free)[0]
    cheap = ilp.peak_memory_bytes(free, tuple(int(np.argmin(c)) for c in node_costs))
    return IlpProblem(node_costs=node_costs, edges=edges, memory_points=points,
                      memory_budget_bytes=float(least + rng.uniform(0.0, 1.0) * (cheap - least)))


@pytest.mark.parametrize("batch", [2, 32])
@pytest.mark.parametrize("seed", range(8))
def test_lazy_rows_give_the_lp_with_every_row_and_bound_the_plans_that_fit(
        seed, batch, monkeypatch):
    monkeypatch.setattr(ilp, "LAZY_BATCH", batch)       # 2: many rounds
    problem = _problem(seed)
    got = lp_bound(problem, memory=True)
    assert got == pytest.approx(_every_row_lp(problem), rel=1e-7, abs=1e-9)
    assert got >= lp_bound(problem) - 1e-9          # the rows only raise it
    best = ilp.brute_force(problem)
    if best.status == SolveStatus.OPTIMAL:
        assert got <= best.objective + 1e-9
    if got == -math.inf:                            # no fractional plan fits: no plan does
        assert best.status == SolveStatus.INFEASIBLE


def test_a_budget_below_a_points_constant_bytes_is_minus_infinity():
    """No fractional plan fits a budget below what a point holds whatever the plan."""
    problem = _problem(0)
    floor = max(p.constant_bytes for p in problem.memory_points)
    tight = IlpProblem(node_costs=problem.node_costs, edges=problem.edges,
                       memory_points=problem.memory_points, memory_budget_bytes=floor - 1.0)
    assert lp_bound(tight, memory=True) == -math.inf
    assert lp_bound(tight) > -math.inf                  # without the rows: a bound


@pytest.mark.parametrize("seed", range(8))
def test_the_bound_with_rows_is_at_least_the_free_one(seed):
    """`solve.latency_bound` takes the bound with rows alone where a fractional plan fits its
    budget: it starts from the LP without rows, and rows only raise the LP's value."""
    problem = _problem(seed)
    with_rows, free = lp_bound(problem, memory=True), lp_bound(problem)
    assert with_rows > -math.inf
    assert with_rows >= free - 1e-9 * abs(free)
