"""Inspect pass: a human-readable dump of a `ParallelPlan` (text or markdown).

The default dump is concise: the heaviest operators first, repeated layers folded into one
row (`block_{0..11}` x12), each parameter's optimizer state on its row, results that keep
their input's sharding counted in one line. `full=True` lists every leaf, result, operator
and collective.

Example:
    >>> print(autopar.dump(train_step.get_plan(state, batch)))
    >>> print(autopar.dump(plan, full=True, style="markdown"))
"""
from __future__ import annotations

import collections
import warnings

from autopar.core._format import Heading, Table, id_range, mesh_text, render, runner_up_text
from autopar.core._format import format_bytes as _bytes
from autopar.core._format import format_time as _time
from autopar.core.errors import InvalidArgumentError
from autopar.core.plan import CollectivePlan, ParallelPlan
from autopar.core.spec import format_spec
from autopar.tools.fold import fold, kept_results, pair_optimizer_state

STYLES = ("text", "markdown")
CONCISE_OPERATORS = 8      # operator rows (folded) of the concise dump, per stage
CONCISE_COLLECTIVES = 5     # collective rows (folded) of the concise dump, per stage


def dump(plan: ParallelPlan, *, max_operators: int | None = None, max_rows: int | None = None,
         full: bool = False, style: str = "text", stage: int | None = None) -> str:
    """A description of a plan: mesh, predicted costs, state shardings, the heaviest
    operators with their strategies and source lines, the predicted collectives and every
    fallback applied.

    Args:
      full: every leaf, result, operator and collective, one row each. The default is
        concise (~60 lines for a small GPT): repeated layers folded into one row
        (`block_{0..1}` x2), the optimizer state on its parameter's row, replicated leaves
        and results that keep their input's sharding counted in one line, the heaviest
        operators and collectives (by predicted time) first.
      max_operators: operator rows shown (per stage); default all with `full`, else 8.
      max_rows: clips the state, result and collective tables (first rows, a count, the
        last row). A negative value warns and means no limit (as None).
      style: "text" (aligned columns) or "markdown" (headings and pipe tables).
      stage: a pipeline plan's stage: only its leaves, results, operators and collectives.

    An operator inside a loop body is listed once, as it runs, with its runs per step
    (`dot_general x12`); its compute time is over all of them.

    Example:
        >>> print(autopar.dump(plan))                      # concise
        >>> print(autopar.dump(plan, full=True, stage=1, style="markdown"))
    """
    if not isinstance(plan, ParallelPlan):
        raise InvalidArgumentError(
            f"autopar.dump(plan=...) got {type(plan).__name__}; pass a ParallelPlan. Fix: "
            "step.get_plan(state, batch), autopar.plan(...) or ParallelPlan.from_json(text).")
    max_operators = _limit("max_operators", max_operators)
    max_rows = _limit("max_rows", max_rows)
    if style not in STYLES:
        raise InvalidArgumentError(f"autopar.dump: style={style!r} is not one of {STYLES}. "
                                   "Fix: pass style='text' or style='markdown'.")
    stage = _stage_arg(plan, stage)
    blocks = _overview(plan, stage) + [""]
    blocks += _inputs(plan, stage, full, max_rows) + [""]
    blocks += _results(plan, stage, full, max_rows) + [""]
    stages = range(len(plan.stages)) if stage is None else [stage]
    for s in stages if plan.pipeline else [None]:
        ops, colls = plan.stage_parts(s)
        blocks += _operators(plan, s, ops, full, max_operators) + [""]
        blocks += _collectives(plan, s, colls, full, max_rows) + [""]
    blocks += _fallbacks(plan)
    if not full:
        blocks += ["", "(concise: repeated layers folded, the lightest rows left out; "
                   "autopar.dump(plan, full=True) lists every row)"]
    return render(blocks, style)


