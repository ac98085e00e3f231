"""Report pass: one self-contained HTML page describing a `ParallelPlan`.

The page needs no network (inline CSS and SVG, no fonts or images from elsewhere; one line of
script opens the folded tables for printing), reads in any browser and prints. Its sections
carry stable ids: `summary`, `mesh`, `memory`, `timeline`, `collectives`, `runner-ups`,
`sharding`.

Example:
    >>> plan = train_step.get_plan(state, batch)
    >>> html = autopar.report(plan, "plan.html")   # also returns the text
"""
from __future__ import annotations

import logging
import os
from html import escape

from autopar.core._format import format_bytes, format_time, id_range, mesh_text, ratio_text
from autopar.core.errors import InvalidArgumentError, PlanMismatchError
from autopar.core.plan import ParallelPlan
from autopar.core.plan_check import check_specs
from autopar.core.spec import format_spec
from autopar.tools.fold import fold
from autopar.tools.report_data import collective_groups, memory_bars
from autopar.tools.report_svg import (
    PART_COLOURS,
    memory_svg,
    mesh_svg,
    split_bar_svg,
    stage_colour,
    timeline_svg,
)

log = logging.getLogger(__name__)

CSS = """
:root { --fg:#1d2330; --muted:#5b6472; --line:#d9dde3; --bg:#ffffff; --band:#f6f7f9;
        --accent:#0072B2; --bad:#c0392b; --good:#1e8449; }
* { box-sizing: border-box; }
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial,
       sans-serif; color: var(--fg); background: var(--bg); margin: 0 auto; max-width: 1180px;
       padding: 24px 32px 48px; }
h1 { font-size: 22px; margin: 0 0 4px; }
h2 { font-size: 17px; margin: 0 0 10px; padding-bottom: 4px; border-bottom: 2px solid
     var(--accent); }
h3 { font-size: 14px; margin: 14px 0 6px; }
section { margin: 26px 0; break-inside: avoid-page; }
.sub { color: var(--muted); margin: 0 0 14px; }
.cards { display: grid; grid-template-columns: repeat(auto-fill, minmax(200px, 1fr));
         gap: 10px; }
.card { border: 1px solid var(--line); border-radius: 8px; padding: 8px 12px;
        background: var(--band); }
.card .k { color: var(--muted); font-size: 12px; text-transform: uppercase;
           letter-spacing: .04em; }
.card .v { font-size: 17px; font-weight: 600; }
.card .d { color: var(--muted); font-size: 12px; }
table { border-collapse: collapse; width: 100%; font-size: 13px; margin: 4px 0 8px; }
th, td { text-align: left; padding: 4px 8px; border-bottom: 1px solid var(--line);
         vertical-align: top; }
th { background: var(--band); font-weight: 600; }
.scroll { overflow-x: auto; }
table.compact { width: auto; }
table.memtable td:first-child { white-space: nowrap; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
td.num { white-space: nowrap; }
td code, .mono { font-family: ui-monospace, "SFMono-Regular", Menlo, Consolas, monospace;
                 font-size: 12px; }
tr.chosen td { font-weight: 600; background: #eef6fb; }
.note { color: var(--muted); font-size: 13px; margin: 6px 0; }
.fits { color: var(--good); } .nofit { color: var(--bad); font-weight: 600; }
.legend { display: flex; flex-wrap: wrap; gap: 12px; font-size: 12px; margin: 6px 0; }
.swatch { display: inline-block; width: 12px; height: 12px; border-radius: 3px;
          vertical-align: -2px; margin-right: 4px; }
details > summary { cursor: pointer; color: var(--accent); margin: 6px 0; }
svg { max-width: 100%; height: auto; }
svg text { font: 12px system-ui, sans-serif; fill: var(--fg); }
svg text.small { font-size: 11px; fill: var(--muted); }
svg text.axis { font-weight: 600; }
svg text.devlabel, svg text.tasklabel { fill: #fff; font-weight: 600; }
svg .budget { stroke: var(--bad); stroke-width: 2; stroke-dasharray: 5 3; }
svg .compiled { stroke: #000; stroke-width: 2; }
svg .saved { fill: none; stroke: #E15759; stroke-width: 1.5; stroke-dasharray: 4 3; }
svg .axisline { stroke: var(--line); }
@media print { body { padding: 0; max-width: none; }
               section { break-inside: avoid; } a { color: inherit; } }
"""

