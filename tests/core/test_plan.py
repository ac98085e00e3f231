"""Tests for autopar.plan (ParallelPlan, JSON round-trip, graph_fingerprint) and
autopar.planner (graph + assignment -> ParallelPlan), through `autopar.plan` and
`autopar.parallelize`."""
from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autopar
from autopar.core.graph import TensorKind
from autopar.core.plan import (
    PLAN_FORMAT_VERSION,
    CollectivePlan,
    FallbackPlan,
    OperatorPlan,
    ParallelPlan,
    StagePlan,
    TensorPlan,
    graph_fingerprint,
)
from autopar.core.primitives import HEAVY_OPERATORS
from autopar.core.spec import is_valid
from autopar.frontend.tracer import trace
from autopar.tools.plan_cache import PlanCache
from support.steps import mlp_train_state, mlp_train_step

IN_DIM, HIDDEN, BATCH = 8, 16, 32
CLUSTER = autopar.ClusterSpec.preset("dgx-a100", num_hosts=2)


def _create_state():
    return mlp_train_state(IN_DIM, HIDDEN, optax.adamw(1e-2))


train_step = mlp_train_step


def _batch(seed=1, batch=BATCH):
    kx, ky = jax.random.split(jax.random.key(seed))
    return {"x": jax.random.normal(kx, (batch, IN_DIM)),
            "y": jax.random.normal(ky, (batch, HIDDEN))}


def _abstract_batch(batch=BATCH, dtype=jnp.float32):
    return {"x": jax.ShapeDtypeStruct((batch, IN_DIM), dtype),
            "y": jax.ShapeDtypeStruct((batch, HIDDEN), dtype)}


@pytest.fixture(scope="module")
def abstract_state():
    return jax.eval_shape(_create_state)


@pytest.fixture(scope="module")
def cluster_plan(abstract_state):
    return autopar.plan(train_step, abstract_state, _abstract_batch(), cluster=CLUSTER,
                        batch_argnums=(1,))


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 4), ("data", "model"))


@pytest.fixture(scope="module")
def concrete():
    """(state, batch, parallelized step, its plan) on the 8 local devices."""
    state, batch = _create_state(), _batch()
    m = jax.make_mesh((2, 4), ("data", "model"))
    step = autopar.parallelize(train_step, mesh=m, batch_argnums=(1,))
    return state, batch, step, step.get_plan(state, batch)


# ----------------------------------------------------------------------- plan for a cluster
def test_plan_for_a_cluster_this_machine_lacks(cluster_plan, abstract_state):
    p = cluster_plan
    assert isinstance(p, ParallelPlan)
    assert p.version == PLAN_FORMAT_VERSION
    assert p.device_ids == tuple(range(16))
    assert p.mesh_shape == (2, 8)
    assert p.axis_names == ("data", "model")
    assert p.method == "shard_parallel"
    assert p.cluster == "dgx-a100"
    (stage,) = p.stages
    assert stage.index == 0
    assert stage.device_ids == p.device_ids
    assert stage.logical_mesh_shape == (2, 8)
    assert stage.peak_memory_bytes == p.peak_memory_bytes
    # budget defaults to the device memory of the cluster description
    assert p.memory_budget_bytes == float(CLUSTER.logical_mesh((2, 8), ("a", "b")).memory_bytes)
    assert 0 < p.peak_memory_bytes <= p.memory_budget_bytes
    assert p.predicted_step_s == pytest.approx(
        p.predicted_compute_s + p.predicted_comm_s + p.predicted_reshard_s)
    assert p.predicted_compute_s > 0
    graph = trace(train_step, (abstract_state, _abstract_batch()), batch_argnums=(1,))
    assert p.graph_fingerprint == graph_fingerprint(graph)


