"""Human-readable units for plans, dumps and messages."""
from __future__ import annotations

import re
from typing import Any


def format_bytes(n: float) -> str:
    if abs(n) < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if abs(n) < 1024 or unit == "TiB":
            break
    return f"{n:.2f} {unit}"


def format_time(s: float) -> str:
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3f} ms"
    return f"{s * 1e6:.1f} us"


def mesh_text(names, shape) -> str:
    """A mesh as its axes and sizes: `mesh_text(("data", "model"), (2, 4))` is
    "data=2 x model=4"."""
    return " x ".join(f"{n}={k}" for n, k in zip(names, shape))


def id_range(ids) -> str:
    """Device ids as a range where they are consecutive ("0..3"), else listed ("0, 2, 5";
    two ids "0, 1")."""
    ids = list(ids)
    if len(ids) > 2 and ids == list(range(ids[0], ids[-1] + 1)):
        return f"{ids[0]}..{ids[-1]}"
    return ", ".join(map(str, ids))


def ratio_text(value: float | None, base: float, suffix: str = "") -> str:
    """`value / base` as "1.50" (+ `suffix`); "-" where `value` is unknown (None) or `base`
    is not positive."""
    if value is None or not base > 0:
        return "-"
    return f"{value / base:.2f}{suffix}"


NOT_APPLICABLE = "not applicable"    # an alternatives note: the method does not fit the step


def runner_up_text(alt: dict, step_s: float) -> str:
    """One `ParallelPlan.alternatives` entry in a few words, its predicted step as a multiple
    of the chosen plan's `step_s`: "DataParallel() 1.52x", "... 1.52x (over budget)",
    "... over budget" (no plan of it fits), "... not priced" (not searched: `fits` None),
    "... not applicable" (the method cannot take this step: its note says why)."""
    name, step = alt.get("name", "?"), alt.get("predicted_step_s")
    if step is None:
        if alt.get("fits") is False:
            return f"{name} over budget"
        return f"{name} " + (NOT_APPLICABLE if str(alt.get("note", "")).startswith(
            NOT_APPLICABLE) else "not priced")
    return (f"{name} {ratio_text(step, step_s, 'x')}"
            + ("" if alt.get("fits") else " (over budget)"))


# ------------------------------------------------------------------ text / markdown documents
# A document is a list of blocks: a `str` (a line), `Heading`, `Table`; `render` writes it
# as aligned text or as markdown (headings, pipe tables).
class Heading(str):
    """A line that heads a part of the document (markdown: a `##` heading)."""


class Table:
    """A titled table; `notes` follow its rows (counts of rows left out or collapsed).
    `clip` keeps the first `clip` rows, a count of those left out, and the last row."""
    def __init__(self, title: str, header: tuple, rows: list, notes: list | None = None,
                 clip: int | None = None):
        self.title, self.header, self.rows = title, tuple(header), [tuple(map(str, r))
                                                                    for r in rows]
        self.notes, self.clip = list(notes or ()), clip

    def text_lines(self) -> list[str]:
        widths = [max(len(r[i]) for r in [self.header, *self.rows])
                  for i in range(len(self.header))]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        lines = [fmt.format(*r).rstrip() for r in self.rows]
        if self.clip is not None and len(lines) > self.clip + 1:
            lines = (lines[:self.clip] + [f"... {len(lines) - self.clip - 1} more"]
                     + lines[-1:])
        lines = [fmt.format(*self.header).rstrip(), fmt.format(*("-" * w for w in widths))] \
            + lines + self.notes
        return ([f"{self.title}:"] if self.title else []) + ["  " + r for r in lines]

    def markdown_lines(self) -> list[str]:
        rows = self.rows
        if self.clip is not None and len(rows) > self.clip + 1:
            more = (f"... {len(rows) - self.clip - 1} more",) + ("",) * (len(self.header) - 1)
            rows = rows[:self.clip] + [more] + rows[-1:]
        cell = lambda c: (f"`{c}`" if any(ch in c for ch in "*_[]<>\\") else c
                          ).replace("|", "\\|") if c else ""
        out = ([f"### {self.title}", ""] if self.title else []) + [
            "| " + " | ".join(self.header) + " |",
            "|" + "|".join("---" for _ in self.header) + "|"]
        out += ["| " + " | ".join(cell(c) for c in r) + " |" for r in rows]
        return out + ([""] + self.notes if self.notes else [])


def render(blocks: list, style: str) -> str:
    """The document as `"text"` (aligned columns) or `"markdown"`."""
    out: list[str] = []
    for i, b in enumerate(blocks):
        if isinstance(b, Table):
            if style == "markdown":
                out += (["" ] if out and out[-1] else []) + b.markdown_lines() + [""]
            else:
                out += b.text_lines()
        elif style == "markdown":
            if isinstance(b, Heading):
                out += (["" ] if out and out[-1] else []) + \
                    [("# " if i == 0 else "## ") + b.rstrip(":"), ""]
            else:
                out.append(b.strip() + "  " if b.strip() else "")
        else:
            out.append(b)
    if style == "markdown":      # no runs of blank lines
        out = [line for j, line in enumerate(out) if line or (j and out[j - 1])]
    return "\n".join(out).rstrip("\n") if style == "markdown" else "\n".join(out)


def short_repr(value: Any, limit: int = 80) -> str:
    text = re.sub(r" at 0x[0-9a-f]+", "", repr(value))
    return text if len(text) <= limit else text[:limit - 3] + "..."
