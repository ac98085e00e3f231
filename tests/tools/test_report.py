"""Tests for autopar.report: the self-contained HTML plan report. Structure (sections, SVG
well-formed, no network references, the numbers of the plan) for a single-mesh and a 2-stage
pipeline plan on 8 CPU devices, and a headless Chromium load (skipped without chromium)."""
from __future__ import annotations

import dataclasses
import html.parser
import math
import re
import shutil
import subprocess
import xml.etree.ElementTree as ET

import jax
import numpy as np
import optax
import pytest

import autopar
from autopar.core._format import format_bytes, format_time
from autopar.core.enums import Schedule
from autopar.inter_op.schedule import make_schedule
from autopar.models.mlp import MLP, make_mlp_batch, mse_loss
from autopar.tools.report_data import optimizer_ratio
from support.steps import make_case, mesh_of

SECTIONS = ("summary", "mesh", "sharding", "memory", "timeline", "collectives", "runner-ups")
SVG_NS = "http://www.w3.org/2000/svg"


class _Page(html.parser.HTMLParser):
    """Element ids, every element's attributes by tag, and the text under each id'd section."""

    def __init__(self):
        super().__init__()
        self.ids: dict[str, str] = {}
        self.elements: list[tuple[str, dict]] = []
        self._open: list[str] = []
        self.text: dict[str, list[str]] = {}

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.elements.append((tag, a))
        if "id" in a:
            self.ids[a["id"]] = tag
        if tag in ("section", "header") and "id" in a:
            self._open.append(a["id"])
            self.text[a["id"]] = []

    def handle_endtag(self, tag):
        if tag in ("section", "header") and self._open:
            self._open.pop()

    def handle_data(self, data):
        for sec in self._open:
            self.text[sec].append(data)

    def section(self, ident: str) -> str:
        return " ".join(" ".join(self.text[ident]).split())


def _parse(text: str) -> _Page:
    page = _Page()
    page.feed(text)
    return page


def _svgs(text: str) -> dict[str, ET.Element]:
    """Each <svg> by its aria-label, parsed as XML (raises when one is not well-formed)."""
    out = {}
    for chunk in re.findall(r"<svg\b.*?</svg>", text, flags=re.S):
        root = ET.fromstring(chunk)
        assert root.tag == f"{{{SVG_NS}}}svg"
        out[root.get("aria-label")] = root
    return out


def _rects(svg: ET.Element, cls: str) -> list[ET.Element]:
    return [r for r in svg.iter(f"{{{SVG_NS}}}rect") if cls in (r.get("class") or "").split()]


@pytest.fixture(scope="module")
def case():
    return make_case("mlp", "linen", optax.adam(1e-3), num_layers=4,
                     value_and_grad=autopar.value_and_grad)


@pytest.fixture(scope="module")
def single_plan(case):
    step, state, batches = case
    return autopar.parallelize(step, mesh=mesh_of((2, 4))).get_plan(state, batches[0])


@pytest.fixture(scope="module")
def pipe_plan(case):
    step, state, batches = case
    method = autopar.PipeshardParallel(
        num_microbatches=4, schedule=autopar.Schedule.ONE_F_ONE_B,
        layer_option=autopar.AutoLayerOption(num_layers=4),
        stage_option=autopar.UniformStageOption(num_stages=2))
    return autopar.parallelize(step, mesh=mesh_of((2, 4)), method=method).get_plan(
        state, batches[0])


def _plan_with(case, schedule, stages):
    step, state, batches = case
    method = autopar.PipeshardParallel(
        num_microbatches=4, schedule=schedule,
        layer_option=autopar.AutoLayerOption(num_layers=4),
        stage_option=autopar.UniformStageOption(num_stages=stages))
    return autopar.parallelize(step, mesh=mesh_of((2, 4)), method=method).get_plan(
        state, batches[0])


@pytest.fixture(scope="module")
def zb_plan(case):
    return _plan_with(case, autopar.Schedule.ZERO_BUBBLE_H1, 2)


def test_zb_v_timeline_has_a_lane_per_device_group(case):
    """ZB-V: 4 stage chunks on 2 device groups, a lane each ("stages 0, 3" and "stages 1,
    2"); every F, B and W of every stage drawn in its group's lane."""
    plan = _plan_with(case, autopar.Schedule.ZERO_BUBBLE_V, 4)
    tl = _svgs(autopar.report(plan))["pipeline schedule"]
    text = ET.tostring(tl, encoding="unicode")
    assert "stages 0, 3" in text and "stages 1, 2" in text
    assert len(_rects(tl, "lane")) == 2
    for cls in ("fwd", "bwd", "wgt"):
        assert len(_rects(tl, cls)) == 4 * 4, cls