def _runner_ups(plan: ParallelPlan) -> list[str]:
    """Why this plan: the runner-ups' predicted steps as multiples of this plan's."""
    if not plan.alternatives:
        return []
    return ["  why this plan: runner-ups' predicted steps (same cost model) "
            + ", ".join(runner_up_text(a, plan.predicted_step_s) for a in plan.alternatives[:4])
            + (f", ... {len(plan.alternatives) - 4} more" if len(plan.alternatives) > 4 else "")]


def _limit(name: str, value):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(f"autopar.dump: {name}={value!r} is not an int or None. "
                                   f"Fix: pass a row count, e.g. {name}=10, or None for all.")
    if value < 0:
        warnings.warn(f"autopar.dump: {name}={value} is negative; showing every row (as "
                      f"{name}=None). Fix: pass None for every row or a count >= 0.",
                      UserWarning, stacklevel=3)
        return None
    return value


def _stage_arg(plan: ParallelPlan, stage):
    if stage is None:
        return None
    n = len(plan.stages)
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < max(n, 1):
        raise InvalidArgumentError(
            f"autopar.dump: stage={stage!r} is out of range: the plan has {n} stage(s), "
            f"numbered 0..{max(n - 1, 0)}. Fix: pass stage=i with 0 <= i < {n}, or None for "
            "the whole plan.")
    return stage


def search_record(plan: ParallelPlan) -> str:
    """Where the plan came from and the search that produced it, e.g. "plan cache (looked up
    in 2.0 ms); searched 2026-11-24T10:00:00+00:00 in 8.5 s: 81 ILPs solved, 12 reused"."""
    text = plan.origin
    if "plan_lookup" in plan.timings_s:
        text += f" (looked up in {_time(plan.timings_s['plan_lookup'])}; no search)"
    searched = sum(v for k, v in plan.timings_s.items() if k != "plan_lookup")
    p = plan.pipeline
    ilps = (f"{p['num_ilps']} ILPs solved, {p.get('num_reused', 0)} reused"
            if p.get("num_ilps") is not None else
            f"{plan.ilp.get('num_ilps', 1)} ILP" if plan.ilp else "")
    if plan.searched_at or searched:
        text += "; searched" + (f" {plan.searched_at}" if plan.searched_at else "") + \
            (f" in {_time(searched)}" if searched else "") + (f": {ilps}" if ilps else "")
    return text


def _overview(plan: ParallelPlan, stage) -> list:
    lines = [Heading(f"autopar plan  method={plan.method}  cluster={plan.cluster}"),
             f"mesh: {mesh_text(plan.axis_names, plan.mesh_shape)}  "
             f"devices={list(plan.device_ids)}",
             f"plan from: {search_record(plan)}", "",
             "predicted per step (per device):",
             f"  compute {_time(plan.predicted_compute_s)}   communication "
             f"{_time(plan.predicted_comm_s)}   resharding {_time(plan.predicted_reshard_s)}"
             + (f"   call overhead {_time(plan.predicted_overhead_s)}"
                if plan.predicted_overhead_s else "")
             + f"   total {_time(plan.predicted_step_s)}",
             f"  peak memory {_bytes(plan.peak_memory_bytes)} of budget "
             f"{_bytes(plan.memory_budget_bytes)}"]
    lines += _runner_ups(plan)
    if plan.remat and set(plan.remat["layers"]) == {"none"}:
        lines.append("  rematerialization: only the step's own jax.checkpoint blocks, tied to "
                     "the backward pass so that XLA recomputes them where it needs them")
    elif plan.remat:
        bounds, layers = plan.remat["layer_boundaries"], plan.remat["layers"]
        lines.append("  rematerialization (loss layers, forward operators): " + ", ".join(
            f"{a}..{b - 1} {c}" for a, b, c in zip(bounds, bounds[1:], layers)))
    m = plan.measured
    if m.get("compiled_bytes") is not None:
        lines.append(f"  compiled by XLA to {_bytes(m['compiled_bytes'])} per device "
                     f"(memory_analysis; predicted / compiled "
                     f"{plan.peak_memory_bytes / max(m['compiled_bytes'], 1):.2f}; checked "
                     f"against the budget, {m.get('memory_check_rounds', 0)} re-plan(s))")
    if "step_s" in m:
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
        shared = [p for p in ilp.get("message", "").split("; ") if "shared resharded" in p]
        if shared:          # intra_op.copies: what the shared ILP did
            lines.append(f"  {shared[0]}")
        if ilp["status"] not in ("optimal", "trivial"):
            lines.append(f"  NOTE: {ilp['message']}")
    if plan.pipeline:
        lines += _pipeline_lines(plan, stage)
    if plan.timings_s:
        lines.append("timings: " + ", ".join(f"{k} {_time(v)}" for k, v in plan.timings_s.items()))
    return lines


