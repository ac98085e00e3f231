"""Errors that teach: a table of bad inputs a user gives autopar's public API, each of which
must raise an `AutoparError` subclass whose message names the offending value and the fix;
and the warnings for inputs that work but do not do what the user meant. Every case runs
under a time limit, so a hang fails its case instead of stalling CI."""
from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import autopar
from autopar import (
    AutoLayerOption,
    AutoStageOption,
    ClusterSpec,
    DataParallel,
    InvalidArgumentError,
    ManualStageOption,
    PipeshardParallel,
    PlanMismatchError,
    ShardParallel,
    UniformStageOption,
    UnsupportedError,
)

CASE_TIMEOUT_S = 120
MESH = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
CPU = ClusterSpec.preset("cpu")


def step(state, batch):
    def loss(p):
        return jnp.mean((batch["x"] @ p["w"]) ** 2)
    l, g = jax.value_and_grad(loss)(state)
    return jax.tree.map(lambda a, b: a - 0.1 * b, state, g), l


def acc_step(state, batch):        # gradient accumulation needs autopar.value_and_grad
    def loss(p):
        return jnp.mean((batch["x"] @ p["w"]) ** 2)
    l, g = autopar.value_and_grad(loss)(state)
    return jax.tree.map(lambda a, b: a - 0.1 * b, state, g), l


def _layer_model_step(state, batch):
    def loss(p):
        h = batch["x"]
        for w in p:
            h = jnp.tanh(h @ w)
        return jnp.mean(h ** 2)
    l, g = autopar.value_and_grad(loss)(state)
    return [a - 0.1 * b for a, b in zip(state, g)], l


STATE = {"w": jnp.ones((16, 16))}
BATCH = {"x": jnp.ones((16, 16))}


def par(fun=step, **kw):
    return autopar.parallelize(fun, mesh=MESH, plan_cache=False, **kw)


_PLAN = {}


def plan_json() -> dict:
    """A real plan for `step` on (STATE, BATCH), as JSON data (searched once per session)."""
    if "p" not in _PLAN:
        _PLAN["p"] = par().get_plan(STATE, BATCH)
    return json.loads(_PLAN["p"].to_json())


def edited_plan(edit) -> str:
    d = plan_json()
    edit(d)
    return json.dumps(d)


_PIPE = {}


def pipeline_plan_json() -> dict:
    """A real two-stage pipeline plan for `_layer_model_step`, as JSON data (planned once)."""
    if "p" not in _PIPE:
        _PIPE["p"] = autopar.plan(
            _layer_model_step, [jnp.ones((8, 8))] * 2, {"x": jnp.ones((8, 8))}, cluster=CPU,
            mesh_shape=(1, 2), method=PipeshardParallel(
                num_microbatches=2, layer_option=AutoLayerOption(num_layers=2),
                stage_option=UniformStageOption(num_stages=2)))
    return json.loads(_PIPE["p"].to_json())


def edited_pipeline(edit):
    """`ParallelPlan.from_json` of the pipeline plan after `edit(data)`, as a case."""
    d = pipeline_plan_json()
    edit(d)
    return from_json(json.dumps(d))


def edited(edit):
    """`ParallelPlan.from_json` of `step`'s plan after `edit(data)`, as a case."""
    return lambda: autopar.ParallelPlan.from_json(edited_plan(edit))


def setter(*path_and_value):
    """An edit that sets data[k0][k1]... = value (the last argument)."""
    *path, value = path_and_value

    def edit(d):
        for k in path[:-1]:
            d = d[k]
        d[path[-1]] = value
    return edit


def dropper(*path):
    """An edit that deletes data[k0][k1]...[kn]."""
    def edit(d):
        for k in path[:-1]:
            d = d[k]
        del d[path[-1]]
    return edit


ALTERNATIVE = {"name": "DataParallel()", "kind": "method", "predicted_step_s": 1e-3,
               "peak_memory_bytes": 1024.0, "fits": True, "note": ""}


def with_input(key, value):
    def edit(d):
        d["inputs"][0][key] = value
    return edit


def from_json(text):
    return lambda: autopar.ParallelPlan.from_json(text)


def pop(key):
    return lambda d: d.pop(key)


def _run_under_jit():
    s = par()
    jax.jit(lambda st, b: s(st, b))(STATE, BATCH)


