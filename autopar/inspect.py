"""Inspect pass: a human-readable text dump of a `ParallelPlan`.

Example:
    >>> print(autopar.dump(train_step.get_plan(state, batch)))
"""
from __future__ import annotations

import collections

from ._format import format_bytes as _bytes, format_time as _time
from .plan import ParallelPlan
from .spec import format_spec


def _table(rows: list[tuple[str, ...]], header: tuple[str, ...],
           max_rows: int | None = None) -> list[str]:
    """Aligned columns; with `max_rows`, the first rows, a count of those left out, and the
    last row."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*map(str, r)).rstrip() for r in rows]
    if max_rows is not None and len(lines) > max_rows + 1:
        lines = lines[:max_rows] + [f"... {len(lines) - max_rows - 1} more"] + lines[-1:]
    return [fmt.format(*header).rstrip(), fmt.format(*("-" * w for w in widths))] + lines


def _pipeline_lines(plan: ParallelPlan) -> list[str]:
    """The stages of a pipeline plan, its schedule and the stage search."""
    p = plan.pipeline
    local, total = sum(p.get("local_gradients", ())), sum(p.get("num_gradients", ()))
    reduced = (f"; {local} of {total} parameter gradients accumulate as per-device partial "
               "sums, reduced once per step" if local else "")
    if p.get("microbatch_combine"):      # per loss output: mean, sum, ratio, concat, unknown
        reduced += "; loss outputs over microbatches: " + ", ".join(p["microbatch_combine"])
    compiled = plan.measured.get("compiled_stage_bytes") or [None] * len(plan.stages)
    if p.get("gradient_accumulation"):
        s = plan.stages[0]
        return [f"gradient accumulation: {p['num_microbatches']} microbatch(es) of "
                f"forward+backward ({_time(s.latency_s)} each, predicted) into one gradient, "
                f"then the update; predicted step {_time(p['predicted_latency_s'])}, peak "
                f"memory {_bytes(s.peak_memory_bytes)} per device"
                + (f" (compiled by XLA to {_bytes(compiled[0])})" if compiled[0] else "")
                + f"; remat {s.remat}{reduced}"] + _compiled_stages_line(plan)
    lines = [f"pipeline: {len(plan.stages)} stage(s) over {p['num_layers']} layer(s); schedule "
             f"{p['schedule']}, {p['num_microbatches']} microbatch(es), predicted bubble "
             f"{p['bubble_fraction']:.1%}, predicted step {_time(p['predicted_latency_s'])} "
             "(sum t_i + (B - 1) max t_i)"]
    rows = []
    for s, q, c in zip(plan.stages, p["in_flight"], compiled):
        devs = f"{s.device_ids[0]}..{s.device_ids[-1]}" if len(s.device_ids) > 1 else \
            str(s.device_ids[0])
        rows.append((str(s.index), f"{s.layers[0]}..{s.layers[1]}", devs,
                     "x".join(map(str, s.submesh)),
                     " x ".join(f"{n}={k}" for n, k in zip(s.axis_names, s.logical_mesh_shape)),
                     _time(s.latency_s), str(q), s.remat + (" +zero" if s.zero else ""),
                     _bytes(s.peak_memory_bytes), _bytes(c) if c is not None else "-",
                     ", ".join(s.scopes[:3]) + (" ..." if len(s.scopes) > 3 else "")))
    lines += ["  " + r for r in _table(rows, ("stage", "layers", "devices", "submesh",
                                               "logical mesh", "fwd+bwd/mb", "in flight",
                                               "remat/zero", "peak mem", "compiled",
                                               "model code"))]
    lines += _compiled_stages_line(plan)
    lines.append(f"  stage search: {p['stage_option']}, {p['layer_option']}; {p['num_ilps']} "
                 f"ILPs solved, {p['num_reused']} reused; DP tried {p['dp_candidates']} t_max "
                 f"values, pruned {p['dp_pruned']}, in {_time(p['dp_time_s'])}; apply-gradient "
                 f"in {p['segments'] - 1} segment(s){reduced}")
    return lines


def _compiled_stages_line(plan: ParallelPlan) -> list[str]:
    """The stages' compiled peaks (pipeline_memory_check), where the plan was checked."""
    got = plan.measured.get("compiled_stage_bytes")
    if not got:
        return []
    ratios = ", ".join(f"{s.peak_memory_bytes / max(c, 1):.2f}" for s, c in zip(plan.stages, got))
    return [f"  compiled by XLA (memory_analysis of each stage's executables, composed per "
            f"stage): predicted / compiled {ratios}; checked against the budget, "
            f"{plan.measured.get('memory_check_rounds', 0)} re-plan(s)"]