def _form(p: dict) -> str:
    """How a one-mesh accumulation runs (plans saved before it was recorded say nothing)."""
    if "one_executable" not in p:
        return ""
    return (", all in one executable (a loop over the microbatches)" if p["one_executable"]
            else ", one executable per microbatch")


def _pipeline_lines(plan: ParallelPlan, stage) -> list:
    """The stages of a pipeline plan, its schedule and the stage search."""
    p = plan.pipeline
    local, total = sum(p.get("local_gradients", ())), sum(p.get("num_gradients", ()))
    reduced = (f"; {local} of {total} parameter gradients accumulate as per-device partial "
               "sums, reduced once per step" if local else "")
    if p.get("microbatch_combine"):      # per loss output: mean, sum, ratio, concat, unknown
        reduced += "; loss outputs over microbatches: " + ", ".join(p["microbatch_combine"])
    compiled = plan.measured.get("compiled_stage_bytes") or [None] * len(plan.stages)
    forward = p.get("forward_only", False)
    if not plan.is_pipeline and forward:      # a forward in microbatches on one mesh
        s = plan.stages[0]
        return [f"forward only (no gradient): {p['num_microbatches']} microbatch(es) through "
                f"one stage ({_time(s.latency_s)} each, predicted){_form(p)}; predicted step "
                f"{_time(p['predicted_latency_s'])}, peak memory "
                f"{_bytes(s.peak_memory_bytes)} per device{reduced}"]
    if not plan.is_pipeline:           # gradient accumulation on one mesh
        s = plan.stages[0]
        return [f"gradient accumulation: {p['num_microbatches']} microbatch(es) of "
                f"forward+backward ({_time(s.latency_s)} each, predicted) into one gradient, "
                f"then the update{_form(p)}; predicted step "
                f"{_time(p['predicted_latency_s'])}, peak memory "
                f"{_bytes(s.peak_memory_bytes)} per device"
                + (f" (compiled by XLA to {_bytes(compiled[0])})" if compiled[0] else "")
                + f"; remat {s.remat}{reduced}"] + _compiled_stages_line(plan)
    lines = [f"pipeline: {len(plan.stages)} stage(s) over {p['num_layers']} layer(s); schedule "
             f"{p['schedule']}, {p['num_microbatches']} microbatch(es), predicted bubble "
             f"{p['bubble_fraction']:.1%}, predicted step {_time(p['predicted_latency_s'])} "
             "(sum t_i + (B - 1) max t_i" + ("" if p["schedule"] in ("1f1b", "forward") else
                                             ", scaled by its table's simulated time over "
                                             "1F1B's") + ")"
             + ("; forward only (the step takes no gradient): nothing kept between stages' "
                "tasks, no gradient accumulator" if forward else "")]
    if p.get("schedule_search"):
        base = next((c for c in p["schedule_search"] if c["schedule"] == "1f1b"),  # chunks:
                    p["schedule_search"][0])        # vs the chosen one, on the same stages
        one = max(base["predicted_latency_s"], 1e-30)
        lines.append(f"schedules priced (Schedule.AUTO), predicted step vs {base['schedule']}: "
                     + ", ".join(f"{c['schedule']} {c['predicted_latency_s'] / one:.3f}x" + (
                         "" if c["fits"] else
                         f" (needs {_bytes(c['peak_memory_bytes'])}: does not fit)")
                         for c in p["schedule_search"]))
    rows = []
    for s, q, c in zip(plan.stages, p["in_flight"], compiled):
        if stage is not None and s.index != stage:
            continue
        rows.append((str(s.index), f"{s.layers[0]}..{s.layers[1]}", id_range(s.device_ids),
                     "x".join(map(str, s.submesh)),
                     mesh_text(s.axis_names, s.logical_mesh_shape),
                     _time(s.latency_s), str(q), s.remat + (" +zero" if s.zero else ""),
                     _bytes(s.peak_memory_bytes), _bytes(c) if c is not None else "-",
                     ", ".join(s.scopes[:3]) + (" ..." if len(s.scopes) > 3 else "")))
    lines.append(Table("", ("stage", "layers", "devices", "submesh", "logical mesh",
                            "fwd+bwd/mb", "in flight", "remat/zero", "peak mem", "compiled",
                            "model code"), rows))
    lines += _compiled_stages_line(plan)
    scale = p["predicted_latency_s"] / max(sum(s.latency_s for s in plan.stages), 1e-30)
    lines.append(f"  communication per step {_time(plan.predicted_comm_s)} = {scale:.3f} (step / "
                 "sum of the stages' fwd+bwd) x the stages' per microbatch: " + " + ".join(
                     _time(s.comm_s) for s in plan.stages))
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