def _aliased_donation():
    w = jnp.ones((16, 16))
    par(donate_argnums=(0,))({"w": w}, {"x": w})


def _shard_map_step(state, batch):
    return jax.shard_map(lambda x: x * 2, mesh=MESH, in_specs=P("data"),
                         out_specs=P("data"))(batch["x"]).sum()


def _nnx_step_with_default_batch_argnums():
    import optax
    from flax import nnx
    model = nnx.Linear(16, 16, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    def nnx_step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(batch["x"]) ** 2))(model)
        optimizer.update(model, grads)
        return loss
    par(nnx_step)(model, optimizer, BATCH)


def _saved_plan_other_shapes():
    p = autopar.ParallelPlan.from_json(json.dumps(plan_json()))
    par(plan=p)({"w": jnp.ones((32, 16))}, {"x": jnp.ones((16, 32))})


# (name, callable, expected class, substrings the message must contain, substrings it must not)
CASES = [
    # -- call arguments ------------------------------------------------------------------
    ("unhashable static argument", lambda: par(lambda st, b, cfg: step(st, b),
                                               static_argnums=(2,))(STATE, BATCH, {"a": 1}),
     InvalidArgumentError, ["{'a': 1}", "argument 2 (cfg)", "not hashable", "Fix:"], []),
    ("object-dtype numpy leaf", lambda: par()(STATE, {**BATCH, "ids": np.array(["a"], object)}),
     InvalidArgumentError, ["argument 1 (batch) leaf ['ids']", "object dtype", "Fix:"], []),
    ("numpy string array in autopar.plan", lambda: autopar.plan(
        step, {**STATE, "n": np.array(["x"])}, BATCH, cluster=CPU, mesh_shape=(2, 4)),
     InvalidArgumentError, ["argument 0 (state) leaf ['n']", "str32 dtype", "Fix:"], []),
    ("call with ShapeDtypeStructs", lambda: par()(
        jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), STATE), BATCH),
     InvalidArgumentError, ["argument 0 (state) leaf ['w']", "ShapeDtypeStruct",
                            "step.get_plan(", "autopar.plan("], []),
    ("call inside jax.jit", _run_under_jit, UnsupportedError, ["jax.jit", "Fix:"], []),
    ("unknown keyword argument", lambda: par()(STATE, BATCH, extra=1),
     InvalidArgumentError, ["'extra'", "Fix:"], []),
    ("keyword argument also positional", lambda: par()(STATE, BATCH, batch=BATCH),
     InvalidArgumentError, ["'batch'", "also passed by position", "Fix:"], []),
    ("donated array passed twice", _aliased_donation,
     InvalidArgumentError, ["donate_argnums=(0,)", "argument 1 (`batch`)['x']", "Fix:"], []),
    ("shard_map inside the step", lambda: par(_shard_map_step)(STATE, BATCH),
     UnsupportedError, ["shard_map", "test_errors.py", "Fix:"], []),
    # -- parallelize's arguments -----------------------------------------------------------
    ("method is the class", lambda: par(method=DataParallel),
     InvalidArgumentError, ["method=autopar.DataParallel", "call it: autopar.DataParallel()"],
     []),
    ("method is a string", lambda: par(method="data_parallel"),
     InvalidArgumentError, ["'data_parallel'", "Fix:", "DataParallel()"], []),
    ("autopar.plan method is the class", lambda: autopar.plan(
        step, STATE, BATCH, cluster=CPU, method=autopar.Zero3Parallel),
     InvalidArgumentError, ["call it: autopar.Zero3Parallel()"], []),
    ("mesh is not a Mesh", lambda: autopar.parallelize(step, mesh=(2, 4)),
     InvalidArgumentError, ["mesh=(2, 4)", "jax.make_mesh"], []),
    ("plan_cache is a number", lambda: autopar.parallelize(step, mesh=MESH, plan_cache=3),
     InvalidArgumentError, ["plan_cache=3", "directory"], []),
    ("batch_argnums default, one argument", lambda: par(lambda st: st)(STATE),
     InvalidArgumentError, ["batch_argnums=(1,) (the default)", "Fix:"], []),
    ("NNX step with the default batch_argnums", _nnx_step_with_default_batch_argnums,
     InvalidArgumentError, ["batch_argnums=(1,) (the default)", "optimizer", "Fix:",
                            "batch_argnums=(2,)"], []),
    ("batch_argnums given, out of range", lambda: par(batch_argnums=(3,))(STATE, BATCH),
     InvalidArgumentError, ["batch_argnums=(3,)", "Fix:"], ["(the default)"]),
    ("batch_argnums not ints", lambda: par(batch_argnums=1.5),
     InvalidArgumentError, ["batch_argnums=1.5", "batch_argnums=(1,)"], []),
    ("scalar leaf in the default batch", lambda: par()(STATE, {**BATCH, "s": jnp.float32(1)}),
     InvalidArgumentError, ["batch_argnums=(1,) (the default)", "batch['s']", "Fix:"], []),
    ("batch leaves disagree", lambda: par()(STATE, {**BATCH, "y": jnp.ones((8,))}),
     InvalidArgumentError, ["batch['y']", "16", "8", "Fix:"], []),
    ("static_argnums a name", lambda: par(static_argnums="cfg"),
     InvalidArgumentError, ["static_argnums='cfg'", "static_argnames='cfg'", "Fix:"], []),
    ("donate_argnums holds a bool", lambda: par(donate_argnums=(True,)),
     InvalidArgumentError, ["donate_argnums=(True,)", "element True", "Fix:"], []),
    ("batch_argnums None", lambda: par(batch_argnums=None),
     InvalidArgumentError, ["batch_argnums=None", "Fix:", "batch_argnums=(1,)"], []),
    ("autopar.plan static_argnums an int out of range", lambda: autopar.plan(
        step, STATE, BATCH, cluster=CPU, mesh_shape=(2, 4), static_argnums=5),
     InvalidArgumentError, ["static_argnums=(5,)", "Fix:"], []),
    ("autopar.plan donate_argnums not ints", lambda: autopar.plan(
        step, STATE, BATCH, cluster=CPU, mesh_shape=(2, 4), donate_argnums=[0.5]),
     InvalidArgumentError, ["donate_argnums=[0.5]", "element 0.5", "Fix:"], []),
    ("autopar.plan cluster given a name", lambda: autopar.plan(step, STATE, BATCH,
                                                               cluster="cpu"),
     InvalidArgumentError, ["cluster='cpu'", "ClusterSpec.preset(", "Fix:"], []),
    ("autopar.plan cluster None", lambda: autopar.plan(step, STATE, BATCH, cluster=None),
     InvalidArgumentError, ["cluster=None", "ClusterSpec.from_devices", "Fix:"], []),
    ("static_argnums out of range", lambda: par(static_argnums=(5,))(STATE, BATCH),
     InvalidArgumentError, ["static_argnums=(5,)", "Fix:"], []),
    ("donate_argnums out of range", lambda: par(donate_argnums=(7,))(STATE, BATCH),
     InvalidArgumentError, ["donate_argnums=(7,)", "Fix:"], []),
    ("static and batch argument", lambda: par(static_argnums=(1,))(STATE, (1, 2)),
     InvalidArgumentError, ["[1]", "static_argnums", "batch_argnums", "Fix:"], []),
    ("unknown static_argnames", lambda: par(static_argnames="cfg"),
     InvalidArgumentError, ["'cfg'", "Fix:"], []),
    ("in_shardings names a missing axis", lambda: par(in_shardings=(P("foo"), None))(
        STATE, BATCH), InvalidArgumentError, ["'foo'", "Fix:"], []),
    # -- batches that do not divide --------------------------------------------------------
    ("DataParallel microbatches do not divide", lambda: par(
        acc_step, method=DataParallel(num_microbatches=4))(STATE, {"x": jnp.ones((6, 16))}),
     InvalidArgumentError, ["num_microbatches=4", "argument 1 (batch) leaf ['x']", "(6, 16)",
                            "Fix:"], ["data[0]"]),
    ("DataParallel batch does not divide the mesh", lambda: par(method=DataParallel())(
        STATE, {"x": jnp.ones((6, 16))}),
     InvalidArgumentError, ["batch['x']", "(6, 16)", "Fix:"], []),
    ("sharding rule names a missing axis", lambda: par(method=ShardParallel(
        sharding_rules=((r"\['w'\]", ("foo",)),)))(STATE, BATCH),
     InvalidArgumentError, ["'foo'", "state['w']", "Fix:"], []),
    ("sharding rule has too many entries", lambda: par(method=ShardParallel(
        sharding_rules=((r"\['w'\]", (None, None, "model")),)))(STATE, BATCH),
     InvalidArgumentError, ["3 entries", "Fix:"], []),
    # -- method options --------------------------------------------------------------------
    ("num_microbatches=0", lambda: ShardParallel(num_microbatches=0),
     InvalidArgumentError, ["num_microbatches=0", ">= 1", "Fix:"], []),
    ("negative memory budget", lambda: ShardParallel(memory_budget_bytes=-1),
     InvalidArgumentError, ["memory_budget_bytes=-1", "Fix:"], []),
    ("memory budget as text", lambda: ShardParallel(memory_budget_bytes="16G"),
     InvalidArgumentError, ["memory_budget_bytes='16G'", "Fix:", "2**30"], []),
    ("unknown layer_reuse", lambda: ShardParallel(layer_reuse="sometimes"),
     InvalidArgumentError, ["layer_reuse='sometimes'", "'always'", "Fix:",
                            "layer_reuse='auto'"], []),
    ("solver as a string", lambda: ShardParallel(solver="highs"),
     InvalidArgumentError, ["solver='highs'", "SolverBackend"], []),
    ("unknown annotations mode", lambda: ShardParallel(annotations="strict"),
     InvalidArgumentError, ["'strict'", "'pin'", "Fix:"], []),
    ("unknown remat mode", lambda: ShardParallel(remat="sometimes"),
     InvalidArgumentError, ["'sometimes'", "selective", "Fix:"], []),
    ("batch_axis not a name", lambda: ShardParallel(batch_axis=3),
     InvalidArgumentError, ["batch_axis=3", "batch_axis='data'"], []),
    ("sharding rule not a pair", lambda: ShardParallel(sharding_rules=("kernel",)),
     InvalidArgumentError, ["sharding_rules[0]='kernel'", "(regex, spec)"], []),
    ("sharding rule bad regex", lambda: ShardParallel(sharding_rules=(("(", (None,)),)),
     InvalidArgumentError, ["'('", "regular expression"], []),
    ("num_layers=0", lambda: AutoLayerOption(num_layers=0),
     InvalidArgumentError, ["num_layers=0", ">= 1"], []),
    ("unknown logical_shapes", lambda: AutoStageOption(logical_shapes="diag"),
     InvalidArgumentError, ["'diag'", "'flat'"], []),
    ("num_stages=0", lambda: UniformStageOption(num_stages=0),
     InvalidArgumentError, ["num_stages=0", ">= 1"], []),
    ("layer spans with a gap", lambda: ManualStageOption(
        layer_spans=((0, 1), (3, 4)), submesh_shapes=((1, 4), (1, 4)),
        logical_shapes=((1, 4), (1, 4))),
     InvalidArgumentError, ["(3, 4)", "covering 0..L-1"], []),
    ("schedule as a string", lambda: PipeshardParallel(schedule="1f1b"),
     InvalidArgumentError, ["'1f1b'", "Schedule"], []),
    ("layer_option is the class", lambda: PipeshardParallel(layer_option=AutoLayerOption),
     InvalidArgumentError, ["AutoLayerOption", "AutoLayerOption(num_layers=...)"], []),
    ("unknown cluster preset", lambda: ClusterSpec.preset("dgx-z9000"),
     InvalidArgumentError, ["'dgx-z9000'", "cpu"], []),
    ("with_mesh given a string", lambda: par().with_mesh("mesh"),
     InvalidArgumentError, ["mesh='mesh'", "jax.make_mesh"], []),
    ("with_cluster given a name", lambda: par().with_cluster("cpu"),
     InvalidArgumentError, ["cluster='cpu'", "ClusterSpec.preset("], []),
    ("parallelize cluster given a name", lambda: par(cluster="dgx-a100"),
     InvalidArgumentError, ["cluster='dgx-a100'", "ClusterSpec.preset("], []),
    ("parallelize plan given JSON text", lambda: par(plan='{"version": 1}'),
     InvalidArgumentError, ["of type str", "ParallelPlan.from_json(text)"], []),
    ("autopar.plan mesh of another size", lambda: autopar.plan(
        step, STATE, BATCH, cluster=CPU, mesh_shape=(3, 3)),
     InvalidArgumentError, ["(3, 3)", "9 devices", "8"], []),
    ("batch_axis names a missing axis", lambda: par(method=ShardParallel(batch_axis="foo"))(
        STATE, BATCH), InvalidArgumentError, ["'foo'", "Fix:"], []),
    ("gradient accumulation on a 3-D mesh", lambda: autopar.parallelize(
        acc_step, mesh=jax.make_mesh((2, 2, 2), ("a", "b", "c")), plan_cache=False,
        method=ShardParallel(num_microbatches=2))(STATE, BATCH),
     InvalidArgumentError, ["(2, 2, 2)", "Fix:"], []),
    ("pipeline without autopar.value_and_grad", lambda: par(
        method=PipeshardParallel(num_microbatches=2))(STATE, BATCH),
     InvalidArgumentError, ["autopar.value_and_grad", "found 0", "Fix:"], []),
    ("ManualLayerOption without markers", lambda: par(acc_step, method=PipeshardParallel(
        num_microbatches=2, layer_option=autopar.ManualLayerOption()))(STATE, BATCH),
     InvalidArgumentError, ["mark_stage_boundary", "Fix:"], []),
    ("numpy string array leaf", lambda: par()(STATE, {**BATCH, "names": np.array(["a", "b"])}),
     InvalidArgumentError, ["argument 1 (batch) leaf ['names']", "str32 dtype", "Fix:"], []),
    ("autopar.grad of a non-scalar loss", lambda: autopar.grad(lambda x: x)(jnp.ones(3)),
     InvalidArgumentError, ["float32[3]", "Fix:"], []),
    ("autopar.grad argnums out of range", lambda: autopar.grad(
        lambda x: x.sum(), argnums=3)(jnp.ones(3)),
     InvalidArgumentError, ["argnums=3", "Fix:"], []),
    ("mark_stage_boundary on a string", lambda: autopar.mark_stage_boundary("abc"),
     InvalidArgumentError, ["'abc'", "Fix:"], []),
    ("init with a bad state_argnum", lambda: par().init(lambda: STATE, BATCH, state_argnum=5),
     InvalidArgumentError, ["state_argnum=5", "Fix:"], []),
    ("init_sharded with a state, not a function", lambda: autopar.init_sharded(
        STATE, par(), BATCH), InvalidArgumentError, ["create_state=", "Fix:"], []),
    ("save_checkpoint of a string leaf", lambda: autopar.save_checkpoint(
        "/tmp/autopar-test-errors-never-written", {"w": jnp.ones(2), "name": "run1"}, 1),
     InvalidArgumentError, ["['name']", "'run1'", "Fix:"], []),
    ("save_checkpoint negative step", lambda: autopar.save_checkpoint(
        "/tmp/autopar-test-errors-never-written", STATE, -1),
     InvalidArgumentError, ["step=-1", "Fix:"], []),
    ("restore a missing checkpoint", lambda: autopar.restore_checkpoint(
        "/nonexistent/autopar/ckpt", STATE),
     InvalidArgumentError, ["/nonexistent/autopar/ckpt", "Fix:"], []),
    ("dump of a file name", lambda: autopar.dump("plan.json"),
     InvalidArgumentError, ["got str", "ParallelPlan.from_json", "Fix:"], []),
    ("calibrate a plain function", lambda: autopar.calibrate(step),
     InvalidArgumentError, ["parallelized function", "Fix:"], []),
    # -- saved plans -----------------------------------------------------------------------
    ("plan JSON truncated", lambda: autopar.ParallelPlan.from_json(
        json.dumps(plan_json())[:200]),
     InvalidArgumentError, ["not valid JSON", "truncated", "Fix:"], []),
    ("plan JSON is a list", from_json("[]"), InvalidArgumentError, ["list", "[]", "Fix:"], []),
    ("plan JSON is another object", from_json('{"a": 1}'),
     PlanMismatchError, ["version None", "not a plan", "Fix:"], []),
    ("plan JSON of another version", lambda: autopar.ParallelPlan.from_json(
        edited_plan(lambda d: d.update(version=99))),
     PlanMismatchError, ["99", "Fix:"], []),
    ("plan JSON not text", lambda: autopar.ParallelPlan.from_json({"version": 1}),
     InvalidArgumentError, ["dict", "Fix:"], []),
    ("plan JSON missing a key", lambda: autopar.ParallelPlan.from_json(
        edited_plan(pop("inputs"))),
     InvalidArgumentError, ["'inputs'", "Fix:"], []),
    ("plan JSON malformed entry", lambda: autopar.ParallelPlan.from_json(
        edited_plan(lambda d: d["inputs"][0].pop("path"))),
     InvalidArgumentError, ["'inputs'", "path", "Fix:"], []),
    ("plan JSON spec off the mesh", lambda: autopar.ParallelPlan.from_json(
        edited_plan(with_input("spec", [[5]]))),
     PlanMismatchError, ["inputs[0]", "state['w']", "mesh axis 5", "Fix:"], []),
    ("plan JSON spec does not divide", lambda: autopar.ParallelPlan.from_json(
        edited_plan(lambda d: d["inputs"][0].update(shape=[6, 16], spec=[[1]]))),
     PlanMismatchError, ["inputs[0]", "state['w']", "size 6", "4 ways", "Fix:"], []),
    ("plan JSON shape not ints", edited(with_input("shape", ["a", 16])),
     InvalidArgumentError, ["inputs[0]", "['shape']", "['a', 16]", "Fix:"], []),
    ("plan JSON axis_names of another rank", edited(setter("axis_names", ["data"])),
     PlanMismatchError, ["axis_names ('data',)", "(2, 4)", "Fix:"], []),
    ("plan JSON stage not an int", edited(with_input("stage", "0")),
     InvalidArgumentError, ["inputs[0]", "['stage']", "'0'", "Fix:"], []),
    ("plan JSON stage out of range", edited(with_input("stage", 3)),
     PlanMismatchError, ["inputs[0]", "['stage'] is 3", "1 stage(s)", "Fix:"], []),
    ("plan JSON ilp missing a key", edited(dropper("ilp", "num_edges")),
     InvalidArgumentError, ["ilp lacks", "'num_edges'", "Fix:"], []),
    ("plan JSON ilp value of another kind", edited(setter("ilp", "solve_time_s", "fast")),
     InvalidArgumentError, ["ilp['solve_time_s']", "'fast'", "a number", "Fix:"], []),
    ("plan JSON ilp not an object", edited(setter("ilp", [1])),
     InvalidArgumentError, ["ilp is [1]", "Fix:"], []),
    ("plan JSON pipeline record cut short", edited(setter("pipeline", {"schedule": "1f1b"})),
     InvalidArgumentError, ["pipeline lacks", "'num_microbatches'", "Fix:"], []),
    ("plan JSON remat record cut short", edited(setter("remat", {"layers": ["none"]})),
     InvalidArgumentError, ["remat lacks", "'layer_boundaries'", "Fix:"], []),
    ("plan JSON alternative missing a key", edited(setter("alternatives", [{"name": "x"}])),
     InvalidArgumentError, ["alternatives[0] lacks", "'predicted_step_s'", "Fix:"], []),
    ("plan JSON alternative step not a number", edited(setter(
        "alternatives", [ALTERNATIVE, {**ALTERNATIVE, "predicted_step_s": "1 ms"}])),
     InvalidArgumentError, ["alternatives[1]['predicted_step_s']", "'1 ms'", "null", "Fix:"],
     []),
    ("plan JSON alternative not an object", edited(setter("alternatives", ["DataParallel"])),
     InvalidArgumentError, ["alternatives[0]", "'DataParallel'", "Fix:"], []),
    ("pipeline plan JSON unknown schedule", edited_pipeline(
        setter("pipeline", "schedule", "zigzag")),
     InvalidArgumentError, ["pipeline['schedule']", "'zigzag'", "'1f1b'", "Fix:"], []),
    ("pipeline plan JSON in_flight of another length", edited_pipeline(
        setter("pipeline", "in_flight", [1])),
     InvalidArgumentError, ["pipeline['in_flight']", "1 entries for 2 stage(s)", "Fix:"], []),
    ("pipeline plan JSON bubble not a number", edited_pipeline(
        setter("pipeline", "bubble_fraction", None)),
     InvalidArgumentError, ["pipeline['bubble_fraction']", "None", "Fix:"], []),
    ("pipeline plan JSON stage solution without fingerprint", edited_pipeline(
        dropper("stage_solutions", 1, "graph_fingerprint")),
     InvalidArgumentError, ["stage_solutions[1] lacks", "'graph_fingerprint'", "Fix:"], []),
    ("pipeline plan JSON stage solution cut short", edited_pipeline(
        dropper("stage_solutions", 0, "param_specs")),
     InvalidArgumentError, ["stage_solutions[0]", "does not load", "param_specs", "Fix:"], []),
    ("pipeline plan JSON stage solution ilp cut short", edited_pipeline(
        dropper("stage_solutions", 0, "ilp", "status")),
     InvalidArgumentError, ["stage_solutions[0]", "does not load", "status", "Fix:"], []),
    ("saved plan, other shapes", _saved_plan_other_shapes,
     PlanMismatchError, ["argument 0 leaf state['w']: (16, 16) float32 -> (32, 16) float32",
                         "argument 1 leaf batch['x']", "Fix:"], []),
]