def test_plan_inputs_and_outputs(cluster_plan):
    p = cluster_plan
    assert len(p.inputs) == 16 and len(p.outputs) == 15
    assert [t.index for t in p.inputs] == list(range(16))
    roles = {t.path: t.role for t in p.inputs}
    assert roles["state.params['Dense_0']['kernel']"] == "param"
    assert roles["state.opt_state[0].mu['Dense_1']['bias']"] == "opt_state"
    assert roles["state.step"] == "other"
    assert roles["batch['x']"] == roles["batch['y']"] == "batch"
    shapes = {t.path: t.shape for t in p.inputs}
    assert shapes["state.params['Dense_0']['kernel']"] == (IN_DIM, HIDDEN)
    assert shapes["batch['y']"] == (BATCH, HIDDEN)
    for t in p.inputs + p.outputs:
        assert is_valid(t.spec, t.shape, p.mesh_shape), t
    # the new state is carried (eval_shape'd state): each result names the leaf it replaces
    assert all(t.role == "result" for t in p.outputs)
    for k in range(14):
        assert p.outputs[k].path == f"result[{k}] (next {p.inputs[k].path})"
        assert p.outputs[k].spec == p.inputs[k].spec      # state keeps its sharding
        assert p.outputs[k].shape == p.inputs[k].shape
    assert p.outputs[14].path == "result[14]" and p.outputs[14].shape == ()


def test_plan_operators_and_constraints(cluster_plan, abstract_state):
    p = cluster_plan
    graph = trace(train_step, (abstract_state, _abstract_batch()), batch_argnums=(1,))
    heavy = [n for n in graph.nodes if n.primitive in HEAVY_OPERATORS]
    assert [o.node for o in p.operators] == [n.id for n in heavy]
    assert len(p.operators) == 5
    for o in p.operators:
        node = graph.nodes[o.node]
        assert o.primitive == node.primitive == "dot_general"
        assert o.flops == node.flops > 0
        assert o.out_shape == graph.tensors[node.outputs[0]].shape
        assert is_valid(o.out_spec, o.out_shape, p.mesh_shape)
        assert "mlp.py" in o.source
        assert o.strategy
    assert p.fallbacks == ()
    for tid, spec in p.constraints:
        t = graph.tensors[tid]
        assert t.kind == TensorKind.INTERMEDIATE and t.rank > 0
        assert is_valid(spec, t.shape, p.mesh_shape)
    assert len({tid for tid, _ in p.constraints}) == len(p.constraints) > 0


def test_plan_ilp_stats_and_timings(cluster_plan):
    ilp = cluster_plan.ilp
    assert set(ilp) >= {"num_groups", "num_edges", "num_variables", "num_constraints",
                        "status", "backend", "build_time_s", "solve_time_s"}
    assert ilp["status"] in ("optimal", "trivial")
    assert ilp["num_groups"] > 0
    assert set(cluster_plan.timings_s) >= {"trace", "intra_op"}


def test_plan_custom_mesh_shape_and_names(abstract_state):
    p = autopar.plan(train_step, abstract_state, _abstract_batch(), cluster=CLUSTER,
                     mesh_shape=(4, 4), axis_names=("x", "y"), batch_argnums=(1,))
    assert p.mesh_shape == (4, 4) and p.axis_names == ("x", "y")
    assert p.stages[0].axis_names == ("x", "y")
    assert p.device_ids == tuple(range(16))


def test_plan_data_parallel_splits_batch(abstract_state):
    p = autopar.plan(train_step, abstract_state, _abstract_batch(), cluster=CLUSTER,
                     method=autopar.DataParallel(), batch_argnums=(1,))
    assert p.method == "data_parallel"
    for t in p.inputs:
        if t.role == "batch":
            assert t.spec == ((0, 1), ())
        else:
            assert all(dim == () for dim in t.spec), t


def test_plan_rejects_wrong_mesh_product(abstract_state):
    with pytest.raises(autopar.AutoparError):
        autopar.plan(train_step, abstract_state, _abstract_batch(), cluster=CLUSTER,
                     mesh_shape=(2, 4), batch_argnums=(1,))


# ------------------------------------------------------------------------------ JSON round trip
def test_json_round_trip_is_equal(cluster_plan):
    text = cluster_plan.to_json()
    json.loads(text)                                   # valid JSON
    loaded = ParallelPlan.from_json(text)
    assert dataclasses.asdict(loaded) == dataclasses.asdict(cluster_plan)
    assert loaded == cluster_plan
    assert loaded.to_json() == text
    assert ParallelPlan.from_json(cluster_plan.to_json(indent=None)) == cluster_plan


