"""Tests for autopar.inspect: the text dump of a ParallelPlan (`autopar.dump`)."""
from __future__ import annotations

import dataclasses
import pathlib
import re

import jax
import jax.numpy as jnp
import optax
import pytest

import autopar
from autopar.core.plan import FallbackPlan, OperatorPlan, ParallelPlan, StagePlan, TensorPlan
from autopar.core.spec import format_spec
from autopar.tools.dump import _bytes, _time
from support.steps import mlp_train_state, mlp_train_step

THIS_FILE = pathlib.Path(__file__).name
IN_DIM, HIDDEN, BATCH = 8, 16, 32
CLUSTER = autopar.ClusterSpec.preset("dgx-a100", num_hosts=1)


def _create_state():
    return mlp_train_state(IN_DIM, HIDDEN, optax.adamw(1e-2))


train_step = mlp_train_step


def with_fallbacks(x, b):
    y = jnp.linalg.cholesky(x @ x.T + 8.0 * jnp.eye(x.shape[0]))
    z = jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 2.0), (0, y))[1]
    return (z @ b).sum()


def _sds(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.float32)


@pytest.fixture(scope="module")
def mlp_plan():
    state = jax.eval_shape(_create_state)
    batch = {"x": _sds(BATCH, IN_DIM), "y": _sds(BATCH, HIDDEN)}
    return autopar.plan(train_step, state, batch, cluster=CLUSTER, mesh_shape=(2, 4),
                        batch_argnums=(1,))


@pytest.fixture(scope="module")
def fallback_plan():
    return autopar.plan(with_fallbacks, _sds(16, 16), _sds(16, 8), cluster=CLUSTER,
                        mesh_shape=(2, 4), batch_argnums=())


def _line_with(text: str, needle: str) -> str:
    lines = [line for line in text.splitlines() if needle in line]
    assert lines, f"no line contains {needle!r}:\n{text}"
    return lines[0]