@contextlib.contextmanager
def time_limit(seconds: int):
    """Fail (TimeoutError) instead of hanging."""
    def on_alarm(signum, frame):
        raise TimeoutError(f"the case ran longer than {seconds} s")
    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def test_the_table_is_large_and_names_are_unique():
    names = [c[0] for c in CASES]
    assert len(names) >= 40 and len(set(names)) == len(names)


@pytest.mark.parametrize("name,provoke,error,present,absent", CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_a_teaching_error(name, provoke, error, present, absent):
    with time_limit(CASE_TIMEOUT_S), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(autopar.AutoparError) as info:
            provoke()
    assert isinstance(info.value, error), f"{name}: {type(info.value).__name__}: {info.value}"
    message = str(info.value)
    for text in present:
        assert text in message, f"{name}: {text!r} not in: {message}"
    for text in absent:
        assert text not in message, f"{name}: {text!r} in: {message}"


# Cases that reach native code (XLA, the HiGHS solver) or read saved plans: run again in a
# fresh interpreter under a timeout, so that a hang there, which SIGALRM cannot interrupt, or
# a segfault fails this test instead of stalling or killing the whole run.
NATIVE_PREFIXES = ("plan JSON", "pipeline plan JSON", "saved plan", "shard_map",
                   "call inside jax.jit", "DataParallel", "sharding rule names",
                   "gradient accumulation on a 3-D mesh", "pipeline without",
                   "autopar.plan mesh of another size")
SUBPROCESS_TIMEOUT_S = 300
_CHILD = """
import sys, warnings
warnings.simplefilter("ignore")
import autopar, test_errors as t
cases = {c[0]: c for c in t.CASES}
for name in sys.argv[1:]:
    print("START", name, flush=True)
    try:
        cases[name][1]()
        got = "no error"
    except Exception as e:
        got = type(e).__name__
    print("GOT", name, "=", got, flush=True)
"""


def _last_started(out: str) -> str | None:
    started = [ln[6:] for ln in out.splitlines() if ln.startswith("START ")]
    return started[-1] if started else None


def test_native_cases_in_a_subprocess():
    names = [c[0] for c in CASES if c[0].startswith(NATIVE_PREFIXES)]
    assert len(names) >= 25
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(pathlib.Path(__file__).parent), str(pathlib.Path(__file__).parents[1]),
         str(pathlib.Path(autopar.__file__).parents[1]),
         os.environ.get("PYTHONPATH", "")])}
    try:
        done = subprocess.run([sys.executable, "-c", _CHILD, *names], env=env, text=True,
                              capture_output=True, timeout=SUBPROCESS_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        pytest.fail(f"hung over {SUBPROCESS_TIMEOUT_S} s in case {_last_started(out)!r}")
    got = dict(ln[4:].rsplit(" = ", 1) for ln in done.stdout.splitlines()
               if ln.startswith("GOT "))
    assert done.returncode == 0, (f"the interpreter died (exit {done.returncode}) in case "
                                  f"{_last_started(done.stdout)!r}: {done.stderr[-2000:]}")
    expected = {c[0]: c[2].__name__ for c in CASES if c[0] in names}
    assert got == expected


def test_none_argnums_mean_none():
    """static_argnums=None / donate_argnums=None as jax.jit reads them: no such arguments."""
    got = par(static_argnums=None, donate_argnums=None)(STATE, BATCH)
    want = jax.jit(step)(STATE, BATCH)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5),
                 got, want)
    p = autopar.plan(step, STATE, BATCH, cluster=CPU, mesh_shape=(2, 4),
                     static_argnums=None, donate_argnums=None)
    assert p.graph_fingerprint == autopar.plan(step, STATE, BATCH, cluster=CPU,
                                               mesh_shape=(2, 4)).graph_fingerprint