# Printing opens the folded tables (the page's only script; nothing else needs it).
PRINT_JS = ("<script>window.addEventListener('beforeprint', () => document.querySelectorAll("
            "'details').forEach(d => { d.open = true; }));</script>")


def _td(value, num: bool = False) -> str:
    return f'<td{" class=num" if num else ""}>{escape(str(value))}</td>'


def _table(header: tuple[str, ...], rows: list[tuple], num_cols: frozenset[int] = frozenset(),
           row_classes: list[str] | None = None, cls: str = "") -> str:
    head = "".join(f'<th{" class=num" if i in num_cols else ""}>{escape(h)}</th>'
                   for i, h in enumerate(header))
    body = []
    for k, r in enumerate(rows):
        rc = row_classes[k] if row_classes and row_classes[k] else ""
        body.append(f"<tr{f' class={rc}' if rc else ''}>"
                    + "".join(_td(v, i in num_cols) for i, v in enumerate(r)) + "</tr>")
    c = f' class="{cls}"' if cls else ""
    return (f'<div class="scroll"><table{c}><thead><tr>{head}</tr></thead><tbody>'
            f"{''.join(body)}</tbody></table></div>")


def _card(key: str, value: str, detail: str = "", ident: str = "") -> str:
    i = f' id="{ident}"' if ident else ""
    return (f'<div class="card"{i}><div class="k">{escape(key)}</div><div class="v">'
            f'{escape(value)}</div><div class="d">{escape(detail)}</div></div>')


def _section(ident: str, title: str, body: str, sub: str = "") -> str:
    s = f'<p class="sub">{escape(sub)}</p>' if sub else ""
    return f'<section id="{ident}"><h2>{escape(title)}</h2>{s}{body}</section>'


def _note(text: str) -> str:
    return f'<p class="note">{escape(text)}</p>'


def _mesh_text(plan: ParallelPlan) -> str:
    return mesh_text(plan.axis_names, plan.mesh_shape)


def _fold_rows(rows: list[tuple], add: int | None = None) -> list[tuple]:
    """Rows equal but for the layer indices in their first column (`tools.fold`: e.g.
    `Dense_0` .. `Dense_3`) and the number in column `add` (summed) folded into one row,
    whose first column shows the indices (`Dense_{0..3}`) and whose last (added) column
    counts the rows ("" for one), in order of first appearance."""
    rest = (lambda r: r[1:]) if add is None else (lambda r: r[1:add] + r[add + 1:])
    out = []
    for g in fold(rows, lambda r: str(r[0]), rest):
        r = g.items[0]
        if add is not None:
            r = r[:add] + (sum(x[add] for x in g.items),) + r[add + 1:]
        out.append((g.name,) + r[1:] + (str(g.count) if g.count > 1 else "",))
    return out