def dump(plan: ParallelPlan, *, max_operators: int | None = None,
         max_rows: int | None = None) -> str:
    """Text description of a plan: mesh, state shardings, heavy-operator strategies with
    their source lines, predicted costs, ILP statistics and every fallback applied.

    `max_operators` keeps the first heavy operators; `max_rows` clips the state and result
    tables (an Adam-trained model has three state rows per parameter). An operator inside a
    loop body is listed once, as it runs, with its runs per step (`dot_general x12`); its
    compute time is over all of them.

    Example:
        >>> print(autopar.dump(plan, max_operators=12, max_rows=14))
    """
    names = plan.axis_names
    lines = [f"autopar plan  method={plan.method}  cluster={plan.cluster}",
             "mesh: " + " x ".join(f"{n}={s}" for n, s in zip(names, plan.mesh_shape))
             + f"  devices={list(plan.device_ids)}",
             f"plan from: {plan.origin}" + (f" (looked up in {_time(plan.timings_s['plan_lookup'])};"
                                            " no search)" if "plan_lookup" in plan.timings_s
                                            else ""), ""]
    lines.append("predicted per step (per device):")
    lines.append(f"  compute {_time(plan.predicted_compute_s)}   communication "
                 f"{_time(plan.predicted_comm_s)}   resharding {_time(plan.predicted_reshard_s)}"
                 + (f"   call overhead {_time(plan.predicted_overhead_s)}"
                    if plan.predicted_overhead_s else "")
                 + f"   total {_time(plan.predicted_step_s)}")
    lines.append(f"  peak memory {_bytes(plan.peak_memory_bytes)} of budget "
                 f"{_bytes(plan.memory_budget_bytes)}")
    if plan.remat:
        bounds, layers = plan.remat["layer_boundaries"], plan.remat["layers"]
        lines.append("  rematerialization (loss layers, forward operators): " + ", ".join(
            f"{a}..{b - 1} {c}" for a, b, c in zip(bounds, bounds[1:], layers)))
    if plan.measured.get("compiled_bytes") is not None:
        m = plan.measured
        lines.append(f"  compiled by XLA to {_bytes(m['compiled_bytes'])} per device "
                     f"(memory_analysis; predicted / compiled "
                     f"{plan.peak_memory_bytes / max(m['compiled_bytes'], 1):.2f}; checked "
                     f"against the budget, {m.get('memory_check_rounds', 0)} re-plan(s))")
    if "step_s" in plan.measured:
        m = plan.measured
        peak = m.get("peak_bytes")
        lines.append(f"measured (autopar.calibrate, {m.get('steps', '?')} steps): step "
                     f"{_time(m['step_s'])} vs predicted {_time(plan.predicted_step_s)} "
                     f"({plan.predicted_step_s / m['step_s'] - 1:+.0%}); peak memory "
                     + (f"{_bytes(peak)}" if peak is not None else "not reported by the backend"))
    ilp = plan.ilp
    if ilp:
        lines.append(f"ILP: {ilp['num_groups']} strategy groups, {ilp['num_edges']} edges, "
                     f"{ilp['num_memory_points']} memory points -> {ilp['num_variables']} "
                     f"variables, {ilp['num_constraints']} constraints; backend {ilp['backend']}, "
                     f"status {ilp['status']}, build {_time(ilp['build_time_s'])}, solve "
                     f"{_time(ilp['solve_time_s'])}")
        if ilp.get("layer_reuse"):
            lines.append(f"  repeated layers: {ilp['layer_reuse']}")
        if ilp["status"] not in ("optimal", "trivial"):
            lines.append(f"  NOTE: {ilp['message']}")
    if plan.pipeline:
        lines += _pipeline_lines(plan)
    if plan.timings_s:
        lines.append("timings: " + ", ".join(f"{k} {_time(v)}" for k, v in plan.timings_s.items()))
    lines.append("")
    lines.append("state and inputs:")
    staged = bool(plan.pipeline)
    rows = [(t.path, t.role, "x".join(map(str, t.shape)) or "scalar", t.dtype,
             format_spec(t.spec, names)) + ((str(t.stage),) if staged else ())
            for t in plan.inputs]
    lines += ["  " + r for r in _table(rows, ("leaf", "role", "shape", "dtype", "sharding")
                                       + (("stage",) if staged else ()), max_rows)]
    lines.append("")
    lines.append("results:")
    rows = [(t.path, "x".join(map(str, t.shape)) or "scalar", format_spec(t.spec, names))
            for t in plan.outputs]
    lines += ["  " + r for r in _table(rows, ("result", "shape", "sharding"), max_rows)]
    lines.append("")
    ops = plan.operators if max_operators is None else plan.operators[:max_operators]
    lines.append(f"heavy operators ({len(plan.operators)}):")
    rows = [(o.node, o.primitive + (f" x{o.trips}" if o.trips > 1 else ""),
             "x".join(map(str, o.out_shape)), o.strategy,
             format_spec(o.out_spec, names), o.communication or "-", _time(o.compute_s),
             o.name_stack or "-", o.source) for o in ops]
    lines += ["  " + r for r in _table(rows, ("node", "op", "out shape", "strategy", "out",
                                               "collective", "compute", "scope", "source"))]
    if len(ops) < len(plan.operators):
        lines.append(f"  ... {len(plan.operators) - len(ops)} more")
    lines.append("")
    kinds: dict[str, collections.Counter] = {}
    nbytes: collections.Counter = collections.Counter()
    for c in plan.collectives:      # detail: "all-reduce(data) 4 B ring" (algorithm last)
        parts = c.detail.split(" ")
        how = "resharding" if " reshard " in c.detail else parts[3] if len(parts) == 4 \
            else "strategy"
        kinds.setdefault(c.kind, collections.Counter())[how] += 1
        nbytes[c.kind] += c.nbytes
    lines.append("predicted collectives: " + (", ".join(
        f"{sum(n.values())} x {k} ({', '.join(f'{a} {m}' for a, m in n.most_common())}; "
        f"{_bytes(nbytes[k])})" for k, n in kinds.items()) or "none")
        + " (XLA combines independent all-reduces and all-gathers)")
    reshards = [c for c in plan.collectives if " reshard " in c.detail]
    if reshards:
        rows = [(c.kind, "*".join(c.axes), _bytes(c.nbytes), f"{format_spec(c.src, names)} -> "
                 f"{format_spec(c.dst, names)}", c.detail.split(" reshard ", 1)[1],
                 c.source or "-") for c in reshards]
        lines.append(f"resharding collectives ({len(reshards)}):")
        lines += ["  " + r for r in _table(rows, ("kind", "axes", "bytes", "layout", "what",
                                                   "source"), max_rows)]
    if plan.fallbacks:
        lines.append(f"fallbacks ({len(plan.fallbacks)}):")
        for f in plan.fallbacks:
            lines.append(f"  node {f.node} {f.primitive} at {f.source}: {f.reason}"
                         + (f" ({_bytes(f.replicated_bytes)} whole on every device)"
                            if f.replicated_bytes else ""))
    else:
        lines.append("fallbacks: none (every operator had a sharding rule)")
    return "\n".join(lines)