def _shape(shape) -> str:
    return "x".join(map(str, shape)) or "scalar"


def _in_stage(leaves, plan: ParallelPlan, stage):
    return [t for t in leaves if stage is None or not plan.pipeline or t.stage == stage]


def _inputs(plan: ParallelPlan, stage, full: bool, max_rows) -> list:
    names, staged = plan.axis_names, bool(plan.pipeline)
    leaves = _in_stage(plan.inputs, plan, stage)
    spec = lambda s: format_spec(s, names)
    if full:
        rows = [(t.path, t.role, _shape(t.shape), t.dtype, spec(t.spec))
                + ((str(t.stage),) if staged else ()) for t in leaves]
        return [Table("state and inputs", ("leaf", "role", "shape", "dtype", "sharding")
                      + (("stage",) if staged else ()), rows, clip=max_rows)]
    params = [t for t in leaves if t.role == "param"]
    paired, unpaired = pair_optimizer_state(params, [t for t in leaves if t.role == "opt_state"])
    items = [(t, tuple(sorted(collections.Counter(
        (spec(o.spec), slot) for slot, o in paired.get(i, ())).items()))) if t.role == "param"
        else (t, ()) for i, t in enumerate(params)]
    items += [(t, ()) for t in leaves if t.role not in ("param", "opt_state")] + \
        [(t, ()) for t in unpaired]
    items.sort(key=lambda it: it[0].index)

    def opt_text(opt) -> str:
        by_spec: dict[str, list[str]] = {}
        for (s, slot), _ in opt:
            by_spec.setdefault(s, []).append(slot)
        return "; ".join(f"{','.join(slots)} {s}" for s, slots in by_spec.items()) or "-"
    groups = fold(items, lambda it: it[0].path,
                  lambda it: (it[0].role, it[0].shape, it[0].dtype, it[0].spec, it[1],
                              it[0].stage))
    replicated = lambda g: (not any(a for d in g.items[0][0].spec for a in d)
                            and all(s.strip("[]").replace("-", "").replace(",", "").strip() == ""
                                    for (s, _), _ in g.items[0][1]))
    shown = [g for g in groups if not replicated(g) or g.items[0][0].role == "batch"]
    rest = [g for g in groups if g not in shown]
    rows = [(g.name, f"x{g.count}" if g.count > 1 else "", g.items[0][0].role,
             _shape(g.items[0][0].shape), g.items[0][0].dtype, spec(g.items[0][0].spec),
             opt_text(g.items[0][1])) + ((str(g.items[0][0].stage),) if staged else ())
            for g in shown]
    notes = []
    if rest:
        n = sum(g.count * (1 + sum(c for _, c in g.items[0][1])) for g in rest)
        names_ = ", ".join(g.name for g in rest[:3]) + (", ..." if len(rest) > 3 else "")
        notes.append(f"+ {n} leaves replicated on every device ({len(rest)} rows): {names_}")
    return [Table(f"state and inputs ({len(leaves)} leaves; repeated layers folded, optimizer "
                  "state on its parameter's row)",
                  ("leaf", "x", "role", "shape", "dtype", "sharding", "optimizer state")
                  + (("stage",) if staged else ()), rows, notes, clip=max_rows)]


