"""Tests for autopar.inspect: the text dump of a ParallelPlan (`autopar.dump`)."""
from __future__ import annotations

import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import optax
import pytest

import autopar
from autopar.inspect import _bytes, _time
from autopar.plan import FallbackPlan, OperatorPlan, ParallelPlan, StagePlan, TensorPlan
from autopar.spec import format_spec
from steps import mlp_train_state, mlp_train_step

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
    text = autopar.dump(mlp_plan)
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
    section = _section(autopar.dump(mlp_plan), "results:")
    assert len(section) == 3 + len(mlp_plan.outputs)
    assert "(next state.params['Dense_1']['kernel'])" in "\n".join(section)
    assert section[-1].split()[0] == "result[14]"


def test_dump_heavy_operators_with_source(mlp_plan):
    text = autopar.dump(mlp_plan)
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
    text = autopar.dump(fallback_plan)
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
    text = autopar.dump(mlp_plan, max_operators=2)
    section = _section(text, "heavy operators")
    assert section[0] == "heavy operators (5):"
    assert len(section) == 3 + 2 + 1
    assert section[-1].strip() == "... 3 more"
    full = autopar.dump(mlp_plan, max_operators=None)
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
    text = autopar.dump(_hand_plan())
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
    text = autopar.dump(_hand_plan(fallbacks=(), operators=()))
    assert "heavy operators (0):" in text
    assert "fallbacks: none (every operator had a sharding rule)" in text


def test_dump_is_deterministic(mlp_plan):
    assert autopar.dump(mlp_plan) == autopar.dump(dataclasses.replace(mlp_plan))


# ------------------------------------------------------------------------------ formatting
@pytest.mark.parametrize("n, text", [
    (0, "0 B"), (512, "512 B"), (1023, "1023 B"), (1024, "1.00 KiB"), (1536, "1.50 KiB"),
    (5 * 2**20, "5.00 MiB"), (3 * 2**30, "3.00 GiB"), (2 * 2**40, "2.00 TiB"),
    (4096 * 2**40, "4096.00 TiB"),
])
def test_bytes_format(n, text):
    assert _bytes(n) == text


@pytest.mark.parametrize("s, text", [
    (2.5, "2.500 s"), (1.0, "1.000 s"), (0.0025, "2.500 ms"), (1e-3, "1.000 ms"),
    (2.5e-6, "2.5 us"), (0.0, "0.0 us"),
])
def test_time_format(s, text):
    assert _time(s) == text


def test_dump_max_rows_clips_state_and_result_tables():
    import jax
    import optax
    state = jax.eval_shape(lambda: mlp_train_state(IN_DIM, HIDDEN, optax.adamw(1e-2)))
    batch = {"x": jax.ShapeDtypeStruct((BATCH, IN_DIM), "float32"),
             "y": jax.ShapeDtypeStruct((BATCH, HIDDEN), "float32")}
    plan = autopar.plan(mlp_train_step, state, batch, cluster=CLUSTER, batch_argnums=(1,))
    full, short = autopar.dump(plan), autopar.dump(plan, max_rows=3)
    n_in = len(plan.inputs)
    assert f"... {n_in - 4} more" in short
    assert plan.inputs[-1].path in short and plan.inputs[5].path not in short.split("results:")[0]
    assert len(short.splitlines()) < len(full.splitlines())


def test_collectives_name_the_priced_algorithm():
    from autopar.cost import CollectiveAlgorithm
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