@pytest.mark.parametrize("data", [plan_json, pipeline_plan_json], ids=["shard", "pipeline"])
def test_real_plans_pass_the_checks_and_dump(data):
    """The checks refuse none of what a search writes, and what they pass dumps and reports."""
    d = data()
    plan = autopar.ParallelPlan.from_json(json.dumps(d))
    assert json.loads(plan.to_json()) == d
    assert "autopar plan" in autopar.dump(plan)
    assert "<html" in autopar.report(plan).lower()


# -- warnings: input that runs, but not as the user meant ------------------------------------

def _cholesky(x):
    return jnp.linalg.cholesky(x @ x.T + 64.0 * jnp.eye(64)).sum()


WARNINGS = [
    ("sharding rule matching no leaf", lambda: autopar.plan(
        step, STATE, BATCH, cluster=CPU, mesh_shape=(2, 4), method=ShardParallel(
            sharding_rules=((r"\['kernel'\]", (None, "model")),))),
     UserWarning, ["sharding_rules[0]", "kernel", "matches no input leaf", "state['w']",
                   "Fix:"]),
    ("num_layers capped", lambda: autopar.plan(
        _layer_model_step, [jnp.ones((8, 8))] * 2, {"x": jnp.ones((8, 8))}, cluster=CPU,
        mesh_shape=(1, 2), method=PipeshardParallel(
            num_microbatches=2, layer_option=AutoLayerOption(num_layers=64),
            stage_option=UniformStageOption(num_stages=1))),
     UserWarning, ["AutoLayerOption(num_layers=64)", "Fix:"]),
    ("pipeline with one microbatch", lambda: autopar.plan(
        _layer_model_step, [jnp.ones((8, 8))] * 2, {"x": jnp.ones((8, 8))}, cluster=CPU,
        mesh_shape=(1, 2), method=PipeshardParallel(
            layer_option=AutoLayerOption(num_layers=2),
            stage_option=UniformStageOption(num_stages=2))),
     UserWarning, ["num_microbatches=1", "no pipelining", "Fix:"]),
    ("large tensor replicated", lambda: autopar.plan(
        _cholesky, jax.ShapeDtypeStruct((64, 64), jnp.float32), cluster=CPU,
        mesh_shape=(2, 4), batch_argnums=()),
     autopar.FallbackWarning, ["cholesky", "32.00 KiB", "the largest: operand float32[64, 64]",
                               "test_errors.py", "Fix:"]),
]


@pytest.mark.parametrize("name,provoke,category,present", WARNINGS,
                         ids=[w[0] for w in WARNINGS])
def test_surprising_input_warns(name, provoke, category, present):
    with time_limit(CASE_TIMEOUT_S), pytest.warns(category) as record:
        provoke()
    messages = [str(w.message) for w in record if issubclass(w.category, category)]
    assert any(all(t in m for t in present) for m in messages), f"{name}: {messages}"


def test_capped_num_layers_warning_names_both_numbers():
    with time_limit(CASE_TIMEOUT_S), pytest.warns(UserWarning) as record:
        WARNINGS[1][1]()
    (message,) = [str(w.message) for w in record if "num_layers=64" in str(w.message)]
    import re
    used = re.search(r"cut into (\d+) layers, not 64", message)
    assert used and 1 <= int(used.group(1)) < 64, message


def test_a_matching_rule_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        autopar.plan(step, STATE, BATCH, cluster=CPU, mesh_shape=(2, 4), method=ShardParallel(
            sharding_rules=((r"\['w'\]", (None, "model")),)))