def _section(text: str, title: str) -> list[str]:
    """Lines from the one starting with `title` to the next blank line."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title))
    end = next((i for i in range(start, len(lines)) if not lines[i].strip()), len(lines))
    return lines[start:end]


# --------------------------------------------------------------------------------- dump
def test_dump_header_and_mesh(mlp_plan):
    text = autopar.dump(mlp_plan)
    assert isinstance(text, str)
    assert text.splitlines()[0] == "autopar plan  method=shard_parallel  cluster=dgx-a100"
    mesh_line = _line_with(text, "mesh:")
    assert "data=2 x model=4" in mesh_line
    assert f"devices={list(range(8))}" in mesh_line


def test_dump_lists_every_input_leaf_with_its_sharding(mlp_plan):
    text = autopar.dump(mlp_plan, full=True)
    section = _section(text, "state and inputs:")
    assert len(section) == 1 + 2 + len(mlp_plan.inputs)       # title, header, rule, rows
    assert section[1].split() == ["leaf", "role", "shape", "dtype", "sharding"]
    rows = section[3:]
    for t, row in zip(mlp_plan.inputs, rows):
        cells = row.split()
        assert cells[0] == t.path
        assert cells[1] == t.role
        assert cells[2] == ("x".join(map(str, t.shape)) or "scalar")
        assert cells[3] == t.dtype
        assert row.rstrip().endswith(format_spec(t.spec, mlp_plan.axis_names))
    assert "state.opt_state[0].mu['Dense_0']['kernel']" in text
    assert "batch['x']" in text


def test_dump_lists_results(mlp_plan):
    section = _section(autopar.dump(mlp_plan, full=True), "results:")
    assert len(section) == 3 + len(mlp_plan.outputs)
    assert "(next state.params['Dense_1']['kernel'])" in "\n".join(section)
    assert section[-1].split()[0] == "result[14]"


def test_dump_heavy_operators_with_source(mlp_plan):
    text = autopar.dump(mlp_plan, full=True)
    section = _section(text, "heavy operators")
    assert section[0] == f"heavy operators ({len(mlp_plan.operators)}):" == "heavy operators (5):"
    rows = section[3:]
    assert len(rows) == 5
    for o, row in zip(mlp_plan.operators, rows):
        cells = row.split()
        assert cells[0] == str(o.node) and cells[1] == "dot_general"
        assert o.strategy in row
        assert "mlp.py" in row                      # the model line, not a flax line
        assert o.source in row
    assert "jvp(MLP)/Dense_0" in text              # the scope column


def test_dump_predicted_costs_memory_and_ilp(mlp_plan):
    text = autopar.dump(mlp_plan)
    costs = _line_with(text, "compute ")
    assert f"compute {_time(mlp_plan.predicted_compute_s)}" in costs
    assert f"communication {_time(mlp_plan.predicted_comm_s)}" in costs
    assert f"resharding {_time(mlp_plan.predicted_reshard_s)}" in costs
    assert f"total {_time(mlp_plan.predicted_step_s)}" in costs
    memory = _line_with(text, "peak memory")
    assert _bytes(mlp_plan.peak_memory_bytes) in memory
    assert f"of budget {_bytes(mlp_plan.memory_budget_bytes)}" in memory
    ilp = _line_with(text, "ILP:")
    assert f"{mlp_plan.ilp['num_groups']} strategy groups" in ilp
    assert f"backend {mlp_plan.ilp['backend']}" in ilp
    assert f"status {mlp_plan.ilp['status']}" in ilp
    assert "NOTE:" not in text
    assert _line_with(text, "timings:").startswith("timings: trace ")
    assert "fallbacks: none (every operator had a sharding rule)" in text


def test_dump_lists_fallbacks_with_reasons(fallback_plan):
    prims = [f.primitive for f in fallback_plan.fallbacks]
    assert prims == ["cholesky"]          # the while loop's body is planned (no fallback)
    text = autopar.dump(fallback_plan, full=True)
    section = _section(text, "fallbacks")
    assert section[0] == "fallbacks (1):"
    chol = _line_with(text, " cholesky at ")
    assert "no sharding rule for primitive 'cholesky'" in chol
    assert "replicated" in chol
    assert f"{THIS_FILE}:" in chol and "(with_fallbacks)" in chol
    for f in fallback_plan.fallbacks:
        assert f.replicated_bytes > 0
        assert (f"  node {f.node} {f.primitive} at {f.source}: {f.reason} "
                f"({_bytes(f.replicated_bytes)} whole on every device)") in section
    # the operators written here point at this file
    for o in fallback_plan.operators:
        assert THIS_FILE in o.source
    assert THIS_FILE in "\n".join(_section(text, "heavy operators"))


def test_fallback_inside_library_jit_points_at_the_call_site(fallback_plan):
    (chol,) = [f for f in fallback_plan.fallbacks if f.primitive == "cholesky"]
    assert THIS_FILE in chol.source and "(with_fallbacks)" in chol.source


def test_dump_max_operators(fallback_plan, mlp_plan):
    text = autopar.dump(mlp_plan, max_operators=2, full=True)
    section = _section(text, "heavy operators")
    assert section[0] == "heavy operators (5):"
    assert len(section) == 3 + 2 + 1
    assert section[-1].strip() == "... 3 more"
    full = autopar.dump(mlp_plan, max_operators=None, full=True)
    assert "more" not in "\n".join(_section(full, "heavy operators"))
    assert autopar.dump(fallback_plan, max_operators=10) == autopar.dump(fallback_plan)


def _hand_plan(**overrides) -> ParallelPlan:
    fields = dict(
        method="zero3", cluster="my-cluster", mesh_shape=(4,), axis_names=("dp",),
        device_ids=(4, 5, 6, 7), graph_fingerprint="f" * 16,
        inputs=(TensorPlan(index=0, path="params['w']", role="param", shape=(8, 4),
                           dtype="bfloat16", spec=((0,), ())),
                TensorPlan(index=1, path="step", role="other", shape=(), dtype="int32",
                           spec=())),
        outputs=(TensorPlan(index=0, path="result[0]", role="result", shape=(), dtype="float32",
                            spec=()),),
        constraints=(),
        operators=(OperatorPlan(node=3, primitive="dot_general", strategy="k0@dp",
                                communication="all-reduce(dp) 64 B", source="step.py:10:4 (f)",
                                name_stack="layer", out_shape=(8, 8), out_spec=((), ()),
                                flops=1024.0, compute_s=2.5e-3, comm_s=1e-6),),
        fallbacks=(FallbackPlan(node=7, primitive="sort", source="step.py:12:4 (f)",
                                reason="no sharding rule for primitive 'sort'"),),
        stages=(StagePlan(index=0, device_ids=(4, 5, 6, 7), logical_mesh_shape=(4,),
                          axis_names=("dp",), compute_s=1.5, comm_s=0.0, reshard_s=0.0,
                          peak_memory_bytes=3 * 2**30),),
        predicted_compute_s=1.5, predicted_comm_s=2.5e-3, predicted_reshard_s=4e-6,
        peak_memory_bytes=3 * 2**30, memory_budget_bytes=16 * 2**30, ilp={}, timings_s={})
    fields.update(overrides)
    return ParallelPlan(**fields)


def test_dump_hand_built_plan():
    text = autopar.dump(_hand_plan(), full=True)
    assert "method=zero3  cluster=my-cluster" in text
    assert "mesh: dp=4  devices=[4, 5, 6, 7]" in text
    assert "compute 1.500 s   communication 2.500 ms   resharding 4.0 us   total 1.503 s" in text
    assert "peak memory 3.00 GiB of budget 16.00 GiB" in text
    assert "ILP:" not in text and "timings:" not in text    # empty: not shown
    assert _line_with(text, "params['w']").split() == ["params['w']", "param", "8x4", "bfloat16",
                                                        "[dp,", "-]"]
    rows = [line.split() for line in text.splitlines()]
    assert ["step", "other", "scalar", "int32", "[]"] in rows
    op = _line_with(text, "k0@dp")
    assert "all-reduce(dp) 64 B" in op and "step.py:10:4 (f)" in op and "layer" in op
    assert "  node 7 sort at step.py:12:4 (f): no sharding rule for primitive 'sort'" in text


def test_dump_names_the_runner_ups():
    from autopar.core.plan import alternative_record as record
    step = _hand_plan().predicted_step_s
    plan = _hand_plan(alternatives=(
        record("DataParallel()", "method", 1.5 * step, 2**30, 16 * 2**30, "dp"),
        record("Zero2Parallel()", "method", None, 2**40, 16 * 2**30, "does not fit"),
        {**record("Zero3Parallel()", "method", None, 0.0, 16 * 2**30, "-"), "fits": None}))
    line = _line_with(autopar.dump(plan), "why this plan")
    assert "DataParallel() 1.50x" in line and "Zero2Parallel() over budget" in line
    assert "Zero3Parallel() not priced" in line
    assert "why this plan" not in autopar.dump(_hand_plan())


def test_dump_notes_a_non_optimal_solve():
    ilp = dict(num_groups=3, num_edges=2, num_memory_points=1, num_variables=9,
               num_constraints=4, backend="highs", status="feasible", build_time_s=0.001,
               solve_time_s=60.0, message="time limit reached; best incumbent used")
    text = autopar.dump(_hand_plan(ilp=ilp))
    line = _line_with(text, "ILP:")
    assert "3 strategy groups, 2 edges, 1 memory points -> 9 variables, 4 constraints" in line
    assert "status feasible" in line and "solve 60.000 s" in line
    assert "  NOTE: time limit reached; best incumbent used" in text.splitlines()
    trivial = autopar.dump(_hand_plan(ilp={**ilp, "status": "trivial"}))
    assert "NOTE:" not in trivial


def test_dump_no_fallbacks_and_no_operators():
    text = autopar.dump(_hand_plan(fallbacks=(), operators=()), full=True)
    assert "heavy operators (0):" in text
    assert "fallbacks: none (every operator had a sharding rule)" in text


def test_dump_is_deterministic(mlp_plan):
    assert autopar.dump(mlp_plan) == autopar.dump(dataclasses.replace(mlp_plan))


def test_dump_max_rows_clips_state_and_result_tables():
    import jax
    import optax
    state = jax.eval_shape(lambda: mlp_train_state(IN_DIM, HIDDEN, optax.adamw(1e-2)))
    batch = {"x": jax.ShapeDtypeStruct((BATCH, IN_DIM), "float32"),
             "y": jax.ShapeDtypeStruct((BATCH, HIDDEN), "float32")}
    plan = autopar.plan(mlp_train_step, state, batch, cluster=CLUSTER, batch_argnums=(1,))
    full, short = autopar.dump(plan, full=True), autopar.dump(plan, max_rows=3, full=True)
    n_in = len(plan.inputs)
    assert f"... {n_in - 4} more" in short
    assert plan.inputs[-1].path in short and plan.inputs[5].path not in short.split("results:")[0]
    assert len(short.splitlines()) < len(full.splitlines())


def test_collectives_name_the_priced_algorithm():
    from autopar.cost.model import CollectiveAlgorithm
    state = jax.eval_shape(_create_state)
    batch = {"x": _sds(BATCH, IN_DIM), "y": _sds(BATCH, HIDDEN)}
    plan = autopar.plan(train_step, state, batch, cluster=CLUSTER, mesh_shape=(2, 4),
                        method=autopar.DataParallel())      # gradients must be all-reduced
    comms = [c.detail for c in plan.collectives if c.kind == "all-reduce"]
    assert comms, "a data-parallel plan without an all-reduce"
    names = {a.value.replace("_", "-") for a in CollectiveAlgorithm}
    assert all(c.split()[-1] in names for c in comms), comms
    algorithm = comms[0].split()[-1]
    assert f"{len(comms)} x all-reduce ({algorithm}" in autopar.dump(plan)


# ------------------------------------------------------------------ concise dump (issue 16)
EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def demo_plan():
    """The demo's plan (examples/train_gpt.py: its model, optimizer, batch and mesh)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("train_gpt", EXAMPLES / "train_gpt.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    state = jax.eval_shape(lambda: demo.create_state(jax.random.key(0)))
    batch = jax.eval_shape(lambda: demo.make_gpt_batch(jax.random.key(1), demo.BATCH_SIZE,
                                                       demo.CONFIG))
    par = autopar.parallelize(demo.train_step, mesh=jax.make_mesh((2, 4), ("data", "model")),
                              batch_argnums=(1,), plan_cache=False)
    with pytest.MonkeyPatch.context() as mp:       # `make demo` prices the runner-ups
        mp.setenv("AUTOPAR_RUNNER_UPS", "on")
        return par.get_plan(state, batch)