# ---------------------------------------------------------------------------- header
def _header(plan: ParallelPlan) -> str:
    kind = (f"{len(plan.stages)}-stage pipeline" if plan.is_pipeline else
            "gradient accumulation" if plan.pipeline else "one mesh")
    budget = plan.memory_budget_bytes
    used = plan.peak_memory_bytes / max(budget, 1)
    fits = plan.peak_memory_bytes <= budget
    searched = plan.searched_at or "not recorded (hand-built or older plan)"
    cards = [
        _card("method", plan.method, kind),
        _card("cluster", plan.cluster, f"{len(plan.device_ids)} devices"),
        _card("mesh", _mesh_text(plan), "devices " + id_range(plan.device_ids)),
        _card("predicted step", format_time(plan.predicted_step_s),
              f"compute {format_time(plan.predicted_compute_s)} \u00b7 comm "
              f"{format_time(plan.predicted_comm_s)} \u00b7 reshard "
              f"{format_time(plan.predicted_reshard_s)} \u00b7 overhead "
              f"{format_time(plan.predicted_overhead_s)}", "card-step"),
        _card("peak memory / device", format_bytes(plan.peak_memory_bytes),
              f"{used:.1%} of budget {format_bytes(budget)}"
              + ("" if fits else " \u2014 OVER BUDGET"), "card-memory"),
        _card("plan from", plan.origin, f"searched {searched}"),
    ]
    if "step_s" in plan.measured:
        m = plan.measured
        cards.append(_card("measured step", format_time(m["step_s"]),
                           f"autopar.calibrate, {m.get('steps', '?')} steps; predicted / "
                           f"measured {plan.predicted_step_s / m['step_s']:.2f}"))
    parts = [("compute", plan.predicted_compute_s), ("communication", plan.predicted_comm_s),
             ("resharding", plan.predicted_reshard_s), ("overhead", plan.predicted_overhead_s)]
    extra = [f'<h3>Predicted step, per device</h3>{split_bar_svg(parts)}']
    if plan.ilp:
        i = plan.ilp
        rows = [(i.get("num_groups", "-"), i.get("num_edges", "-"),
                 i.get("num_memory_points", "-"), i.get("num_variables", "-"),
                 i.get("num_constraints", "-"), i.get("backend", "-"), i.get("status", "-"),
                 format_time(i.get("build_time_s", 0.0)), format_time(i.get("solve_time_s", 0.0)))]
        extra.append("<h3>ILP</h3>" + _table(
            ("strategy groups", "edges", "memory points", "variables", "constraints", "backend",
             "status", "build", "solve"), rows, frozenset(range(5)) | {7, 8}))
        if i.get("layer_reuse"):
            extra.append(_note(f"repeated layers: {i['layer_reuse']}"))
        if i.get("status") not in ("optimal", "trivial", None):
            extra.append(_note(f"NOTE: {i.get('message', '')}"))
    if plan.timings_s:
        extra.append("<h3>Timings</h3>" + _table(
            tuple(plan.timings_s), [tuple(format_time(v) for v in plan.timings_s.values())],
            frozenset(range(len(plan.timings_s))), cls="compact"))
    return (f'<header id="summary"><h1>autopar plan: {escape(plan.method)} on '
            f'{escape(_mesh_text(plan))}</h1><p class="sub">graph {escape(plan.graph_fingerprint)}'
            f' \u00b7 plan format {plan.version}</p><div class="cards">{"".join(cards)}</div>'
            + "".join(extra) + "</header>")


# ------------------------------------------------------------------------------ mesh
def _mesh(plan: ParallelPlan) -> str:
    body = mesh_svg(plan)
    if plan.is_pipeline:
        legend = "".join(
            f'<span><span class="swatch" style="background:{stage_colour(s.index)}"></span>'
            f"stage {s.index}: layers {s.layers[0]}..{s.layers[1]}, devices "
            f"{escape(id_range(s.device_ids))}, logical mesh "
            f"{escape(mesh_text(s.axis_names, s.logical_mesh_shape))}"
            "</span>" for s in plan.stages)
        body += f'<div class="legend">{legend}</div>'
        sub = "Devices coloured by the pipeline stage that runs on them; hosts as rows."
    else:
        sub = "One logical mesh over all devices: its first axis as rows, the rest as columns."
    return _section("mesh", "Device mesh", body, sub)


# -------------------------------------------------------------------------- sharding
def _inputs_table(plan: ParallelPlan, tensors, names) -> str:
    """Parameters, batch and other leaves in a table; the optimizer state (mostly its
    parameters' shardings again) in a folded-away one."""
    def table(ts) -> str:
        rows = [(t.path, t.role, "x".join(map(str, t.shape)) or "scalar", t.dtype,
                 format_spec(t.spec, names)) for t in ts]
        return _table(("leaf", "role", "shape", "dtype", "sharding", "x layers"), _fold_rows(rows),
                      frozenset({5}), cls="mono")
    opt = [t for t in tensors if t.role == "opt_state"]
    text = table([t for t in tensors if t.role != "opt_state"])
    if opt:
        text += (f"<details><summary>Optimizer state ({len(opt)} leaves)</summary>"
                 + table(opt) + "</details>")
    return text