def _results(plan: ParallelPlan, stage, full: bool, max_rows) -> list:
    names = plan.axis_names
    outs = _in_stage(plan.outputs, plan, stage)
    if full:
        rows = [(t.path, _shape(t.shape), format_spec(t.spec, names)) for t in outs]
        return [Table("results", ("result", "shape", "sharding"), rows, clip=max_rows)]
    shown, kept = kept_results(_in_stage(plan.inputs, plan, stage), outs)
    groups = fold(shown, lambda t: t.path, lambda t: (t.shape, t.spec))
    rows = [(g.name, f"x{g.count}" if g.count > 1 else "", _shape(g.items[0].shape),
             format_spec(g.items[0].spec, names)) for g in groups]
    notes = [f"+ {len(kept)} results keep their input's sharding (the next state)"] if kept else []
    return [Table(f"results ({len(outs)})", ("result", "x", "shape", "sharding"), rows, notes,
                  clip=max_rows)]


def _where(plan: ParallelPlan, stage) -> str:
    if stage is None:
        return ""
    s = plan.stages[stage]
    work = "forward" if plan.pipeline.get("forward_only") else "forward + backward"
    return (f" of stage {stage} ({mesh_text(s.axis_names, s.logical_mesh_shape)}; one "
            f"microbatch's {work})")


def _operators(plan: ParallelPlan, stage, ops, full: bool, max_operators) -> list:
    names = plan.axis_names if stage is None else plan.stages[stage].axis_names
    where = _where(plan, stage)
    if full:
        shown = ops if max_operators is None else ops[:max_operators]
        rows = [(o.node, o.primitive + (f" x{o.trips}" if o.trips > 1 else ""),
                 _shape(o.out_shape), o.strategy, format_spec(o.out_spec, names),
                 o.communication or "-", _time(o.compute_s), o.name_stack or "-", o.source)
                for o in shown]
        notes = [f"... {len(ops) - len(shown)} more"] if len(shown) < len(ops) else []
        return [Table(f"heavy operators{where} ({len(ops)})", ("node", "op", "out shape",
                      "strategy", "out", "collective", "compute", "scope", "source"), rows,
                      notes)]
    groups = fold(ops, lambda o: o.name_stack or "-",
                  lambda o: (o.primitive, o.trips, o.out_shape, o.strategy, o.out_spec,
                             o.communication, o.source))
    cost = lambda g: sum(o.compute_s + o.comm_s for o in g.items)
    groups.sort(key=lambda g: -cost(g))
    n = CONCISE_OPERATORS if max_operators is None else max_operators
    rows = [(g.items[0].primitive + (f" x{g.items[0].trips}" if g.items[0].trips > 1 else ""),
             f"x{g.count}" if g.count > 1 else "", _shape(g.items[0].out_shape),
             g.items[0].strategy, format_spec(g.items[0].out_spec, names),
             g.items[0].communication or "-", _time(cost(g)), g.name, g.items[0].source)
            for g in groups[:n]]
    notes = []
    if len(groups) > n:
        left = groups[n:]
        notes.append(f"... {len(left)} more rows ({sum(g.count for g in left)} operators, "
                     f"{_time(sum(map(cost, left)))} of {_time(sum(map(cost, groups)))})")
    return [Table(f"heaviest operators{where} ({len(ops)} in {len(groups)} rows, by predicted "
                  "compute + communication)", ("op", "x", "out shape", "strategy", "out",
                                               "collective", "time", "scope", "source"),
                  rows, notes)]


