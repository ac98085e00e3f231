"""Memory points of the intra-op ILP as numbers: `MemoryPoint` (bytes per device live at one
program point, per strategy of the groups it reads), their folded form, `PointRows`, which
prices a choice at every point at once, and `CopyTerm`, a resharded copy's buffer, whose bytes
depend on the strategies of two groups (the value's and a reader's). No `jax`, no solver:
`ilp`, `mip` and `layers` build on it.

A copy term is live at a point where one of its readers at or before the point and one at or
after it both need the copy (`CopyTerm.needs`): XLA makes one buffer per (value, layout) and
keeps it from the first reader that reads it to the last (`memory.copy_buffers`). A point
refers to it as (copy index, a, b): live iff some reader among `readers[:a]` and some among
`readers[b:]` needs it.

Example:
    >>> p = folded_point({0: np.array([4.0, 2.0])}, 10.0)
    >>> point_rows((p,)).usage([1])
    array([12.])
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryPoint:
    """Bytes per device live at one program point: `constant_bytes` plus, for each (group,
    bytes-vector) term, the bytes of the strategy that group picks."""
    terms: tuple[tuple[int, np.ndarray], ...]
    constant_bytes: float
    folded: bool = False     # one term per group, each with min 0 and max > 0 (see `folded_point`)
    max_bytes: float = 0.0   # when folded: the most the point can reach (its copies left out)
    copies: tuple[tuple[int, int, int], ...] = ()   # (copy index, a, b): see the module doc


@dataclass(frozen=True, slots=True, kw_only=True)
class CopyTerm:
    """A resharded copy of one value in one layout, `nbytes` per device: reader k (its ILP
    group `readers[k][0]`, in program order) needs it when its group picks a strategy that
    wants the layout (`readers[k][1]`, bool per strategy) and the value's group `source`
    picks one that does not already have it (`kept`, bool per strategy)."""
    source: int
    kept: np.ndarray
    readers: tuple[tuple[int, np.ndarray], ...]
    nbytes: float

    def needs(self, choice) -> np.ndarray:
        """Per reader, whether it needs the copy under `choice`."""
        if self.kept[int(choice[self.source])]:
            return np.zeros(len(self.readers), bool)
        return np.array([bool(w[int(choice[g])]) for g, w in self.readers])


def copy_usage(points: tuple[MemoryPoint, ...], copies: tuple[CopyTerm, ...],
               choice) -> np.ndarray:
    """Bytes per device the copies add at every point under `choice`."""
    out = np.zeros(len(points))
    if not copies:
        return out
    need = [None] * len(copies)
    for i, p in enumerate(points):
        for c, a, b in p.copies:
            if need[c] is None:
                need[c] = copies[c].needs(choice)
            if need[c][:a].any() and need[c][b:].any():
                out[i] += copies[c].nbytes
    return out


def point_usage(points: tuple[MemoryPoint, ...], copies: tuple[CopyTerm, ...],
                choice) -> np.ndarray:
    """Bytes per device at every point under `choice`, the copies' included."""
    return point_rows(points).usage(choice) + copy_usage(points, copies, choice)


def folded_point(terms: dict[int, np.ndarray], constant_bytes: float,
                 copies: tuple[tuple[int, int, int], ...] = ()) -> MemoryPoint:
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
                       max_bytes=const + top, copies=copies)


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


def points_with_extra(points: tuple[MemoryPoint, ...], ks, extra: dict[int, np.ndarray],
                      ) -> tuple[MemoryPoint, ...]:
    """`points` (of groups with `ks` strategies) with `extra[g][i]` bytes added to each when
    group g picks strategy i (memory live at every point), folded; their copies kept.
    Every term of every point is summed and folded at once (flat numpy arrays, as `PointRows`
    holds them): a whole stage has thousands of points, each with hundreds of held groups."""
    folded = [_fold_point(p, ks) for p in points]
    zeros = {g: np.zeros(ks[g]) for g in extra}
    tp, tg, chunks = [], [], []
    for i, (_, terms) in enumerate(folded):
        for g, b in terms.items():
            tp.append(i), tg.append(g), chunks.append(b)
        for g in extra:
            if g not in terms:
                tp.append(i), tg.append(g), chunks.append(zeros[g])
    if not chunks:
        return tuple(folded_point({}, const, p.copies) for (const, _), p in zip(folded, points))
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
    return tuple(MemoryPoint(terms=tuple(terms[i]), constant_bytes=float(const[i]), folded=True,
                             max_bytes=float(top[i]), copies=points[i].copies)
                 for i in range(n))
