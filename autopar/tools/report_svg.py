"""Inline SVG drawings for `autopar.report`: the device mesh, memory bars against the budget,
and the pipeline schedule as a timeline. Each function returns one `<svg>` element as text
(well-formed XML, no external references), or "" when there is nothing to draw.

Example:
    >>> svg = mesh_svg(plan)          # hosts as rows, one square per device
"""
from __future__ import annotations

from dataclasses import dataclass
from html import escape

from autopar.core._format import format_bytes, format_time
from autopar.core.enums import Schedule
from autopar.core.plan import ParallelPlan
from autopar.inter_op.schedule import Phase, make_schedule

SVG_NS = "http://www.w3.org/2000/svg"
# Colour-blind-safe stage colours (Okabe-Ito, then Tableau), cycled past ten stages.
STAGE_COLOURS = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00",
                 "#F0E442", "#4E79A7", "#B07AA1", "#9C755F")
SINGLE_COLOUR = "#4E79A7"


def stage_colour(index: int) -> str:
    return STAGE_COLOURS[index % len(STAGE_COLOURS)]


def _svg(width: float, height: float, body: list[str], label: str) -> str:
    return (f'<svg xmlns="{SVG_NS}" width="{width:.0f}" height="{height:.0f}" '
            f'viewBox="0 0 {width:.0f} {height:.0f}" role="img" aria-label="{escape(label)}">'
            + "".join(body) + "</svg>")


def _text(x: float, y: float, text: str, *, cls: str = "", anchor: str = "start",
          extra: str = "") -> str:
    c = f' class="{cls}"' if cls else ""
    return (f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}"{c}{extra}>'
            f"{escape(text)}</text>")


def _rect(x: float, y: float, w: float, h: float, fill: str, title: str = "",
          extra: str = "") -> str:
    tip = f"<title>{escape(title)}</title>" if title else ""
    return (f'<rect x="{x:.1f}" y="{y:.1f}" width="{max(w, 0):.1f}" height="{h:.1f}" '
            f'fill="{fill}"{extra}>{tip}</rect>')