def test_json_round_trip_restores_types(cluster_plan):
    loaded = ParallelPlan.from_json(cluster_plan.to_json())
    assert isinstance(loaded.mesh_shape, tuple) and isinstance(loaded.device_ids, tuple)
    assert all(isinstance(t, TensorPlan) for t in loaded.inputs + loaded.outputs)
    assert all(isinstance(t.shape, tuple) and isinstance(t.spec, tuple) for t in loaded.inputs)
    assert all(isinstance(dim, tuple) for t in loaded.inputs for dim in t.spec)
    assert all(isinstance(o, OperatorPlan) and isinstance(o.out_spec, tuple)
               for o in loaded.operators)
    assert all(isinstance(s, StagePlan) for s in loaded.stages)
    assert all(isinstance(c, tuple) and isinstance(c[1], tuple) for c in loaded.constraints)
    assert loaded.predicted_step_s == cluster_plan.predicted_step_s


def _tiny_plan(**overrides) -> ParallelPlan:
    fields = dict(
        method="shard_parallel", cluster="cpu", mesh_shape=(2, 2), axis_names=("a", "b"),
        device_ids=(0, 1, 2, 3), graph_fingerprint="0123456789abcdef",
        inputs=(TensorPlan(index=0, path="w", role="param", shape=(4, 4), dtype="float32",
                           spec=((0,), (1,))),),
        outputs=(TensorPlan(index=0, path="result[0]", role="result", shape=(), dtype="float32",
                            spec=()),),
        constraints=((3, ((), (0, 1))),),
        operators=(OperatorPlan(node=1, primitive="dot_general", strategy="i0@a", communication="",
                                source="f.py:1:1 (f)", name_stack="", out_shape=(4, 4),
                                out_spec=((0,), ()), flops=128.0, compute_s=1e-6, comm_s=0.0),),
        fallbacks=(FallbackPlan(node=2, primitive="cholesky", source="f.py:2:1 (f)",
                                reason="no sharding rule"),),
        stages=(StagePlan(index=0, device_ids=(0, 1, 2, 3), logical_mesh_shape=(2, 2),
                          axis_names=("a", "b"), compute_s=1e-6, comm_s=0.0, reshard_s=0.0,
                          peak_memory_bytes=64.0),),
        predicted_compute_s=1e-6, predicted_comm_s=2e-6, predicted_reshard_s=3e-6,
        peak_memory_bytes=64.0, memory_budget_bytes=1e9,
        ilp=TINY_ILP, timings_s={"trace": 0.5})
    fields.update(overrides)
    return ParallelPlan(**fields)


TINY_ILP = {"num_groups": 3, "num_edges": 2, "num_memory_points": 1, "num_variables": 6,
            "num_constraints": 4, "backend": "highs", "status": "optimal", "build_time_s": 0.01,
            "solve_time_s": 0.02, "message": "", "objective_s": 1e-6}


def test_json_round_trip_hand_built_plan_with_fallbacks():
    p = _tiny_plan()
    loaded = ParallelPlan.from_json(p.to_json())
    assert loaded == p
    assert loaded.fallbacks[0] == p.fallbacks[0]
    assert loaded.predicted_step_s == pytest.approx(6e-6)


def test_json_round_trip_keeps_predicted_reshards():
    gather = CollectivePlan(node=-1, primitive="result", kind="all-gather", detail="reshard",
                            name_stack="", source="", comm_s=1e-6, tensor=3, operand=0,
                            nbytes=64.0, axes=("a",), src=((0,), (1,)), dst=((), (1,)))
    p = _tiny_plan(collectives=(gather,), reshards=((-1, 0, ((), (1,))), (1, 1, ((0,), ()))))
    loaded = ParallelPlan.from_json(p.to_json())
    assert loaded == p
    assert isinstance(loaded.collectives[0].dst[1], tuple) and loaded.reshards == p.reshards
    old = json.loads(p.to_json())            # a plan saved before these fields existed
    del old["reshards"]
    for key in ("tensor", "operand", "nbytes", "axes", "src", "dst"):
        del old["collectives"][0][key]
    assert ParallelPlan.from_json(json.dumps(old)).reshards == ()