def _sharding(plan: ParallelPlan) -> str:
    names = plan.axis_names
    parts = []
    if plan.is_pipeline:
        rows = []
        for s in plan.stages:
            q = plan.pipeline.get("in_flight", [0] * len(plan.stages))[s.index]
            rows.append((s.index, f"{s.layers[0]}..{s.layers[1]}", id_range(s.device_ids),
                         "x".join(map(str, s.submesh)),
                         mesh_text(s.axis_names, s.logical_mesh_shape),
                         ", ".join(s.scopes) or "-", s.remat + (" + zero" if s.zero else ""),
                         format_time(s.latency_s), format_time(s.compute_s),
                         format_time(s.comm_s), q, format_bytes(s.peak_memory_bytes)))
        parts.append("<h3>Stages</h3>" + _table(
            ("stage", "layers", "devices", "submesh", "logical mesh", "model code", "remat",
             "fwd+bwd / microbatch", "compute", "comm", "in flight", "peak memory"), rows,
            frozenset({7, 8, 9, 10, 11})))
        if plan.stage_solutions:
            rows = [(k, "x".join(map(str, r["logical_shape"])), r["ilp"]["status"],
                     r["ilp"]["num_variables"], format_time(r["ilp"]["solve_time_s"]),
                     format_bytes(r["param_bytes"]), format_bytes(r["grad_bytes"]),
                     format_bytes(r["activation_bytes"]), len(r["act_specs"]),
                     len(r["constraints"]))
                    for k, r in enumerate(plan.stage_solutions)]
            parts.append("<h3>Stage ILP solutions</h3>" + _table(
                ("stage", "logical mesh", "ILP status", "variables", "solve", "params / device",
                 "grads / device", "activations / microbatch", "activation tensors",
                 "pinned intermediates"), rows, frozenset({3, 4, 5, 6, 7, 8, 9})))
        for s in plan.stages:
            mine = [t for t in plan.inputs if t.stage == s.index]
            snames = s.axis_names or names
            parts.append(f'<h3><span class="swatch" style="background:{stage_colour(s.index)}">'
                         f"</span>Stage {s.index}: state and inputs ({len(mine)} leaves; "
                         "specs on the stage's logical mesh)</h3>"
                         + _inputs_table(plan, mine, snames))
    else:
        parts.append(f"<h3>State and inputs ({len(plan.inputs)} leaves)</h3>"
                     + _inputs_table(plan, plan.inputs, names))
    if plan.operators:
        rows = [(o.name_stack or "-", o.primitive + (f" x{o.trips}" if o.trips > 1 else ""),
                 "x".join(map(str, o.out_shape)), o.strategy, format_spec(o.out_spec, names),
                 o.communication or "-", o.compute_s, o.source) for o in plan.operators]
        out = [r[:6] + (format_time(r[6]),) + r[7:] for r in _fold_rows(rows, add=6)]
        parts.append(f"<h3>Heavy operators and their activations ({len(plan.operators)})</h3>"
                     + _table(("scope", "op", "out shape", "strategy", "out sharding",
                               "collective", "compute", "source", "x layers"), out,
                              frozenset({6, 8}), cls="mono"))
    elif plan.is_pipeline:
        parts.append(_note("Pipeline plans record each stage's activation specs in the stage "
                           "solutions above, not per operator."))
    res = [(t.path, "x".join(map(str, t.shape)) or "scalar", format_spec(t.spec, names))
           for t in plan.outputs]
    folded = _fold_rows(res)
    parts.append(f"<details><summary>Results ({len(plan.outputs)} leaves)</summary>"
                 + _table(("result", "shape", "sharding", "x layers"), folded,
                          frozenset({3}), cls="mono") + "</details>")
    if plan.fallbacks:
        parts.append("<h3>Fallbacks</h3>" + _table(
            ("node", "op", "source", "reason", "replicated"),
            [(f.node, f.primitive, f.source, f.reason, format_bytes(f.replicated_bytes))
             for f in plan.fallbacks], frozenset({0, 4})))
    return _section("sharding", "Sharding of parameters and activations", "".join(parts),
                    "Rows of repeated layers that share a sharding are folded into one "
                    "(e.g. Dense_{0..3}); '-' is a replicated dimension.")