def _common_structure(plan, text: str) -> _Page:
    page = _parse(text)
    for ident in SECTIONS:
        assert ident in page.ids, f"section {ident!r} missing"
    svgs = _svgs(text)                     # every <svg> is well-formed XML
    assert {"device mesh", "memory per device"} <= set(svgs)
    refs = re.findall(r"(?:https?:)?//[^\s\"'<>)]+", text)
    assert set(refs) <= {SVG_NS}, f"external references: {set(refs) - {SVG_NS}}"
    assert not re.search(r"<(link|img|iframe|object|embed)\b|<script[^>]*\bsrc=", text)
    assert "@import" not in text and "url(" not in text
    assert format_time(plan.predicted_step_s) in page.section("summary")
    assert format_bytes(plan.peak_memory_bytes) in page.section("summary")
    assert format_bytes(plan.memory_budget_bytes) in page.section("memory")
    devices = _rects(svgs["device mesh"], "device")
    assert sorted(int(r.get("data-device")) for r in devices) == sorted(plan.device_ids)
    return page


def _html_section(text: str, ident: str) -> str:
    start = text.index(f'id="{ident}"')
    return text[start:text.index("</section>", start)]


def _parts(svg: ET.Element) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for r in _rects(svg, "part"):
        out.setdefault(r.get("data-part"), []).append(float(r.get("data-bytes")))
    return out


def test_single_mesh_report(single_plan, tmp_path):
    plan = single_plan
    path = tmp_path / "plan.html"
    text = autopar.report(plan, path)
    assert path.read_text() == text
    page = _common_structure(plan, text)
    svgs = _svgs(text)
    # one colour for a single mesh
    assert len({r.get("fill") for r in _rects(svgs["device mesh"], "device")}) == 1
    # memory: the parameters' bytes per device from the real arrays and their specs; the parts
    # add up to the predicted peak
    sizes = dict(zip(plan.axis_names, plan.mesh_shape))
    want = sum(math.prod(t.shape) * np.dtype(t.dtype).itemsize
               / math.prod(sizes[plan.axis_names[a]] for dim in t.spec for a in dim)
               for t in plan.inputs if t.role == "param")
    parts = _parts(svgs["memory per device"])
    assert parts["parameters"] == [pytest.approx(want)]
    assert sum(sum(v) for v in parts.values()) == pytest.approx(plan.peak_memory_bytes)
    # sharding: the four Dense layers folded into one row per leaf kind
    sharding = page.section("sharding")
    assert "state.params['params']['Dense_{0..3}']['kernel']" in sharding
    assert plan.operators and "dot_general" in sharding
    # collectives: grouped, the counts add up to the plan's
    counts = re.findall(r"<td>(?:all-reduce|all-gather|reduce-scatter|all-to-all)[^<]*</td>"
                        r"(?:<td>[^<]*</td>){3}<td class=num>(\d+)</td>", _html_section(
                            text, "collectives"))
    assert plan.collectives and sum(map(int, counts)) == len(plan.collectives)
    assert "No pipeline schedule" in page.section("timeline") or \
        "no pipeline schedule" in page.section("timeline")
    assert "The search recorded no runner-ups" in page.section("runner-ups")
    if plan.ilp:
        assert str(plan.ilp["num_variables"]) in page.section("summary")