def test_collective_origin_pipeline_kind_and_stage_parts():
    c = lambda detail: CollectivePlan(node=1, primitive="dot_general", kind="all-reduce",
                                      detail=detail, name_stack="", source="", comm_s=1e-6)
    ring, moved = c("all-reduce(a) 64 B ring"), c("all-reduce(a) 64 B reshard operand 0 of x")
    assert (ring.algorithm, ring.is_reshard) == ("ring", False)
    assert (moved.algorithm, moved.is_reshard) == ("-", True) and c("x").algorithm == "-"
    rec = json.loads(json.dumps({"operators": [dataclasses.asdict(_tiny_plan().operators[0])],
                                 "collectives": [dataclasses.asdict(ring)]}))
    staged = _tiny_plan(pipeline={"num_microbatches": 2}, stage_solutions=(rec,))
    assert staged.stage_parts(0) == (_tiny_plan().operators, (ring,))
    assert staged.stage_parts(None) == (staged.operators, ()) and staged.is_pipeline
    assert not _tiny_plan().is_pipeline and not _tiny_plan(
        pipeline={"gradient_accumulation": True}).is_pipeline


def test_plan_is_frozen():
    p = _tiny_plan()
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.method = "data_parallel"  # type: ignore[misc]


@pytest.mark.parametrize("version", [PLAN_FORMAT_VERSION + 1, 0, "1", None])
def test_wrong_version_raises_plan_mismatch(version):
    d = json.loads(_tiny_plan().to_json())
    d["version"] = version
    with pytest.raises(autopar.PlanMismatchError, match="version"):
        ParallelPlan.from_json(json.dumps(d))


def test_missing_version_raises_plan_mismatch():
    d = json.loads(_tiny_plan().to_json())
    del d["version"]
    with pytest.raises(autopar.PlanMismatchError):
        ParallelPlan.from_json(json.dumps(d))


# ---------------------------------------------------------------------------- fingerprint
def test_fingerprint_ignores_values_but_not_shapes(abstract_state):
    state = _create_state()
    fp = lambda *args: graph_fingerprint(trace(train_step, args, batch_argnums=(1,)))  # noqa: E731
    base = fp(state, _batch(1))
    assert len(base) == 16 and int(base, 16) >= 0
    assert fp(state, _batch(2)) == base                           # other values
    new_params = jax.tree.map(lambda x: x + 1.0, state.params)
    assert fp(state.replace(params=new_params), _batch(1)) == base
    assert fp(abstract_state, _abstract_batch()) == base           # abstract, same shapes
    assert fp(state, _batch(1, batch=16)) != base                  # batch size
    assert fp(abstract_state, _abstract_batch(dtype=jnp.bfloat16)) != base   # dtype


def test_fingerprint_changes_with_the_function():
    x = jnp.ones((4, 4))
    a = graph_fingerprint(trace(lambda x: jnp.tanh(x), (x,)))
    b = graph_fingerprint(trace(lambda x: jnp.exp(x), (x,)))
    c = graph_fingerprint(trace(lambda x: jnp.tanh(x), (jnp.ones((4, 5)),)))
    assert len({a, b, c}) == 3
    assert graph_fingerprint(trace(lambda y: jnp.tanh(y), (x * 3,))) == a