def _how(c: CollectivePlan) -> str:
    """Where a collective comes from, as the dump's "from" column: "resharding", or the
    algorithm its strategy was priced with ("strategy" when not named)."""
    return ("resharding" if c.is_reshard else "strategy" if c.algorithm == "-"
            else c.algorithm)


def _collectives(plan: ParallelPlan, stage, colls, full: bool, max_rows) -> list:
    """The summary line of the predicted collectives, then a table: the resharding ones
    (full) or the heaviest of all, folded (concise), with the totals they add up to."""
    names = plan.axis_names if stage is None else plan.stages[stage].axis_names
    kinds: dict[str, collections.Counter] = {}
    nbytes: collections.Counter = collections.Counter()
    for c in colls:      # detail: "all-reduce(data) 4 B ring" (algorithm last)
        kinds.setdefault(c.kind, collections.Counter())[_how(c)] += 1
        nbytes[c.kind] += c.nbytes
    where = _where(plan, stage)
    lines = [f"predicted collectives{where}: " + (", ".join(
        f"{sum(n.values())} x {k} ({', '.join(f'{a} {m}' for a, m in n.most_common())}; "
        f"{_bytes(nbytes[k])})" for k, n in kinds.items()) or "none")
        + " (XLA combines independent all-reduces and all-gathers)"]
    strategy_s = sum(c.comm_s for c in colls if not c.is_reshard)
    reshard_s = sum(c.comm_s for c in colls if c.is_reshard)
    comm, resh = ((plan.predicted_comm_s, plan.predicted_reshard_s) if stage is None else
                  (plan.stages[stage].comm_s, plan.stages[stage].reshard_s))
    total = (f"rows total {_time(strategy_s + reshard_s)}: strategies {_time(strategy_s)} "
             f"(communication {_time(comm)} stated), resharding {_time(reshard_s)} (the ILP's "
             f"resharding estimate {_time(resh)})")
    what = lambda c: (c.detail.split(" reshard ", 1)[1] if c.is_reshard
                      else f"{c.primitive} {c.name_stack or '-'}")
    if full:
        reshards = [c for c in colls if c.is_reshard]
        if reshards:
            rows = [(c.kind, "*".join(c.axes), _bytes(c.nbytes), f"{format_spec(c.src, names)}"
                     f" -> {format_spec(c.dst, names)}", what(c), c.source or "-")
                    for c in reshards]
            lines.append(Table(f"resharding collectives{where} ({len(reshards)})",
                               ("kind", "axes", "bytes", "layout", "what", "source"), rows,
                               clip=max_rows))
        return lines
    if not colls:
        return lines
    groups = fold(colls, what, lambda c: (c.kind, c.axes, c.nbytes, c.src, c.dst, c.source,
                                          _how(c)))
    cost = lambda g: sum(c.comm_s for c in g.items)
    groups.sort(key=lambda g: -cost(g))
    n = CONCISE_COLLECTIVES if max_rows is None else max_rows
    rows = [(g.items[0].kind, f"x{g.count}" if g.count > 1 else "", "*".join(g.items[0].axes),
             _bytes(g.items[0].nbytes), _time(cost(g)), _how(g.items[0]),
             f"{format_spec(g.items[0].src, names)} -> {format_spec(g.items[0].dst, names)}",
             g.name, g.items[0].source or "-") for g in groups[:n]]
    notes = ([f"... {len(groups) - n} more rows ({sum(g.count for g in groups[n:])} "
              f"collectives, {_time(sum(map(cost, groups[n:])))})"] if len(groups) > n
             else []) + [total]
    lines.append(Table(f"heaviest collectives{where} ({len(colls)} in {len(groups)} rows, by "
                       "predicted time)", ("kind", "x", "axes", "bytes", "time", "from",
                                           "layout", "what", "source"), rows, notes))
    return lines