def summary(plan: ParallelPlan) -> str:
    """Five lines: method and mesh; predicted step and its parts; memory against the budget;
    the heaviest collectives; where the plan came from (`ParallelPlan.summary`)."""
    mesh = " x ".join(f"{n}={s}" for n, s in zip(plan.axis_names, plan.mesh_shape))
    kind = (f"{len(plan.stages)}-stage pipeline" if plan.pipeline and
            not plan.pipeline.get("gradient_accumulation") else "one mesh")
    by_kind: dict[str, float] = collections.defaultdict(float)
    for c in plan.collectives:
        by_kind[f"{c.kind} over {'+'.join(c.axes) or '-'}"] += c.comm_s
    heavy = sorted(by_kind.items(), key=lambda kv: -kv[1])[:3]
    searched = sum(v for k, v in plan.timings_s.items() if k != "plan_lookup")
    return "\n".join([
        f"{plan.method} on {mesh} ({len(plan.device_ids)} devices, {kind}, cluster "
        f"{plan.cluster})",
        f"predicted step {_time(plan.predicted_step_s)}: compute "
        f"{_time(plan.predicted_compute_s)}, communication {_time(plan.predicted_comm_s)}, "
        f"resharding {_time(plan.predicted_reshard_s)}",
        f"peak memory {_bytes(plan.peak_memory_bytes)} per device of "
        f"{_bytes(plan.memory_budget_bytes)} "
        f"({plan.peak_memory_bytes / max(plan.memory_budget_bytes, 1):.0%})",
        "collectives: " + (", ".join(f"{k} {_time(t)}" for k, t in heavy) if heavy else "none"),
        f"from {plan.origin}" + (f"; searched {plan.searched_at}" if plan.searched_at else "")
        + f" in {_time(searched)}" + (f", {plan.ilp.get('num_ilps', 1)} ILP(s)"
                                      if plan.ilp else "")])