def test_pipeline_report(pipe_plan):
    plan = pipe_plan
    assert len(plan.stages) == 2 and plan.stage_solutions
    text = autopar.report(plan)
    page = _common_structure(plan, text)
    svgs = _svgs(text)
    # mesh coloured by stage: one colour per stage, different stages different colours
    colour = {int(r.get("data-device")): r.get("fill")
              for r in _rects(svgs["device mesh"], "device")}
    per_stage = [{colour[d] for d in s.device_ids} for s in plan.stages]
    assert all(len(c) == 1 for c in per_stage) and per_stage[0] != per_stage[1]
    # timeline: every microbatch's forward and backward on every stage; the idle clocks are
    # the schedule's bubbles
    tl = svgs["pipeline schedule"]
    S, M = len(plan.stages), plan.pipeline["num_microbatches"]
    assert len(_rects(tl, "fwd")) == S * M and len(_rects(tl, "bwd")) == S * M
    table = make_schedule(Schedule(plan.pipeline["schedule"]), S, M)
    assert table.bubble_fraction == pytest.approx(plan.pipeline["bubble_fraction"])
    assert len(_rects(tl, "task")) == table.num_clocks * S * (1 - table.bubble_fraction)
    assert f"predicted bubble {plan.pipeline['bubble_fraction']:.1%}" in page.section("timeline")
    # memory: one bar per stage, parts from the stage solutions summing to each stage's peak
    bars = [r for r in _rects(svgs["memory per device"], "part")]
    ratio = optimizer_ratio(plan)
    assert ratio == pytest.approx(2.0)        # Adam: mu and nu per parameter
    for s, rec, q in zip(plan.stages, plan.stage_solutions, plan.pipeline["in_flight"]):
        mine = {r.get("data-part"): float(r.get("data-bytes")) for r in bars
                if f"stage {s.index} " in r.find(f"{{{SVG_NS}}}title").text}
        assert mine["parameters"] == pytest.approx(rec["param_bytes"])
        assert mine["optimizer state"] == pytest.approx(2.0 * rec["param_bytes"])
        assert mine["activations in flight"] == pytest.approx(q * s.activation_bytes)
        assert "not attributed" not in mine
        assert sum(mine.values()) == pytest.approx(s.peak_memory_bytes)
    # collectives: per stage, from the stage solutions, the counts adding up to theirs
    coll = _html_section(text, "collectives")
    for s, rec in enumerate(plan.stage_solutions):
        counts = re.findall(rf"<td>stage {s}</td><td>[^<]*</td>(?:<td>[^<]*</td>){{3}}"
                            r"<td class=num>(\d+)</td>", coll)
        assert sum(map(int, counts)) == len(rec["collectives"])
    assert any(rec["collectives"] for rec in plan.stage_solutions)
    sharding = page.section("sharding")
    assert "Stage 0: state and inputs" in sharding and "Stage 1: state and inputs" in sharding
    assert "Dense_{0..1}" in sharding and "Dense_{2..3}" in sharding


def test_runner_ups_table(single_plan):
    step, peak = single_plan.predicted_step_s, single_plan.peak_memory_bytes
    alts = ({"name": "DataParallel", "kind": "method", "predicted_step_s": 2 * step,
             "peak_memory_bytes": 3 * peak, "fits": True, "note": "replicated weights"},
            {"name": "2 stages x 4", "kind": "stage layout", "predicted_step_s": 1.5 * step,
             "peak_memory_bytes": 1e15, "fits": False, "note": "over budget"},
            {"name": "Zero3Parallel()", "kind": "method", "predicted_step_s": None,
             "peak_memory_bytes": None, "fits": None, "note": "not priced: out of time"})
    plan = dataclasses.replace(single_plan, alternatives=alts)
    text = autopar.report(plan)
    rows = re.findall(r"<tr[^>]*>(.*?)</tr>", _html_section(text, "runner-ups"),
                      flags=re.S)[1:]
    cells = [re.findall(r"<td[^>]*>(.*?)</td>", r) for r in rows]
    assert cells[0][0] == f"{plan.method} (chosen)" and cells[0][3] == "1.00"
    assert cells[1][:4] == ["DataParallel", "method", format_time(2 * step), "2.00"]
    assert cells[1][5:7] == ["3.00", "yes"]
    assert cells[2][3] == "1.50" and cells[2][6] == "no" and cells[2][7] == "over budget"
    assert cells[3] == ["Zero3Parallel()", "method"] + ["-"] * 5 + ["not priced: out of time"]
    assert "recorded no runner-ups" not in text


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or \
        shutil.which("google-chrome")


def _load(path) -> tuple[str, list[str]]:
    """(the DOM headless Chromium builds from `path`, its console messages)."""
    exe = _chromium()
    if exe is None:
        pytest.skip("no chromium on PATH (apt-get install chromium): browser test skipped")
    proc = subprocess.run([exe, "--headless", "--disable-gpu", "--no-sandbox",
                           "--enable-logging=stderr", "--v=0", "--dump-dom",
                           f"file://{path}"], capture_output=True, text=True, timeout=120)
    return proc.stdout, [line for line in proc.stderr.splitlines() if ":CONSOLE" in line]


