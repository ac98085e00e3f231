"""Read the collectives out of compiled HLO text: what XLA actually inserted, by kind, size
and source operator, to check a plan's prediction against (`tests`, `benchmarks`, `dump`).

Example:
    >>> text = step.get_compiled(state, batch).as_text()
    >>> summary(collectives(text))
    {'all-reduce': (1, 2117632)}
"""
from __future__ import annotations

import re
from dataclasses import dataclass

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_OP = re.compile(r"=\s*(?P<shape>.*?)\s(?P<kind>" + "|".join(KINDS) + r")(?P<start>-start)?\(")
_ARRAY = re.compile(r"\b(pred|[subf]\d+|bf16|f8e\w+|c64|c128)\[([0-9,]*)\]")
_BITS = {"pred": 8, "bf16": 16, "c64": 64, "c128": 128}


@dataclass(frozen=True, slots=True)
class Collective:
    kind: str          # one of KINDS
    nbytes: int        # bytes of the result per device (all operands of a combined one)
    op_name: str       # the jax op_name metadata of the instruction ("" if none)
    num_operands: int  # > 1 where XLA combined several collectives into one


def _bytes(shape: str) -> tuple[int, int]:
    total, count = 0, 0
    for dtype, dims in _ARRAY.findall(shape):
        bits = _BITS.get(dtype) or int(re.sub(r"\D", "", dtype.split("e")[0]) or 8)
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * bits // 8
        count += 1
    return total, count


def collectives(hlo_text: str) -> list[Collective]:
    """Every collective instruction of an HLO module's text (`compiled.as_text()`), in order.
    An asynchronous pair counts once (its `-start`); a `-done` is skipped."""
    out = []
    for line in hlo_text.splitlines():
        m = _OP.search(line)
        if not m or "-done(" in line:
            continue
        shape = m.group("shape")
        if m.group("start") and m.group("kind") != "all-reduce" and shape.startswith("("):
            # an async start's result tuple repeats its operand: count the result half
            arrays = _ARRAY.findall(shape)
            shape = " ".join(f"{d}[{s}]" for d, s in arrays[len(arrays) // 2:])
        nbytes, count = _bytes(shape)
        if m.group("kind") == "all-to-all":
            count = 1    # a tuple all-to-all holds one chunk per peer of one exchange
        name = re.search(r'op_name="([^"]*)"', line)
        out.append(Collective(kind=m.group("kind"), nbytes=nbytes,
                              op_name=name.group(1) if name else "", num_operands=count))
    return out


_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%([^\s(]+)\s.*\{\s*$")
_LOOP_BODY = re.compile(r"\bbody=%([^\s,)}]+)")


def loop_body_collectives(hlo_text: str) -> list[Collective]:
    """The collectives inside `while` bodies (a scan or while loop: they run every
    iteration), in order. A planned loop body shows its operators' collectives here."""
    bodies = set(_LOOP_BODY.findall(hlo_text))
    lines, name = [], None
    for line in hlo_text.splitlines():
        m = _COMPUTATION.match(line)
        if m:
            name = m.group(1)
        elif line.startswith("}"):
            name = None
        elif name in bodies:
            lines.append(line)
    return collectives("\n".join(lines))


def summary(found: list[Collective]) -> dict[str, tuple[int, int]]:
    """kind -> (count, total bytes), for the kinds present."""
    out: dict[str, tuple[int, int]] = {}
    for c in found:
        n, b = out.get(c.kind, (0, 0))
        out[c.kind] = (n + 1, b + c.nbytes)
    return out


__all__ = ["Collective", "KINDS", "collectives", "loop_body_collectives", "summary"]