# ------------------------------------------------------------------------ replaying a plan
def test_parallelize_with_a_loaded_plan_reuses_it(concrete, mesh):
    state, batch, step, p = concrete
    assert p.mesh_shape == (2, 4) and len(p.device_ids) == 8
    loaded = ParallelPlan.from_json(p.to_json())
    replay = autopar.parallelize(train_step, mesh=mesh, batch_argnums=(1,), plan=loaded)
    assert replay.get_plan(state, batch) is loaded
    new_a, loss_a = step(state, batch)
    new_b, loss_b = replay(state, batch)
    np.testing.assert_array_equal(np.asarray(loss_a), np.asarray(loss_b))
    for a, b in zip(jax.tree.leaves(new_a), jax.tree.leaves(new_b)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # and both agree with plain jit on one device
    ref_state, ref_loss = jax.jit(train_step)(state, batch)
    np.testing.assert_allclose(loss_b, ref_loss, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(new_b), jax.tree.leaves(ref_state)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    # the plan's input shardings are what the executable was built with
    graph = replay.get_graph(state, batch)
    assert graph_fingerprint(graph) == loaded.graph_fingerprint


def _run_steps(step, state, n):
    ref = jax.jit(train_step)
    ours, theirs = state, state
    for seed in range(n):
        b = _batch(seed=10 + seed)
        ours, loss = step(ours, b)
        theirs, ref_loss = ref(theirs, b)
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert int(ours.step) == n
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_searched_plan_over_several_steps_matches_jit(concrete):
    state, _, step, _ = concrete
    _run_steps(step, state, 3)


def test_loaded_plan_over_several_steps_matches_jit(concrete, mesh):
    state, _, _, p = concrete
    replay = autopar.parallelize(train_step, mesh=mesh, batch_argnums=(1,),
                                 plan=ParallelPlan.from_json(p.to_json()))
    _run_steps(replay, state, 3)


def test_fingerprint_ignores_argument_placement(mesh):
    from jax.sharding import NamedSharding, PartitionSpec
    f = jax.grad(lambda w, x: jnp.tanh(x @ w).sum())
    w, x = jnp.ones((4, 4)), jnp.ones((8, 4))
    auto = jax.sharding.Mesh(mesh.devices, mesh.axis_names,
                             axis_types=(jax.sharding.AxisType.Auto,) * 2)
    placed = jax.device_put(w, NamedSharding(auto, PartitionSpec()))
    host = trace(f, (w, x), batch_argnums=(1,))
    on_mesh = trace(f, (placed, x), batch_argnums=(1,))
    assert [n.primitive for n in on_mesh.nodes] == [n.primitive for n in host.nodes]
    assert graph_fingerprint(on_mesh) == graph_fingerprint(host)


def test_saved_plan_for_other_shapes_raises(concrete, mesh):
    state, _, _, p = concrete
    replay = autopar.parallelize(train_step, mesh=mesh, batch_argnums=(1,), plan=p)
    with pytest.raises(autopar.PlanMismatchError, match="fingerprint"):
        replay(state, _batch(batch=16))


def test_saved_plan_for_other_mesh_shape_raises(concrete):
    state, batch, _, p = concrete
    other = jax.make_mesh((1, 8), ("data", "model"))
    replay = autopar.parallelize(train_step, mesh=other, batch_argnums=(1,), plan=p)
    with pytest.raises(autopar.PlanMismatchError, match="mesh shape"):
        replay(state, batch)


def test_searched_plan_is_cached_per_signature(concrete):
    state, batch, step, p = concrete
    assert step.get_plan(state, _batch(seed=5)) is p          # same shapes: cached
    other = step.get_plan(state, _batch(batch=16))
    assert other is not p
    assert other.graph_fingerprint != p.graph_fingerprint


def test_fingerprint_sees_equation_parameters():
    x = jax.ShapeDtypeStruct((4, 4), "float32")
    a = graph_fingerprint(trace(lambda v: v.sum(0), (x,), batch_argnums=()))
    b = graph_fingerprint(trace(lambda v: v.sum(1), (x,), batch_argnums=()))
    again = graph_fingerprint(trace(lambda v: v.sum(0), (x,), batch_argnums=()))
    assert a != b and a == again


# ------------------------------------------------------- fingerprints see into sub-jaxprs
# Two losses over the same parameter shapes: one shared layer applied 4 or 12 times.
SHARED = {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32)}
XY = {"x": jax.ShapeDtypeStruct((8, 8), jnp.float32),
      "y": jax.ShapeDtypeStruct((8, 8), jnp.float32)}


def _shared_layer_step(num_layers, scan=False):
    def loss(p, batch):
        h = batch["x"]
        if scan:
            h, _ = jax.lax.scan(lambda c, _: (jnp.tanh(c @ p["w"]), None), h, None,
                                length=num_layers)
        else:
            for _ in range(num_layers):
                h = jnp.tanh(h @ p["w"])
        return jnp.mean((h - batch["y"]) ** 2)

    def step(p, batch):
        value, grads = autopar.value_and_grad(loss)(p, batch)
        return jax.tree.map(lambda a, g: a - 0.1 * g, p, grads), value
    return step


def _pipeline_fp(step, args=(SHARED, XY)):
    return graph_fingerprint(trace(step, args, batch_argnums=(1,), keep_grad=True))


def test_fingerprint_of_a_kept_gradient_covers_the_loss():
    """Traced for a pipeline the step is `value_and_grad` plus the update, whatever the loss:
    the loss jaxpr in the marker's params must count (issue 13, item 9)."""
    four, twelve = _shared_layer_step(4), _shared_layer_step(12)
    assert _pipeline_fp(four) != _pipeline_fp(twelve)
    assert _pipeline_fp(four) == _pipeline_fp(_shared_layer_step(4))      # traced again
    mse = lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)           # noqa: E731
    mae = lambda p, b: jnp.mean(jnp.abs(b["x"] @ p["w"] - b["y"]))         # noqa: E731
    step_of = lambda loss: lambda p, b: autopar.value_and_grad(loss)(p, b)  # noqa: E731
    assert _pipeline_fp(step_of(mse)) != _pipeline_fp(step_of(mae))