def _fallbacks(plan: ParallelPlan) -> list[str]:
    if not plan.fallbacks:
        return ["fallbacks: none (every operator had a sharding rule)"]
    return [f"fallbacks ({len(plan.fallbacks)}):"] + [
        f"  node {f.node} {f.primitive} at {f.source}: {f.reason}"
        + (f" ({_bytes(f.replicated_bytes)} whole on every device)" if f.replicated_bytes
           else "") for f in plan.fallbacks]


def summary(plan: ParallelPlan) -> str:
    """Five lines: method, mesh and devices; the predicted step and its parts; memory against
    the budget (and as compiled, where checked); the pipeline's stages and schedule, or the
    heaviest collectives; where the plan came from and its search.

    Example:
        >>> print(autopar.summary(plan))
        shard_parallel on data=2 x model=4 (8 devices, one mesh, cluster cpu:cpu)
        ...
    """
    p = plan.pipeline
    kind = (f"{len(plan.stages)}-stage pipeline" if plan.is_pipeline else
            "gradient accumulation" if p else "one mesh")
    parts = [f"compute {_time(plan.predicted_compute_s)}",
             f"communication {_time(plan.predicted_comm_s)}",
             f"resharding {_time(plan.predicted_reshard_s)}"]
    if plan.predicted_overhead_s:
        parts.append(f"call overhead {_time(plan.predicted_overhead_s)}")
    memory = (f"peak memory {_bytes(plan.peak_memory_bytes)} per device of "
              f"{_bytes(plan.memory_budget_bytes)} "
              f"({plan.peak_memory_bytes / max(plan.memory_budget_bytes, 1):.0%})")
    compiled = plan.measured.get("compiled_bytes") or max(
        plan.measured.get("compiled_stage_bytes") or [0])
    if compiled:
        memory += f"; compiled by XLA to {_bytes(compiled)}"
    if "step_s" in plan.measured:
        memory += f"; measured step {_time(plan.measured['step_s'])}"
    if plan.is_pipeline:
        fourth = (f"pipeline: {len(plan.stages)} stages over {p['num_layers']} layers, "
                  f"schedule {p['schedule']}, {p['num_microbatches']} microbatches, bubble "
                  f"{p['bubble_fraction']:.1%}, slowest stage "
                  f"{_time(max(s.latency_s for s in plan.stages))} per microbatch")
    else:
        by_kind: dict[str, float] = collections.defaultdict(float)
        colls = plan.collectives or [c for s in range(len(plan.stage_solutions))
                                     for c in plan.stage_parts(s)[1]]
        for c in colls:
            by_kind[f"{c.kind} over {'*'.join(c.axes) or '-'}"] += c.comm_s
        heavy = sorted(by_kind.items(), key=lambda kv: -kv[1])[:3]
        fourth = (f"{p['num_microbatches']} microbatches; " if p else "") + "heaviest " \
            "collectives: " + (", ".join(f"{k} {_time(t)}" for k, t in heavy) if heavy
                               else "none")
    return "\n".join([
        f"{plan.method} on {mesh_text(plan.axis_names, plan.mesh_shape)} "
        f"({len(plan.device_ids)} devices, {kind}, cluster {plan.cluster})",
        f"predicted step {_time(plan.predicted_step_s)}: " + ", ".join(parts),
        memory, fourth, f"plan from {search_record(plan)}"])