def _rows(text: str, title: str) -> list[str]:
    """The data rows of the table titled `title` (after its header and rule)."""
    return [r for r in _section(text, title)[3:] if not r.strip().startswith(("...", "+", "rows"))]


def _seconds(cell: str) -> float:
    value, unit = cell.split()
    return float(value) * {"s": 1.0, "ms": 1e-3, "us": 1e-6}[unit]


def test_demo_gpt_default_dump_is_concise(demo_plan):
    text = autopar.dump(demo_plan)
    lines = text.splitlines()
    assert len(lines) <= 60, text
    assert "mesh: data=2 x model=4" in text
    assert demo_plan.alternatives and "\n  why this plan: runner-ups' predicted steps" in text
    assert len(demo_plan.inputs) == 90 and len(demo_plan.operators) > 40
    # the heaviest operators first: the first row is the heaviest of the rows shown, and at
    # least as heavy as the single heaviest operator
    rows = _rows(text, "heaviest operators")
    times = [_seconds(re.search(r"\d+\.\d+ (?:ms|us|s)(?=  )", r).group(0)) for r in rows]
    assert times == sorted(times, reverse=True) and len(rows) == 8
    top = max(demo_plan.operators, key=lambda o: o.compute_s + o.comm_s)
    assert times[0] >= (top.compute_s + top.comm_s) * 0.999
    assert "block_{0..1}" in text and " x2 " in text            # repeated layers folded
    assert "results keep their input's sharding" in text
    assert lines[-1].endswith("autopar.dump(plan, full=True) lists every row)")