# ------------------------------------------------------------------------------ mesh
def mesh_grid(plan: ParallelPlan) -> tuple[int, int]:
    """(rows, columns) the devices are drawn in: the mesh's first axis as rows (hosts on a
    cluster mesh), the other axes flattened into columns."""
    shape = plan.mesh_shape or (len(plan.device_ids),)
    rows = shape[0] if len(shape) > 1 else 1
    return rows, max(len(plan.device_ids) // max(rows, 1), 1)


def device_stage(plan: ParallelPlan) -> dict[int, int]:
    """Device id -> the pipeline stage that runs on it (all 0 for a single-mesh plan)."""
    if plan.is_pipeline:
        return {d: s.index for s in plan.stages for d in s.device_ids}
    return {d: 0 for d in plan.device_ids}


def mesh_svg(plan: ParallelPlan) -> str:
    """The device mesh: one square per device (its id inside), hosts / the first mesh axis as
    rows; coloured by pipeline stage, or one colour for a single-mesh plan."""
    rows, cols = mesh_grid(plan)
    staged = plan.is_pipeline
    owner = device_stage(plan)
    cell, gap, left, top = 46, 8, 110, 34
    width = left + cols * (cell + gap) + 20
    height = top + rows * (cell + gap) + 30
    names, shape = plan.axis_names, plan.mesh_shape
    row_axis = f"{names[0]} = {shape[0]}" if len(shape) > 1 else "devices"
    col_axis = " x ".join(f"{n} = {k}" for n, k in zip(names[1:], shape[1:])) \
        if len(shape) > 1 else f"{names[0] if names else 'axis'} = {len(plan.device_ids)}"
    body = [_text(left + cols * (cell + gap) / 2, 18, f"{col_axis}  \u2192", cls="axis",
                  anchor="middle"),
            _text(16, top + rows * (cell + gap) / 2, f"{row_axis} \u2193", cls="axis",
                  extra=f' transform="rotate(-90 16 {top + rows * (cell + gap) / 2:.1f})"'
                  ' dominant-baseline="hanging"')]
    for r in range(rows):
        body.append(_text(left - 10, top + r * (cell + gap) + cell / 2 + 4,
                          f"host {r}" if staged else f"{names[0] if names else ''} {r}",
                          cls="small", anchor="end"))
        for c in range(cols):
            i = r * cols + c
            if i >= len(plan.device_ids):
                continue
            dev = plan.device_ids[i]
            s = owner.get(dev)
            fill = stage_colour(s) if staged and s is not None else SINGLE_COLOUR
            tip = f"device {dev}" + (f", stage {s}" if staged else "")
            x, y = left + c * (cell + gap), top + r * (cell + gap)
            body.append(_rect(x, y, cell, cell, fill, tip, ' rx="6" class="device"'
                              f' data-device="{dev}"'))
            body.append(_text(x + cell / 2, y + cell / 2 + 5, str(dev), cls="devlabel",
                              anchor="middle"))
    return _svg(width, height, body, "device mesh")


# ---------------------------------------------------------------------------- memory
@dataclass(frozen=True, slots=True)
class MemoryBar:
    """One stacked bar: (part name, bytes per device) in drawing order, the predicted peak,
    and the compiled peak where XLA's memory_analysis checked it."""
    label: str
    parts: tuple[tuple[str, float], ...]
    peak: float
    compiled: float | None = None
    saved: float = 0.0        # what its recomputation saves: drawn outlined past the peak


PART_COLOURS = {"parameters": "#4E79A7", "optimizer state": "#F28E2B",
                "gradient accumulator": "#76B7B2", "gradients (one microbatch)": "#59A14F",
                "working memory": "#BAB0AC", "activations in flight": "#E15759",
                "deferred weight gradients": "#FF9DA7",
                "results of the other microbatches": "#9C755F",
                "batch": "#EDC948", "other inputs": "#B07AA1",
                "activations, gradients, results and temporaries": "#E15759",
                "not attributed": "#D3D3D3"}


def memory_svg(bars: list[MemoryBar], budget: float) -> str:
    """Horizontal stacked bars, one per stage, against the budget line. When the budget is far
    above every peak the axis ends at the largest peak and the budget is named off-scale."""
    if not bars:
        return ""
    top_peak = max(max(b.peak + b.saved, b.compiled or 0.0) for b in bars)
    on_scale = budget <= 4 * top_peak
    scale_max = max(top_peak, budget if on_scale else 0.0) * 1.05 or 1.0
    left = max(150, 7 * max(len(b.label) for b in bars) + 20)
    bar_w, bar_h, gap, top = 640, 26, 16, 14
    height = top + len(bars) * (bar_h + gap) + 40
    body: list[str] = []
    for i, b in enumerate(bars):
        y = top + i * (bar_h + gap)
        body.append(_text(left - 10, y + bar_h / 2 + 4, b.label, anchor="end"))
        x = left
        for name, n in b.parts:
            w = bar_w * n / scale_max
            body.append(_rect(x, y, w, bar_h, PART_COLOURS.get(name, "#999"),
                              f"{b.label}: {name} {format_bytes(n)}",
                              f' class="part" data-part="{escape(name)}" data-bytes="{n:.0f}"'))
            x += w
        if b.saved > 0:
            body.append(f'<rect x="{x:.1f}" y="{y + 3}" width="{bar_w * b.saved / scale_max:.1f}" '
                        f'height="{bar_h - 6}" class="saved" data-bytes="{b.saved:.0f}">'
                        f'<title>{escape(b.label)}: recomputation saves '
                        f'{escape(format_bytes(b.saved))}</title></rect>')
        body.append(_text(left + bar_w * (b.peak + b.saved) / scale_max + 6, y + bar_h / 2 + 4,
                          format_bytes(b.peak), cls="small"))
        if b.compiled:
            cx = left + bar_w * b.compiled / scale_max
            body.append(f'<line x1="{cx:.1f}" y1="{y - 3}" x2="{cx:.1f}" y2="{y + bar_h + 3}" '
                        f'class="compiled"><title>compiled by XLA: '
                        f'{escape(format_bytes(b.compiled))}</title></line>')
    axis_y = top + len(bars) * (bar_h + gap)
    body.append(f'<line x1="{left}" y1="{axis_y}" x2="{left + bar_w}" y2="{axis_y}" '
                'class="axisline"/>')
    for k in range(5):
        v = scale_max * k / 4
        body.append(_text(left + bar_w * k / 4, axis_y + 16, format_bytes(v), cls="small",
                          anchor="middle"))
    if on_scale:
        bx = left + bar_w * budget / scale_max
        body.append(f'<line x1="{bx:.1f}" y1="{top - 8}" x2="{bx:.1f}" y2="{axis_y}" '
                    'class="budget" id="budget-line"/>')
        body.append(_text(bx, axis_y + 32, f"budget {format_bytes(budget)}",
                          cls="small budget-label", anchor="middle"))
    else:
        body.append(_text(left + bar_w, axis_y + 32, f"budget {format_bytes(budget)}: off "
                          f"the scale ({top_peak / max(budget, 1):.2%} used)", cls="small",
                          anchor="end"))
    return _svg(left + bar_w + 90, height, body, "memory per device")


# -------------------------------------------------------------------------- timeline
def timeline_tasks(plan: ParallelPlan):
    """(clock table, clock length in seconds, per-stage forward+backward seconds) of a
    pipeline plan, from `inter_op.schedule.make_schedule` (the order the executor runs)."""
    p = plan.pipeline
    table = make_schedule(Schedule(p["schedule"]), len(plan.stages), p["num_microbatches"])
    lat = [s.latency_s for s in plan.stages]
    return table, max(max(lat) / _tasks_per_microbatch(table), 1e-30), lat


def _tasks_per_microbatch(table) -> int:
    """The tasks of a microbatch on a stage: F alone in a forward-only table, F and B, and W
    where the table splits the backward."""
    return len(table.phases)


_KIND = {Phase.FORWARD: ("forward", "fwd", ' fill-opacity="0.55"'),
         Phase.BACKWARD: ("backward", "bwd", ""),
         Phase.WEIGHT: ("weight gradient", "wgt", ' fill-opacity="0.8" stroke-dasharray="3 2"')}


def timeline_svg(plan: ParallelPlan) -> str:
    """Each microbatch's forward (light), backward (dark) and, in a zero-bubble table, weight
    gradient (dashed) per stage over time: one clock is one task of the slowest stage (half
    its forward+backward, a third where W is split off); each stage's task fills its own
    share, so slack and the pipeline's bubbles (blank) show."""
    table, clock, lat = timeline_tasks(plan)
    S, n = table.num_groups, table.num_clocks          # a lane per device group
    left, top, row_h, gap = 80, 24, 30, 8
    cw = min(max(700 / n, 14), 60)
    width = max(left + n * cw + 30, 560)
    height = top + S * (row_h + gap) + 48
    body = []
    for g in range(S):
        y = top + g * (row_h + gap)
        stages = [k for k in range(table.num_stages) if table.group_of(k) == g]
        label = f"stage {g}" if stages == [g] else "stages " + ", ".join(map(str, stages))
        body.append(_text(left - 10, y + row_h / 2 + 4, label, anchor="end"))
        body.append(_rect(left, y, n * cw, row_h, "#f4f4f4", extra=' class="lane"'))
        for c, row in enumerate(table.clocks):
            t = row[g]
            if t is None:
                continue
            name, cls, style = _KIND[t.phase]
            w = cw * min(lat[t.stage] / _tasks_per_microbatch(table) / clock, 1.0)
            body.append(_rect(left + c * cw, y, w, row_h, stage_colour(t.stage),
                              f"stage {t.stage} {name} of microbatch {t.microbatch}: clock {c}",
                              f' class="task {cls}" stroke="#fff"' + style))
            body.append(_text(left + c * cw + w / 2, y + row_h / 2 + 4, str(t), cls="tasklabel",
                              anchor="middle"))
    axis_y = top + S * (row_h + gap)
    ticks = min(n, 8)
    for k in range(ticks + 1):
        c = n * k / ticks
        body.append(_text(left + c * cw, axis_y + 14, format_time(c * clock), cls="small",
                          anchor="middle"))
    split = ", W = weight gradient (dashed)" if table.split_backward else ""
    body.append(_text(left, axis_y + 34, f"{n} clocks of {format_time(clock)}; F = forward, "
                      f"B = backward (darker){split}; blank = bubble", cls="small"))
    return _svg(width, height, body, "pipeline schedule")


def split_bar_svg(parts: list[tuple[str, float]]) -> str:
    """One horizontal bar of a single-mesh step: compute, communication, resharding,
    overhead, in proportion."""
    total = sum(v for _, v in parts) or 1.0
    colours = ("#4E79A7", "#E15759", "#F28E2B", "#BAB0AC")
    left, width, h = 10, 760, 26
    body, x = [], left
    for (name, v), colour in zip(parts, colours):
        w = width * v / total
        body.append(_rect(x, 8, w, h, colour, f"{name} {format_time(v)}",
                          f' class="part" data-part="{escape(name)}"'))
        label = f"{name} {format_time(v)}"
        if w > 7 * len(label) + 8:
            body.append(_text(x + w / 2, 8 + h / 2 + 4, label,
                              cls="tasklabel", anchor="middle"))
        x += w
    return _svg(left + width + 10, 8 + h + 10, body, "step time split")
