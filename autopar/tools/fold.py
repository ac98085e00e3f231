"""Folding for the concise dump (`autopar.dump`): repeated layers, optimizer state beside
its parameter, results that keep their input's sharding.

A layer index is a number in a name: `block_3`, `h/0`, `blocks.3`, `['layers'][0]`. Names
that differ only in such numbers (and agree in everything else shown) fold into one row:

    >>> fold_names(["params['block_0']['fc']", "params['block_1']['fc']"])
    "params['block_{0..1}']['fc']"
"""
from __future__ import annotations

import re
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass

# `word_3`, `/3/` (or a trailing `/3`), `.3.` (or a trailing `.3`), `['name'][3]`,
# `name[3]`
_LAYER = re.compile(r"(?<=[A-Za-z0-9]_)(\d+)(?![A-Za-z0-9_])|(?<=/)(\d+)(?=/|$|\))"
                    r"|(?<=[A-Za-z_]\.)(\d+)(?=\.|$|\[)|(?<='\]\[)(\d+)(?=\])|(?<=[A-Za-z_]\[)(\d+)(?=\])")
_SLOT = "\x00"


def layer_key(name: str) -> tuple[str, tuple[int, ...]]:
    """`name` with its layer indices replaced by a placeholder, and those indices."""
    found: list[int] = []

    def sub(m: re.Match) -> str:
        found.append(int(m.group(0)))
        return _SLOT
    return _LAYER.sub(sub, name), tuple(found)


def _index_set(values: Sequence[int]) -> str:
    v = sorted(set(values))
    if len(v) == 1:
        return str(v[0])
    if v == list(range(v[0], v[-1] + 1)):
        return f"{{{v[0]}..{v[-1]}}}"
    return "{" + ",".join(map(str, v[:6])) + (",..." if len(v) > 6 else "") + "}"


def fold_names(names: Sequence[str]) -> str:
    """One name for names of the same `layer_key` pattern: each varying index as a set."""
    pattern, first = layer_key(names[0])
    columns = list(zip(*(layer_key(n)[1] for n in names))) if first else []
    parts = pattern.split(_SLOT)
    out = [parts[0]]
    for col, rest in zip(columns, parts[1:]):
        out += [_index_set(col), rest]
    return "".join(out)


@dataclass(frozen=True, slots=True)
class Group:
    """Items that fold into one row: their shared name and how many there are."""
    name: str
    items: tuple
    @property
    def count(self) -> int:
        return len(self.items)


def fold(items: Iterable, name: Callable[[object], str],
         same: Callable[[object], Hashable]) -> list[Group]:
    """Items grouped by the layer pattern of `name(item)` and by `same(item)` (what a row
    shows besides the name), in order of first appearance."""
    groups: dict[tuple, list] = {}
    for it in items:
        groups.setdefault((layer_key(name(it))[0], same(it)), []).append(it)
    return [Group(fold_names([name(i) for i in g]), tuple(g)) for g in groups.values()]


# ----------------------------------------------------------------- optimizer state pairing
_SEGMENT = re.compile(r"\.|\[")


def pair_optimizer_state(params: Sequence, opt_states: Sequence) -> tuple[dict, list]:
    """{param index: [(slot, opt leaf), ...]} for optimizer-state leaves whose path ends with
    a parameter's path below its root (`state.opt_state[0].mu['params']['w']` mirrors
    `state.params['params']['w']`; `optimizer.opt_state[0].mu.linear.kernel` mirrors
    `model.linear.kernel`), the longest match winning; and the leaves that mirror none."""
    by_suffix: dict[str, int | None] = {}      # None: the suffix of several parameters
    for i, p in enumerate(params):
        for m in _SEGMENT.finditer(p.path, 1):
            rest = p.path[m.start():]
            by_suffix[rest] = i if by_suffix.get(rest, i) == i else None
    paired: dict[int, list] = {}
    unpaired = []
    for o in opt_states:
        for m in _SEGMENT.finditer(o.path, 1):
            i = by_suffix.get(o.path[m.start():])
            if i is not None:
                slot = o.path[:m.start()]
                slot = re.split(r"\.", slot)[-1] or slot
                paired.setdefault(i, []).append((slot, o))
                break
        else:
            unpaired.append(o)
    return paired, unpaired


_NEXT = re.compile(r"^result\[\d+\] \(next (.*)\)$")


def kept_results(inputs: Sequence, outputs: Sequence) -> tuple[list, list]:
    """(results shown, results that keep the sharding of the input they are the next value
    of (`result[3] (next state.params['w'])`))."""
    spec_of = {t.path: t.spec for t in inputs}
    shown, kept = [], []
    for t in outputs:
        m = _NEXT.match(t.path)
        (kept if m and spec_of.get(m.group(1)) == t.spec else shown).append(t)
    return shown, kept
