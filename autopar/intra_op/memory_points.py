"""Memory points of the intra-op ILP as numbers: `MemoryPoint` (bytes per device live at one
program point, per strategy of the groups it reads), their folded form, `PointRows`, which
prices a choice at every point at once, and `CopyTerm`, a resharded copy's buffer, whose bytes
depend on the strategies of two groups (the value's and a reader's). No `jax`, no solver:
`ilp`, `mip` and `layers` build on it.

A copy term is live at a point where one of its readers at or before the point's program
position (`MemoryPoint.at`) and one at or after it both need the copy (`CopyTerm.needs`): XLA
makes one buffer per (value, layout) and keeps it from the first reader that reads it to the
last (`memory.copy_buffers`).

Example:
    >>> p = folded_point({0: np.array([4.0, 2.0])}, 10.0)
    >>> point_rows((p,)).usage([1])
    array([12.])
"""
from __future__ import annotations

import bisect
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
    at: int = -1             # its program position, for the copies (-1: none live there)


@dataclass(frozen=True, slots=True, kw_only=True)
class CopyTerm:
    """A resharded copy of one value in one layout, `nbytes` per device: reader k (its ILP
    group `readers[k][0]`, at program position `positions[k]`, ascending) needs it when its
    group picks a strategy that wants the layout (`readers[k][1]`, bool per strategy) and the
    value's group `source` picks one that does not already have it (`kept`, bool per
    strategy)."""
    source: int
    kept: np.ndarray
    readers: tuple[tuple[int, np.ndarray], ...]
    positions: tuple[int, ...]
    nbytes: float

    def needs(self, choice) -> np.ndarray:
        """Per reader, whether it needs the copy under `choice`."""
        if self.kept[int(choice[self.source])]:
            return np.zeros(len(self.readers), bool)
        return np.array([bool(w[int(choice[g])]) for g, w in self.readers])

    def refs(self, at: int) -> tuple[int, int] | None:
        """(a, b) for a point at position `at` inside the readers' span: the copy is live
        there iff some reader among `readers[:a]` and some among `readers[b:]` need it."""
        if at < 0 or not self.positions[0] <= at <= self.positions[-1]:
            return None
        return bisect.bisect_right(self.positions, at), bisect.bisect_left(self.positions, at)


def _spanned(points: tuple[MemoryPoint, ...], spans) -> np.ndarray:
    """Per point, the sum of w over the (first, last, w) `spans` whose [first, last] holds
    its position."""
    at = np.array([p.at for p in points], np.int64)
    out = np.zeros(len(points))
    if not len(spans) or not at.size:
        return out
    lo, hi, w = (np.asarray(x) for x in zip(*spans))
    order = np.argsort(at, kind="stable")
    sat = at[order]
    diff = np.zeros(sat.size + 1)
    np.add.at(diff, np.searchsorted(sat, lo, "left"), w)
    np.add.at(diff, np.searchsorted(sat, hi, "right"), -w)
    out[order] = np.cumsum(diff)[:-1]
    return np.where(at >= 0, out, 0.0)


_COPY_ARRAYS: dict[int, tuple[tuple, tuple]] = {}   # id(copies) -> (copies, arrays)


def _copy_arrays(copies: tuple[CopyTerm, ...]) -> tuple:
    """The copies' readers as flat arrays (cached for the last few tuples): per reader, its
    copy, group, position, and where its `wants` and its copy's `kept` start in flat arrays."""
    hit = _COPY_ARRAYS.get(id(copies))
    if hit is not None and hit[0] is copies:
        return hit[1]
    ks = np.array([c.kept.size for c in copies], np.int64)
    kept = np.concatenate([c.kept for c in copies]).astype(bool)
    koff = np.cumsum(ks) - ks
    rc = np.array([i for i, c in enumerate(copies) for _ in c.readers], np.int64)
    rg = np.array([g for c in copies for g, _ in c.readers], np.int64)
    wants = [w for c in copies for _, w in c.readers]
    ws = np.array([w.size for w in wants], np.int64)
    arrays = (np.array([c.source for c in copies], np.int64), kept, koff, rc, rg,
              np.concatenate(wants).astype(bool), np.cumsum(ws) - ws,
              np.array([p for c in copies for p in c.positions], float),
              np.cumsum([0] + [len(c.readers) for c in copies])[:-1],
              np.array([c.nbytes for c in copies]))
    if len(_COPY_ARRAYS) >= 8:
        _COPY_ARRAYS.pop(next(iter(_COPY_ARRAYS)))
    _COPY_ARRAYS[id(copies)] = (copies, arrays)
    return arrays


def copy_usage(points: tuple[MemoryPoint, ...], copies: tuple[CopyTerm, ...],
               choice) -> np.ndarray:
    """Bytes per device the copies add at every point under `choice`."""
    if not copies:
        return np.zeros(len(points))
    src, kept, koff, rc, rg, wants, woff, pos, first, nbytes = _copy_arrays(copies)
    choice = np.asarray(choice, np.int64)
    need = ~kept[koff[rc] + choice[src[rc]]] & wants[woff + choice[rg]]
    lo = np.minimum.reduceat(np.where(need, pos, np.inf), first)
    hi = np.maximum.reduceat(np.where(need, pos, -np.inf), first)
    made = np.isfinite(lo)
    return _spanned(points, list(zip(lo[made].astype(np.int64), hi[made].astype(np.int64),
                                     nbytes[made])))


def copy_bound(points: tuple[MemoryPoint, ...], copies: tuple[CopyTerm, ...]) -> np.ndarray:
    """The most bytes per device the copies can add at every point."""
    return _spanned(points, [(c.positions[0], c.positions[-1], c.nbytes) for c in copies])


def point_usage(points: tuple[MemoryPoint, ...], copies: tuple[CopyTerm, ...],
                choice) -> np.ndarray:
    """Bytes per device at every point under `choice`, the copies' included."""
    return point_rows(points).usage(choice) + copy_usage(points, copies, choice)


def folded_point(terms: dict[int, np.ndarray], constant_bytes: float, at: int = -1,
                 ) -> MemoryPoint:
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
                       max_bytes=const + top, at=at)


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
    group g picks strategy i (memory live at every point), folded; their positions kept.
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
        return tuple(folded_point({}, const, p.at) for (const, _), p in zip(folded, points))
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
                             max_bytes=float(top[i]), at=points[i].at)
                 for i in range(n))
