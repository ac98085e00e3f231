"""`memory_points.fold_terms`: flat terms summed per (point, group) and folded, as
`folded_point` folds one point's merged terms; what `with_extra_bytes` and `layers.tied_problem`
build their points with."""
import itertools
from dataclasses import replace

import numpy as np
import pytest

from autopar.intra_op import memory_points as mp
from autopar.intra_op.ilp import IlpProblem
from autopar.intra_op.layers import Tying, tied_problem

KS = (3, 1, 4, 2, 3)


def _terms(rng, num_points):
    """Random flat terms with repeated (point, group) pairs and single-strategy groups."""
    tp, tg, vecs = [], [], []
    for i in range(num_points):
        for g in rng.choice(len(KS), 4, replace=True):       # repeats on purpose
            tp.append(i), tg.append(int(g))
            vecs.append(rng.integers(0, 50, KS[g]).astype(float))
    return np.array(tp), np.array(tg), vecs


def _reference(const, tp, tg, vecs):
    """Per point: the merged terms folded by `folded_point` (the one-point rule)."""
    out = []
    for i, c in enumerate(const):
        merged: dict[int, np.ndarray] = {}
        for p, g, v in zip(tp, tg, vecs):
            if p == i:
                merged[g] = merged[g] + v if g in merged else v.copy()
        out.append(mp.folded_point(merged, c))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_fold_terms_folds_each_point_as_folded_point(seed):
    rng = np.random.default_rng(seed)
    const = rng.uniform(0, 30, 5)
    tp, tg, vecs = _terms(rng, 5)
    got = mp.fold_terms(const, tp, tg, [v.size for v in vecs], np.concatenate(vecs))
    want = _reference(const, tp, tg, vecs)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.folded and b.folded
        assert a.constant_bytes == pytest.approx(b.constant_bytes, rel=1e-12)
        assert a.max_bytes == pytest.approx(b.max_bytes, rel=1e-12)
        ta, tb = dict(a.terms), dict(b.terms)
        assert ta.keys() == tb.keys()
        for g in ta:
            np.testing.assert_allclose(ta[g], tb[g], rtol=1e-12)
            assert ta[g].min() == 0 and ta[g].max() > 0 and KS[g] > 1
    # the rows cached for the new points price every choice as rows built from scratch
    cached = mp.point_rows(got)
    mp._POINT_ROWS.clear()
    fresh = mp.point_rows(got)
    assert fresh is not cached
    for choice in itertools.product(*(range(k) for k in KS)):
        np.testing.assert_allclose(cached.usage(choice), fresh.usage(choice), rtol=1e-12)


def test_fold_terms_without_terms_keeps_the_constants():
    pts = mp.fold_terms([1.0, 2.5], [], [], [], np.zeros(0))
    assert [(p.terms, p.constant_bytes, p.max_bytes) for p in pts] == [((), 1.0, 1.0),
                                                                       ((), 2.5, 2.5)]


def test_fold_terms_rejects_one_group_with_two_lengths():
    with pytest.raises(ValueError, match="group 1 at point 0 have 3 and 2 strategies"):
        mp.fold_terms([0.0], [0, 0], [1, 1], [2, 3], np.arange(5.0))


def test_tied_points_sum_the_members_terms():
    """`tied_problem` maps each point's terms to the tied variables (members summed) and
    folds them: the same bytes at every point for every choice of the tied problem."""
    rng = np.random.default_rng(5)
    ks = (3, 3, 2, 2, 4)
    rep = np.array([0, 0, 1, 1, 2])            # groups 0, 1 tied; 2, 3 tied
    points = tuple(mp.MemoryPoint(
        terms=tuple((int(g), rng.integers(0, 40, ks[g]).astype(float))
                    for g in rng.choice(5, 3, replace=False)),
        constant_bytes=float(rng.uniform(0, 9))) for _ in range(6))
    problem = IlpProblem(node_costs=tuple(np.zeros(k) for k in ks), edges=(),
                         memory_points=points, memory_budget_bytes=1e9)
    tied = tied_problem(problem, Tying(family="block", num_layers=2, period=2, rep=rep, num_tied=2))
    for choice in itertools.product(range(3), range(2), range(4)):
        full = [choice[rep[g]] for g in range(5)]
        np.testing.assert_allclose(mp.point_rows(tied.memory_points).usage(choice),
                                   mp.point_rows(points).usage(full), rtol=1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_summed_leanest_takes_each_groups_fewest_bytes_over_the_points(seed):
    """`PointRows.summed_leanest`: per group, the strategy with the fewest bytes summed over
    the points (never one past the group's strategy count; 0 for a group in no point), so its
    peak is at least the least peak of every choice (brute force)."""
    rng = np.random.default_rng(seed)
    ks = (3, 1, 4, 2, 3, 2)                    # group 5 is in no point
    points = tuple(mp.MemoryPoint(
        terms=tuple((int(g), rng.integers(0, 40, ks[g]).astype(float))
                    for g in rng.choice(5, 3, replace=False)),
        constant_bytes=float(rng.uniform(0, 9))) for _ in range(7))
    rows = mp.point_rows(points)
    lean = rows.summed_leanest(len(ks))
    totals = [sum((b for p in points for g2, b in p.terms if g2 == g), np.zeros(k))
              for g, k in enumerate(ks)]
    assert list(lean) == [int(np.argmin(t)) for t in totals]
    assert lean[5] == 0 and all(0 <= c < k for c, k in zip(lean, ks))
    least = min(rows.usage(c).max() for c in itertools.product(*map(range, ks)))
    assert rows.usage(lean).max() >= least


@pytest.mark.parametrize("seed", range(4))
def test_lean_least_is_the_least_of_the_points_with_the_extra_bytes(seed):
    """`lean_least` gives the least peak of `with_extra_bytes`' points (brute force)
    without building them, where each group is leanest in one strategy at every point and in
    its extra bytes (a tensor split ever finer); None where a group's leanest strategy
    differs between points (then only a solve knows)."""
    rng = np.random.default_rng(40 + seed)
    ks = (3, 2, 4, 2, 3)
    split = [rng.permutation(np.linspace(1.0, 1.0 / k, k)) * rng.uniform(1, 9) for k in ks]

    def least(problem):
        rows = mp.point_rows(problem.memory_points)
        return min(rows.usage(c).max() for c in itertools.product(*map(range, ks)))

    points = tuple(mp.folded_point({int(g): rng.integers(1, 4) * split[g]
                                    for g in rng.choice(5, 3, replace=False)},
                                   float(rng.uniform(0, 5))) for _ in range(9))
    extra = {1: 2.0 * split[1], 3: 0.5 * split[3]}      # e.g. optimizer state, held
    problem = IlpProblem(node_costs=tuple(np.zeros(k) for k in ks), edges=(),
                         memory_points=points, memory_budget_bytes=1e9)
    got, lean = mp.lean_least(mp.point_rows(points), len(ks), extra)
    held_points = mp.with_extra_bytes(problem, extra)
    assert got == pytest.approx(least(held_points), rel=1e-12)
    assert mp.point_rows(held_points.memory_points).usage(lean).max() == pytest.approx(got)
    mixed = tuple(mp.folded_point({int(g): rng.uniform(0, 9, ks[g])
                                   for g in rng.choice(5, 3, replace=False)}, 1.0)
                  for _ in range(9))
    loose = mp.lean_least(mp.point_rows(mixed), len(ks), extra)
    held = mp.with_extra_bytes(replace(problem, memory_points=mixed), extra)
    assert loose is None or loose[0] == pytest.approx(least(held), rel=1e-12)