def test_zero_bubble_timeline_draws_f_b_and_w(zb_plan):
    """A ZB-H1 plan's timeline: every F, B and W of every stage (W dashed, said in the
    legend), idle clocks only where the table has them, and the table's bubble stated."""
    plan = zb_plan
    text = autopar.report(plan)
    page = _common_structure(plan, text)
    tl = _svgs(text)["pipeline schedule"]
    S, M = len(plan.stages), plan.pipeline["num_microbatches"]
    assert plan.pipeline["schedule"] == "zb-h1"
    for cls in ("fwd", "bwd", "wgt"):
        assert len(_rects(tl, cls)) == S * M, cls
    table = make_schedule(Schedule.ZERO_BUBBLE_H1, S, M)
    assert len(_rects(tl, "task")) == 3 * S * M
    assert table.bubble_fraction == pytest.approx(plan.pipeline["bubble_fraction"])
    assert "W = weight gradient" in ET.tostring(tl, encoding="unicode")
    assert f"predicted bubble {plan.pipeline['bubble_fraction']:.1%}" in page.section("timeline")


@pytest.mark.parametrize("which", ["pipe_plan", "zb_plan"])
def test_report_loads_in_chromium(which, request, tmp_path):
    pipe_plan = request.getfixturevalue(which)
    bad = tmp_path / "bad.html"            # the check sees console errors
    bad.write_text("<!DOCTYPE html><html><body><script>console.error('boom')</script>"
                   "</body></html>")
    assert any("boom" in line for line in _load(bad)[1])
    path = tmp_path / "plan.html"
    autopar.report(pipe_plan, path)
    dom, console = _load(path)
    assert console == [], console
    for ident in SECTIONS:
        assert f'id="{ident}"' in dom
    assert dom.count('class="device"') == len(pipe_plan.device_ids)


def test_gradient_accumulation_report(case):
    """One mesh, microbatched (ShardParallel(num_microbatches=2)): a one-stage timeline and
    the stage memory breakdown."""
    step, state, batches = case
    plan = autopar.parallelize(step, mesh=mesh_of((2, 4)),
                               method=autopar.ShardParallel(num_microbatches=2)).get_plan(
        state, batches[0])
    assert plan.pipeline.get("gradient_accumulation") and len(plan.stages) == 1
    text = autopar.report(plan)
    page = _common_structure(plan, text)
    svgs = _svgs(text)
    assert len(_rects(svgs["pipeline schedule"], "fwd")) == 2
    assert len(_rects(svgs["pipeline schedule"], "bwd")) == 2
    parts = _parts(svgs["memory per device"])
    assert "not attributed" not in parts
    assert sum(sum(v) for v in parts.values()) == pytest.approx(plan.peak_memory_bytes)
    assert "gradient accumulation" in page.section("timeline")


def test_report_rejects_what_it_cannot_draw(single_plan):
    with pytest.raises(autopar.InvalidArgumentError, match="pass a ParallelPlan"):
        autopar.report(single_plan.to_json())
    broken = dataclasses.replace(single_plan, mesh_shape=(8,), axis_names=("data",))
    with pytest.raises(autopar.InvalidArgumentError, match=r"autopar.report: the plan is "
                       r"inconsistent: .* is split over mesh axis 1, but the plan's mesh \(8,\)"):
        autopar.report(broken)


@pytest.mark.parametrize("ratio", [1.5, 0.5])
def test_budget_line_on_the_memory_scale(single_plan, ratio):
    """A budget near the peak is drawn as a line at its place on the scale (past the bar's end
    when the plan fits, inside it when it does not, with the header saying so)."""
    plan = dataclasses.replace(single_plan,
                               memory_budget_bytes=ratio * single_plan.peak_memory_bytes)
    text = autopar.report(plan)
    svg = _svgs(text)["memory per device"]
    line = next(e for e in svg.iter(f"{{{SVG_NS}}}line") if e.get("id") == "budget-line")
    parts = _rects(svg, "part")
    bar_end = max(float(r.get("x")) + float(r.get("width")) for r in parts)
    bar_start = min(float(r.get("x")) for r in parts)
    budget_x = float(line.get("x1"))
    assert (budget_x - bar_start) / (bar_end - bar_start) == pytest.approx(ratio, rel=1e-2)
    assert ("OVER BUDGET" in _parse(text).section("summary")) == (ratio < 1)


def test_recomputation_savings_are_drawn_past_the_peak(pipe_plan):
    """A stage with recomputation shows what it saves (in-flight microbatches x the
    activations it would keep without it, less those it keeps), outlined past its bar; one
    whose savings the search did not price is named in a note."""
    import dataclasses
    q = pipe_plan.pipeline["in_flight"]
    stages = list(pipe_plan.stages)
    stages[0] = dataclasses.replace(stages[0], remat="full", activation_bytes_without_remat=
                                    stages[0].activation_bytes + 1000.0)
    stages[1] = dataclasses.replace(stages[1], remat="selective",
                                    activation_bytes_without_remat=None)
    text = autopar.report(dataclasses.replace(pipe_plan, stages=tuple(stages)))
    saved = [r for r in _svgs(text)["memory per device"].iter(f"{{{SVG_NS}}}rect")
             if r.get("class") == "saved"]
    assert [float(r.get("data-bytes")) for r in saved] == [q[0] * 1000.0]
    memory = _html_section(text, "memory")
    assert "recomputation saves" in memory and "did not price" in memory
    assert 'class="saved"' not in autopar.report(pipe_plan)     # no recomputation: none