def test_full_dump_lists_every_operator_leaf_and_result(demo_plan):
    text = autopar.dump(demo_plan, full=True)
    nodes = [int(r.split()[0]) for r in _rows(text, "heavy operators")]
    assert nodes == [o.node for o in demo_plan.operators]
    leaves = [r.split()[0] for r in _rows(text, "state and inputs")]
    assert leaves == [t.path for t in demo_plan.inputs]
    assert len(_rows(text, "results")) == len(demo_plan.outputs)
    reshards = [c for c in demo_plan.collectives if c.is_reshard]
    assert _section(text, "resharding collectives")[0] == \
        f"resharding collectives ({len(reshards)}):"
    assert "full=True" not in text


def test_optimizer_state_on_its_parameters_row(demo_plan):
    """The demo's optimizer state is sharded: each parameter's row shows its mu and nu."""
    names = demo_plan.axis_names
    spec = {t.path: format_spec(t.spec, names) for t in demo_plan.inputs}
    path = "['params']['block_{}']['mlp']['fc']['kernel']"
    mu = spec["state.opt_state[1][0].mu" + path.format(0)]
    assert mu == spec["state.opt_state[1][0].mu" + path.format(1)] == \
        spec["state.opt_state[1][0].nu" + path.format(0)]
    row = _line_with(autopar.dump(demo_plan), "state.params" + path.format("{0..1}"))
    assert row.split()[1] == "x2" and row.endswith(f"mu,nu {mu}")
    assert f"  {spec['state.params' + path.format(0)]}  " in row


