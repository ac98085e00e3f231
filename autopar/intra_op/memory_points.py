"""Memory points of the intra-op ILP as numbers: `MemoryPoint` (bytes per device live at one
program point, per strategy of the groups it reads), their folded form, and `PointRows`, which
prices a choice at every point at once. No `jax`, no solver: `ilp` and `layers` build on it.

Example:
    >>> p = folded_point({0: np.array([4.0, 2.0])}, 10.0)
    >>> point_rows((p,)).usage([1])
    array([12.])
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryPoint:
    """Bytes per device live at one program point: `constant_bytes` plus, for each (group,
    bytes-vector) term, the bytes of the strategy that group picks."""
    terms: tuple[tuple[int, np.ndarray], ...]
    constant_bytes: float
    folded: bool = False     # one term per group, each with min 0 and max > 0 (see `folded_point`)
    max_bytes: float = 0.0   # when folded: the most the point can reach


def folded_point(terms: dict[int, np.ndarray], constant_bytes: float) -> MemoryPoint:
    """A point already in presolve's form (per-group minimums moved into the constant, constant
    terms dropped), so every later solve reads it without folding it again."""
    const, out, top = float(constant_bytes), [], 0.0
    for g, b in terms.items():
        lo, hi = float(b.min()), float(b.max())
        const += lo
        if hi > lo:
            out.append((g, b - lo))
            top += hi - lo
    return MemoryPoint(terms=tuple(out), constant_bytes=const, folded=True,
                       max_bytes=const + top)


@dataclass(frozen=True, slots=True)
class PointRows:
    """Memory points as flat arrays, to price a choice at every point at once: term n (of
    point `term_point[n]`, group `term_group[n]`) has its bytes per strategy at
    `vals[first[n]:first[n] + k]`."""
    const: np.ndarray
    term_point: np.ndarray
    term_group: np.ndarray
    first: np.ndarray
    vals: np.ndarray

    def usage(self, choice) -> np.ndarray:
        """Bytes per device at every point under `choice` (one strategy per group)."""
        picked = self.vals[self.first + np.asarray(choice, np.int64)[self.term_group]]
        return self.const + np.bincount(self.term_point, weights=picked,
                                        minlength=self.const.size)


    def mixed_usage(self, weights: dict[int, np.ndarray]) -> np.ndarray:
        """Bytes per device at every point when group g takes strategy i with weight
        `weights[g][i]` (an LP relaxation's solution; a one-hot vector is a choice)."""
        term = np.repeat(np.arange(self.first.size), np.diff(np.append(self.first,
                                                                      self.vals.size)))
        start = np.zeros(int(self.term_group.max(initial=-1)) + 1, np.int64)
        flat, n = [], 0
        for g in np.unique(self.term_group).tolist():
            start[g], n = n, n + len(weights[g])
            flat.append(np.asarray(weights[g], float))
        flat = np.concatenate(flat) if flat else np.zeros(0)
        w = flat[start[self.term_group[term]] + np.arange(self.vals.size) - self.first[term]]
        return self.const + np.bincount(self.term_point[term], weights=self.vals * w,
                                        minlength=self.const.size)


_POINT_ROWS: dict[int, tuple[tuple, PointRows]] = {}   # id(points) -> (points, rows)


def point_rows(points: tuple[MemoryPoint, ...]) -> PointRows:
    """`points` as `PointRows` (the last few tuples' are cached: a stage's problem is solved
    at several budgets with the same points)."""
    hit = _POINT_ROWS.get(id(points))
    if hit is not None and hit[0] is points:
        return hit[1]
    terms = [(i, g, b) for i, p in enumerate(points) for g, b in p.terms]
    lens = np.fromiter((len(b) for _, _, b in terms), np.int64, len(terms))
    rows = PointRows(
        const=np.array([p.constant_bytes for p in points], float),
        term_point=np.fromiter((i for i, _, _ in terms), np.int64, len(terms)),
        term_group=np.fromiter((g for _, g, _ in terms), np.int64, len(terms)),
        first=np.cumsum(lens) - lens,
        vals=np.concatenate([np.asarray(b, float) for _, _, b in terms]) if terms
        else np.zeros(0))
    if len(_POINT_ROWS) >= 8:
        _POINT_ROWS.pop(next(iter(_POINT_ROWS)))
    _POINT_ROWS[id(points)] = (points, rows)
    return rows


def _fold_point(p: MemoryPoint, ks) -> tuple[float, dict[int, np.ndarray]]:
    """Sum repeated groups; fold single-strategy groups and per-term minimums into the constant."""
    if p.folded:
        return p.constant_bytes, dict(p.terms)
    merged: dict[int, np.ndarray] = {}
    for g, b in p.terms:
        merged[g] = merged[g] + np.asarray(b, float) if g in merged else np.array(b, float)
    const, terms = float(p.constant_bytes), {}
    for g, b in merged.items():
        const += float(b.min())
        if ks[g] > 1 and b.max() > b.min():
            terms[g] = b - b.min()
    return const, terms


def with_extra_bytes(problem, extra: dict[int, np.ndarray]):
    """The problem (an `ilp.IlpProblem`) with `extra[g][i]` bytes added to every memory point
    when group g picks
    strategy i (memory that is live at every point, e.g. optimizer state held elsewhere).
    Every term of every point is summed and folded at once (flat numpy arrays, as `PointRows`
    holds them): a whole stage has thousands of points, each with hundreds of held groups."""
    ks = problem.num_strategies
    folded = [_fold_point(p, ks) for p in problem.memory_points]
    if not folded:
        return problem
    zeros = {g: np.zeros(ks[g]) for g in extra}
    tp, tg, chunks = [], [], []
    for i, (_, terms) in enumerate(folded):
        for g, b in terms.items():
            tp.append(i), tg.append(g), chunks.append(b)
        for g in extra:
            if g not in terms:
                tp.append(i), tg.append(g), chunks.append(zeros[g])
    if not chunks:
        return replace(problem, memory_points=tuple(
            folded_point({}, const) for const, _ in folded))
    tp, tg = np.array(tp, np.int64), np.array(tg, np.int64)
    lens = np.fromiter((len(b) for b in chunks), np.int64, len(chunks))
    first = np.cumsum(lens) - lens
    off = np.concatenate([[0], np.cumsum(ks)]).astype(np.int64)
    table = np.zeros(int(off[-1]))
    for g, b in extra.items():
        table[off[g]:off[g + 1]] += np.asarray(b, float)
    vals = np.concatenate([np.asarray(b, float) for b in chunks])
    vals += table[np.repeat(off[tg] - first, lens) + np.arange(vals.size)]
    lo, hi = np.minimum.reduceat(vals, first), np.maximum.reduceat(vals, first)
    vals -= np.repeat(lo, lens)
    n = len(folded)
    const = np.array([c for c, _ in folded]) + np.bincount(tp, weights=lo, minlength=n)
    top = const + np.bincount(tp, weights=np.where(hi > lo, hi - lo, 0.0), minlength=n)
    terms: list[list] = [[] for _ in range(n)]
    for t in np.flatnonzero(hi > lo).tolist():
        terms[tp[t]].append((int(tg[t]), vals[first[t]:first[t] + lens[t]]))
    return replace(problem, memory_points=tuple(
        MemoryPoint(terms=tuple(terms[i]), constant_bytes=float(const[i]), folded=True,
                    max_bytes=float(top[i])) for i in range(n)))