# ---------------------------------------------------------------------------- memory
def _memory(plan: ParallelPlan) -> str:
    bars, notes = memory_bars(plan)
    used = list(dict.fromkeys(name for b in bars for name, _ in b.parts))
    legend = "".join(f'<span><span class="swatch" style="background:{PART_COLOURS.get(n, "#999")}">'
                     f"</span>{escape(n)}</span>" for n in used)
    saved = any(b.saved for b in bars)
    rows = [(b.label,) + tuple(format_bytes(dict(b.parts).get(n, 0.0)) for n in used)
            + (format_bytes(b.peak), format_bytes(b.compiled) if b.compiled else "-")
            + ((format_bytes(b.saved) if b.saved else "-",) if saved else ())
            for b in bars]
    table = _table(("",) + tuple(used) + ("predicted peak", "compiled (XLA)")
                   + (("recomputation saves",) if saved else ()), rows,
                   frozenset(range(1, len(used) + 3 + saved)), cls="memtable")
    body = (memory_svg(bars, plan.memory_budget_bytes) + f'<div class="legend">{legend}</div>'
            + table + "".join(_note(n) for n in notes))
    return _section("memory", "Memory per device", body,
                    f"Predicted peak per device against the budget "
                    f"{format_bytes(plan.memory_budget_bytes)} (dashed line).")


# -------------------------------------------------------------------------- timeline
def _timeline(plan: ParallelPlan) -> str:
    if not plan.pipeline:
        return _section("timeline", "Schedule", _note(
            "Single-mesh plan: one executable per step, no pipeline schedule. The bar under "
            "'Predicted step' splits its time into compute, communication, resharding and "
            "call overhead."))
    p = plan.pipeline
    sub = (f"schedule {p['schedule']}, {p['num_microbatches']} microbatch(es), predicted "
           f"bubble {p.get('bubble_fraction', 0.0):.1%}, predicted step "
           f"{format_time(p.get('predicted_latency_s', plan.predicted_step_s))}. Task order from "
           "the executor's schedule (runtime.schedule); the plan records each stage's "
           "forward+backward per microbatch, not its split: each task is drawn as an equal "
           "share." + _schedule_search(p))
    title = "Pipeline schedule" if plan.is_pipeline else \
        "Microbatch schedule (gradient accumulation on one mesh)"
    return _section("timeline", title, timeline_svg(plan), sub)


def _schedule_search(p: dict) -> str:
    """Schedule.AUTO's candidates: each one's predicted step against 1F1B's."""
    found = p.get("schedule_search") or []
    one = next((c["predicted_latency_s"] for c in found if c["schedule"] == "1f1b"), None)
    if not one:
        return ""
    return (f" Schedule.AUTO chose {p['schedule']}; predicted step vs 1F1B: " + ", ".join(
        f"{c['schedule']} {c['predicted_latency_s'] / one:.3f}x"
        + ("" if c["fits"] else " (does not fit)") for c in found) + ".")


# ----------------------------------------------------------------------- collectives
def _collectives(plan: ParallelPlan) -> str:
    groups = collective_groups(plan)
    if not groups:
        text = ("The plan records no collectives" + (
            " per operator for pipeline stages or microbatched steps (the communication time "
            "is in the header's split" + (" and the stage table)." if plan.is_pipeline
                                          else ").") if plan.pipeline else "."))
        return _section("collectives", "Collectives", _note(text))
    staged = groups[0].stage is not None
    rows = [((f"stage {g.stage}",) if staged else ()) + (
        g.kind, "*".join(g.axes) or "-", g.origin, g.algorithm, g.count,
        format_bytes(g.nbytes), format_time(g.comm_s)) for g in groups]
    total = sum(g.comm_s for g in groups)
    head = ("kind", "mesh axes", "from", "algorithm", "count", "bytes / device",
            "predicted time")
    numeric = frozenset(i + staged for i in (4, 5, 6))
    return _section("collectives", "Collectives", _table(
        (("stage",) if staged else ()) + head, rows, numeric) + _note(
        f"{sum(g.count for g in groups)} collectives, {format_time(total)} predicted in all"
        + (" (per microbatch's forward + backward of each stage; the stage axes are the "
           "stage's logical mesh)" if staged else "")
        + ". XLA may combine independent all-reduces and all-gathers."),
        "Grouped by " + ("stage, " if staged else "") + "kind, mesh axes, origin and "
        "algorithm; the most time first.")