def test_markdown_style(mlp_plan):
    text = autopar.dump(mlp_plan, style="markdown")
    lines = text.splitlines()
    assert lines[0] == "# autopar plan  method=shard_parallel  cluster=dgx-a100"
    assert any(line.startswith("### heaviest operators") for line in lines)
    header = next(line for line in lines if line.startswith("| op |"))
    rule = lines[lines.index(header) + 1]
    assert rule == "|" + "|".join(["---"] * header.count(" | ") + ["---"]) + "|"
    assert not any(line.startswith("  --") for line in lines)      # no text-style rules
    full = autopar.dump(mlp_plan, style="markdown", full=True)
    assert sum(line.startswith("| ") for line in full.splitlines()) > \
        len(mlp_plan.inputs) + len(mlp_plan.outputs)
    with pytest.raises(autopar.InvalidArgumentError, match="style='html'.*'markdown'"):
        autopar.dump(mlp_plan, style="html")


def test_negative_limits_warn_and_mean_no_limit(mlp_plan):
    with pytest.warns(UserWarning, match=r"max_rows=-1 is negative.*Fix: pass None"):
        text = autopar.dump(mlp_plan, max_rows=-1, full=True)
    assert text == autopar.dump(mlp_plan, full=True)
    with pytest.warns(UserWarning, match=r"max_operators=-3"):
        assert autopar.dump(mlp_plan, max_operators=-3) == autopar.dump(
            mlp_plan, max_operators=None)
    with pytest.raises(autopar.InvalidArgumentError, match="max_rows='5'"):
        autopar.dump(mlp_plan, max_rows="5")


# ------------------------------------------------------------------------------ pipelines
@pytest.fixture(scope="module")
def pipe_plans(tmp_path_factory):
    from support.steps import make_case, mesh_of, sgd_momentum_clip
    step, state, batches = make_case("mlp", "linen", sgd_momentum_clip(), num_layers=4,
                                     value_and_grad=autopar.value_and_grad)
    method = autopar.PipeshardParallel(
        num_microbatches=4, schedule=autopar.Schedule.ONE_F_ONE_B,
        layer_option=autopar.AutoLayerOption(num_layers=4),
        stage_option=autopar.UniformStageOption(num_stages=2))
    cache = tmp_path_factory.mktemp("plans")
    plans = [autopar.parallelize(step, mesh=mesh_of((2, 4)), method=method, plan_cache=cache)
             .get_plan(state, batches[0]) for _ in range(2)]
    return plans