def test_forward_only_timeline_draws_forwards_alone():
    """An eval step's pipeline (no gradient): the timeline holds the S x M forwards and no
    backward, and the page and the dump say the step runs forwards only."""
    net = MLP(num_layers=4, hidden=32)
    batch = make_mlp_batch(jax.random.key(1), 16, 32, 32)
    params = net.init(jax.random.key(0), batch["x"])

    def eval_step(params, batch):
        return mse_loss(net.apply(params, batch["x"]), batch["y"])
    plan = autopar.parallelize(eval_step, mesh=mesh_of((2, 4)), method=autopar.PipeshardParallel(
        num_microbatches=4, layer_option=autopar.AutoLayerOption(num_layers=4),
        stage_option=autopar.UniformStageOption(num_stages=2))).get_plan(params, batch)
    text = autopar.report(plan)
    tl = _svgs(text)["pipeline schedule"]
    assert len(_rects(tl, "fwd")) == 2 * 4
    assert not _rects(tl, "bwd") and not _rects(tl, "wgt")
    # one clock is one forward of the slowest stage: its blocks fill the clock (4 + 2 - 1)
    clock = float(_rects(tl, "lane")[0].get("width")) / (4 + 2 - 1)
    assert max(float(r.get("width")) for r in _rects(tl, "fwd")) == pytest.approx(clock)
    assert "forward" in text
    assert "forward only (the step takes no gradient)" in autopar.dump(plan)
    assert "one microbatch's forward)" in autopar.dump(plan, stage=0)


def _bar_parts(plan, stage_index):
    bars = [r for r in _rects(_svgs(autopar.report(plan))["memory per device"], "part")]
    return {r.get("data-part"): float(r.get("data-bytes")) for r in bars
            if f"stage {stage_index} " in r.find(f"{{{SVG_NS}}}title").text}


def test_zero_bubble_memory_bars_show_the_deferred_weight_gradients(case):
    """Under ZB-H1 the last stage's peak holds W's part of deferred microbatches: its bar
    draws them as their own part (the table's worst mix), and the parts add up to the peak
    with nothing left unattributed."""
    plan = _plan_with(case, Schedule.ZERO_BUBBLE_H1, 2)
    for s in plan.stages:
        mine = _bar_parts(plan, s.index)
        q, d = plan.pipeline["kept_at_peak"][s.index]
        assert mine.get("activations in flight", 0.0) == pytest.approx(q * s.activation_bytes)
        assert mine.get("deferred weight gradients", 0.0) == pytest.approx(
            d * plan.stage_solution(s.index).weight_bytes)
        assert "not attributed" not in mine
        assert sum(mine.values()) == pytest.approx(s.peak_memory_bytes)
    assert plan.pipeline["kept_at_peak"][-1][1] > 0 and "deferred weight gradients" in \
        _bar_parts(plan, len(plan.stages) - 1)


def test_an_eval_pipeline_s_bars_show_the_results_it_keeps():
    """An eval step returning its outputs: the stage that makes them keeps every other
    microbatch's until they combine, drawn as their own part."""
    net = MLP(num_layers=4, hidden=32)
    batch = make_mlp_batch(jax.random.key(1), 16, 32, 32)
    params = net.init(jax.random.key(0), batch["x"])

    def eval_step(params, batch):
        out = net.apply(params, batch["x"])
        return out, mse_loss(out, batch["y"])
    plan = autopar.parallelize(eval_step, mesh=mesh_of((2, 4)), method=autopar.PipeshardParallel(
        num_microbatches=4, layer_option=autopar.AutoLayerOption(num_layers=4),
        stage_option=autopar.UniformStageOption(num_stages=2))).get_plan(params, batch)
    last = _bar_parts(plan, 1)
    assert last["results of the other microbatches"] == pytest.approx(
        3 * plan.pipeline["result_bytes"][1]) and plan.pipeline["result_bytes"][1] > 0
    assert "results of the other microbatches" not in _bar_parts(plan, 0)
    assert sum(last.values()) == pytest.approx(plan.stages[1].peak_memory_bytes)