@pytest.mark.parametrize("pair", ["scan", "cond", "while"])
def test_fingerprint_covers_control_flow_bodies(pair):
    x = jax.ShapeDtypeStruct((4, 4), jnp.float32)
    bodies = {
        "scan": lambda f: lambda v: jax.lax.scan(lambda c, _: (f(c), None), v, None,
                                                 length=3)[0],
        "cond": lambda f: lambda v: jax.lax.cond(v.sum() > 0, f, jnp.sin, v),
        "while": lambda f: lambda v: jax.lax.while_loop(lambda c: c.sum() < 10, f, v),
    }[pair]
    fp = lambda f: graph_fingerprint(trace(bodies(f), (x,)))             # noqa: E731
    assert fp(jnp.tanh) != fp(jnp.exp)
    assert fp(jnp.tanh) == fp(jnp.tanh)
    assert fp(lambda v: v * 2.0) != fp(lambda v: v * 3.0)       # literals inside the body


def _fingerprints_in_child() -> list[str]:
    return [_pipeline_fp(_shared_layer_step(4)), _pipeline_fp(_shared_layer_step(4, scan=True))]


def test_fingerprint_of_sub_jaxprs_is_the_same_in_another_process():
    """No object ids or hashes: a spawned interpreter computes the same fingerprints."""
    import multiprocessing
    here = _fingerprints_in_child()
    assert here[0] != here[1]
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        assert pool.apply(_fingerprints_in_child) == here


ACCUMULATE = autopar.ShardParallel(num_microbatches=2)


def _shared_layer_args():
    key = jax.random.key(0)
    params = {"w": jax.random.normal(key, (8, 8)) * 0.3}
    batch = {"x": jax.random.normal(jax.random.fold_in(key, 1), (8, 8)),
             "y": jax.random.normal(jax.random.fold_in(key, 2), (8, 8))}
    return params, batch


def test_two_losses_over_the_same_params_get_their_own_cache_entries(tmp_path, mesh):
    params, batch = _shared_layer_args()
    plans = []
    for num_layers in (4, 12):
        step = _shared_layer_step(num_layers)
        par = autopar.parallelize(step, mesh=mesh, batch_argnums=(1,), method=ACCUMULATE,
                                  plan_cache=tmp_path)
        plans.append(par.get_plan(params, batch))
        new, loss = par(params, batch)
        want_new, want_loss = jax.jit(step)(params, batch)
        np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
        np.testing.assert_allclose(new["w"], want_new["w"], rtol=1e-5, atol=1e-6)
    assert [p.origin for p in plans] == ["search", "search"]
    assert plans[0].graph_fingerprint != plans[1].graph_fingerprint
    assert len(PlanCache(tmp_path).entries()) == 2


@pytest.mark.parametrize("method", [ACCUMULATE, autopar.PipeshardParallel(
    num_microbatches=2, layer_option=autopar.AutoLayerOption(num_layers=2),
    stage_option=autopar.UniformStageOption(num_stages=2))], ids=["accumulate", "pipeline"])
def test_saved_pipeline_plan_for_another_loss_raises(mesh, method):
    params, batch = _shared_layer_args()
    four = autopar.parallelize(_shared_layer_step(4), mesh=mesh, batch_argnums=(1,),
                               method=method)
    saved = ParallelPlan.from_json(four.get_plan(params, batch).to_json())
    same = autopar.parallelize(_shared_layer_step(4), mesh=mesh, batch_argnums=(1,),
                               method=method, plan=saved)
    assert same.get_plan(params, batch).origin == "saved plan"
    other = autopar.parallelize(_shared_layer_step(12), mesh=mesh, batch_argnums=(1,),
                                method=method, plan=saved)
    with pytest.raises(autopar.PlanMismatchError, match="fingerprint"):
        other(params, batch)