# ------------------------------------------------------------------------ runner-ups
def _runner_ups(plan: ParallelPlan) -> str:
    step, peak = plan.predicted_step_s, plan.peak_memory_bytes
    fits = peak <= plan.memory_budget_bytes
    rows = [(f"{plan.method} (chosen)", "pipeline" if plan.is_pipeline else "method",
             format_time(step), "1.00", format_bytes(peak), "1.00", "yes" if fits else "no",
             "this plan")]
    for a in plan.alternatives:
        fit = a.get("fits")      # None: not priced (its step and peak are not known)
        s = a.get("predicted_step_s")
        m = a.get("peak_memory_bytes") if fit is not None else None
        rows.append((a.get("name", "?"), a.get("kind", "-"),
                     format_time(s) if s is not None else "-", ratio_text(s, step),
                     format_bytes(m) if m is not None else "-", ratio_text(m, peak),
                     "-" if fit is None else "yes" if fit else "no", a.get("note", "")))
    body = _table(("plan", "kind", "predicted step", "x step", "peak memory", "x memory",
                   "fits", "note"), rows, frozenset({2, 3, 4, 5}),
                  ["chosen"] + [""] * len(plan.alternatives))
    if not plan.alternatives:
        body += _note("The search recorded no runner-ups for this plan.")
    return _section("runner-ups", "Why this plan", body,
                    "Alternatives the search priced under the same cost model, with ratios to "
                    "the chosen plan.")


def _check(plan) -> None:
    """A clear error for what the page cannot draw: not a plan, or a leaf whose spec does not
    fit its (stage's) mesh (`plan_check.check_specs`, as `ParallelPlan.from_json` checks)."""
    if not isinstance(plan, ParallelPlan):
        raise InvalidArgumentError(
            f"autopar.report(plan=...) got {type(plan).__name__}; pass a ParallelPlan, e.g. "
            "step.get_plan(state, batch) or ParallelPlan.from_json(text).")
    try:
        check_specs(plan)
    except PlanMismatchError as e:
        raise InvalidArgumentError(
            f"autopar.report: the plan is inconsistent: {e} (report a plan made by autopar: "
            "get_plan, autopar.plan or ParallelPlan.from_json of a saved one)") from None


def report(plan: ParallelPlan, path: str | os.PathLike | None = None) -> str:
    """A self-contained HTML page describing `plan`: header (method, mesh, predicted step and
    its parts, memory against the budget, origin, ILP and timings), the device mesh, the
    sharding of parameters and activations, memory per stage, the pipeline schedule, the
    collectives, and the runner-ups. No network access is needed to view it.

    Returns the HTML text; with `path`, also writes it there.

    Example:
        >>> plan = step.get_plan(state, batch)
        >>> autopar.report(plan, "plan.html")     # open plan.html in a browser
    """
    _check(plan)
    title = f"autopar plan: {plan.method} on {_mesh_text(plan)}"
    html = ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>{escape(title)}</title><style>{CSS}</style></head><body>"
            + _header(plan) + _mesh(plan) + _memory(plan) + _timeline(plan)
            + _collectives(plan) + _runner_ups(plan) + _sharding(plan) + PRINT_JS
            + "<footer class=\"note\">Generated by autopar.report from the plan alone; all "
              "times and bytes are the cost model's predictions unless marked measured or "
              "compiled.</footer></body></html>\n")
    if path is not None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(html)
        log.info("autopar: wrote the plan report to %s", path)
    return html