def test_pipeline_stage_tables_add_up(pipe_plans):
    plan = pipe_plans[0]
    text = autopar.dump(plan, full=True)
    total = 0.0
    for i, s in enumerate(plan.stages):
        ops, colls = plan.stage_parts(i)
        assert ops, f"stage {i} lists no operators"
        assert f"heavy operators of stage {i} " in text
        strategy = sum(c.comm_s for c in colls if not c.is_reshard)
        assert strategy == pytest.approx(s.comm_s, rel=1e-6, abs=1e-12)
        concise = autopar.dump(plan, stage=i, max_rows=100)      # every collective row
        if colls:
            assert f"(communication {_time(s.comm_s)} stated)" in concise
            rows = _rows(concise, f"heaviest collectives of stage {i}")
            shown = sum(_seconds(re.search(r"\d+\.\d+ (?:ms|us|s)(?=  )", r).group(0))
                        for r in rows)           # rounded to 0.1 us per row
            assert shown == pytest.approx(sum(c.comm_s for c in colls), abs=1e-7 * len(rows))
            assert shown == pytest.approx(s.comm_s + s.reshard_s, abs=1e-7 * len(rows))
        else:
            assert s.comm_s == 0
        total += s.comm_s
    scale = plan.pipeline["predicted_latency_s"] / sum(s.latency_s for s in plan.stages)
    assert plan.predicted_comm_s == pytest.approx(scale * total)
    assert f"communication per step {_time(plan.predicted_comm_s)} = {scale:.3f}" in text
    assert any(s.comm_s > 0 for s in plan.stages)


def test_dump_of_one_stage(pipe_plans):
    plan = pipe_plans[0]
    text = autopar.dump(plan, stage=1)
    assert "of stage 1 " in text and "of stage 0 " not in text
    assert all(r.split()[-1] == "1" for r in _rows(text, "state and inputs"))
    for bad in (2, -1, True):
        with pytest.raises(autopar.InvalidArgumentError, match=r"2 stage\(s\), numbered 0..1"):
            autopar.dump(plan, stage=bad)


def test_stage_argument_of_a_one_mesh_plan(mlp_plan):
    assert autopar.dump(mlp_plan, stage=0) == autopar.dump(mlp_plan)
    with pytest.raises(autopar.InvalidArgumentError, match=r"1 stage\(s\)"):
        autopar.dump(mlp_plan, stage=1)


def test_cache_hit_keeps_the_search_record(pipe_plans, mlp_plan, tmp_path):
    first, hit = pipe_plans
    assert first.origin == "search" and hit.origin == "plan cache"
    assert hit.searched_at == first.searched_at != ""
    assert {k: v for k, v in hit.timings_s.items() if k != "plan_lookup"} == first.timings_s
    for k in ("num_ilps", "num_reused", "dp_candidates"):
        assert hit.pipeline[k] == first.pipeline[k]
    line = _line_with(autopar.dump(hit), "plan from:")
    assert line.startswith("plan from: plan cache (looked up in ")
    assert (f"searched {first.searched_at} in "
            f"{_time(sum(first.timings_s.values()))}: {first.pipeline['num_ilps']} ILPs") in line
    # one mesh: the same record
    state = jax.eval_shape(_create_state)
    batch = {"x": _sds(BATCH, IN_DIM), "y": _sds(BATCH, HIDDEN)}
    one, two = (autopar.parallelize(train_step, mesh=jax.make_mesh((2, 4), ("a", "b")),
                                    batch_argnums=(1,), plan_cache=tmp_path)
                .get_plan(state, batch) for _ in range(2))
    assert two.origin == "plan cache" and two.searched_at == one.searched_at
    assert f"searched {one.searched_at} in {_time(sum(one.timings_s.values()))}: 1 ILP" in \
        _line_with(autopar.dump(two), "plan from:")


def test_summary_has_five_lines(mlp_plan, pipe_plans):
    for plan in (mlp_plan, *pipe_plans):
        lines = autopar.summary(plan).splitlines()
        assert len(lines) == 5, autopar.summary(plan)
        assert "data=2 x model=4" in lines[0] and "8 devices" in lines[0]
        assert lines[1].startswith(f"predicted step {_time(plan.predicted_step_s)}: compute")
        assert _bytes(plan.memory_budget_bytes) in lines[2]
        assert lines[4].startswith(f"plan from {plan.origin}")
    assert "heaviest collectives" in autopar.summary(mlp_plan).splitlines()[3]
    assert "2 stages" in autopar.summary(pipe_plans[0]).splitlines()[3]
    assert "schedule 1f1b" in autopar.summary(pipe_plans[0]).splitlines()[3]
