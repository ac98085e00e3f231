"""The pipeline program (`lower_pipeline`) and its executor: structure of a 2-stage program,
`Executor.run` against `jax.jit` of the step (directly, under GPipe, with the in-flight throttle
at one call), its statistics, `retarget`, and a 4-stage step with auxiliary outputs, a tied
parameter and a skip connection over two stages."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import autopar
from autopar.core.enums import Schedule
from autopar.inter_op.apply_grad import PIPELINE
from autopar.inter_op.schedule import Phase, make_schedule
from autopar.inter_op.schedule_check import check_schedule
from autopar.inter_op.stages import AXIS_NAMES
from autopar.lowering.pipeline import PipelineProgram
from autopar.runtime.executor import Executor, _fused_tasks, retarget
from support.steps import assert_equivalent, make_case, mesh_of, run_steps, sgd_momentum_clip

M = 4


def close(a, b, rtol=2e-5):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        x, y = np.asarray(x), np.asarray(y)
        assert x.shape == y.shape and x.dtype == y.dtype
        scale = max(float(np.max(np.abs(y))), 1e-6) if y.size else 1.0
        assert np.max(np.abs(x - y), initial=0.0) <= rtol * scale


@pytest.fixture(scope="module")
def mlp():
    """A 2-stage pipeline of a 4-layer linen MLP (hidden 16) over 4 microbatches, 1F1B."""
    step, state, batches = make_case("mlp", "linen", sgd_momentum_clip(), batch_size=8,
                                     num_layers=4, hidden=16,
                                     value_and_grad=autopar.value_and_grad)
    method = autopar.PipeshardParallel(
        num_microbatches=M, schedule=Schedule.ONE_F_ONE_B, max_in_flight_calls=4,
        layer_option=autopar.AutoLayerOption(num_layers=4),
        stage_option=autopar.UniformStageOption(num_stages=2))
    par = autopar.parallelize(step, mesh=mesh_of((2, 4)), method=method)
    ref = run_steps(jax.jit(step), state, batches[:2])
    got = run_steps(par, state, batches[:2])
    case = dict(step=step, state=state, batches=batches, par=par, ref=ref, got=got,
                program=par.get_compiled(state, batches[0]))
    case["direct"] = run_program(case, case["program"])[1]
    return case


def run_program(mlp, program, fused=None):
    """Executor.run on a (modified) program, called the way ParallelizedFunction calls it;
    `fused` overrides which (stage, microbatch) tasks run forward and backward as one call."""
    par, state, batch = mlp["par"], mlp["state"], mlp["batches"][0]
    leaves = jax.tree_util.tree_leaves((state, batch))
    flat = [jax.device_put(x, s) for x, s in zip(leaves, program.in_shardings)]
    ex = Executor(program)
    if fused is not None:
        ex._fused = fused
    out = ex.run(flat)
    return ex, jax.tree_util.tree_unflatten(par.get_graph(state, batch).out_tree, out)


def test_pipeline_matches_jit_over_two_steps(mlp):
    assert_equivalent(mlp["ref"], mlp["got"], compare_params=True, rtol=2e-5)


def test_program_structure(mlp):
    prog = mlp["program"]
    assert isinstance(prog, PipelineProgram)
    assert len(prog.stages) == 2 and prog.num_microbatches == M
    assert prog.max_in_flight_calls == 4            # CPU devices: the throttle is on
    assert (prog.schedule.num_stages, prog.schedule.num_microbatches) == (2, M)
    devices = [set(int(d.id) for d in st.mesh.devices.flat) for st in prog.stages]
    assert devices == [{0, 1, 2, 3}, {4, 5, 6, 7}]
    for st in prog.stages:
        assert st.mesh.axis_names == AXIS_NAMES
        assert len(st.param_shardings) == len(st.slice.param_inputs)
        assert all(sh.mesh == st.mesh for sh in (*st.param_shardings, *st.data_shardings))
    # The pipeline segment has no jitted function of its own; the apply segments do.
    for seg, fn in zip(prog.placement.segments, prog.segment_fns):
        assert (fn is None) == (seg.stage == PIPELINE)
    # Each step input is committed to the mesh of the stage that holds it.
    for s, sh in zip(prog.placement.input_stage, prog.in_shardings):
        assert sh.mesh == prog.stages[s].mesh
    # Activations sent from stage 0 are received with stage 1's sharding.
    s0, s1 = prog.stages
    assert set(s0.out_shardings) & set(s1.act_shardings)
    assert all(sh.mesh == s1.mesh for sh in s1.act_shardings.values())


def test_stats_of_a_1f1b_step(mlp):
    par, state, batch = mlp["par"], mlp["state"], mlp["batches"][0]
    stats = par.get_executor(state, batch).stats
    # the last stage runs each microbatch's forward and backward in one call: keeps none
    assert stats.max_live_microbatches == [2, 0]
    stage_calls = 2 * M + M                          # stage 0: forward + backward; stage 1 fused
    apply_calls = sum(s.stage != PIPELINE for s in mlp["program"].placement.segments)
    assert stats.num_dispatches >= stage_calls + apply_calls
    # activations forward and cotangents backward cross the submeshes for every microbatch
    assert stats.num_transfers >= 2 * M


def test_executor_run_directly_matches_jit(mlp):
    state, loss, grads = mlp["direct"]
    ref_state, ref_loss, ref_grads = jax.jit(mlp["step"])(mlp["state"], mlp["batches"][0])
    close(loss, ref_loss)
    close(grads, ref_grads)
    close(state.params, ref_state.params)
    close(state.opt_state, ref_state.opt_state)
    # new state lands back where the step's inputs live, so the next step needs no moves
    for x, sh in zip(jax.tree_util.tree_leaves(state), mlp["program"].in_shardings):
        assert x.sharding == sh


def _as_run(schedule, fused) -> list:
    """The table's tasks in the order the executor runs them: a fused microbatch's B (and W)
    right after its F (one call runs them)."""
    out = []
    for t in schedule.order():
        if (t.stage, t.microbatch) not in fused:
            out.append(t)
        elif t.phase is Phase.FORWARD:
            out += [dataclasses.replace(t, phase=ph) for ph in Phase
                    if schedule.split_backward or ph is not Phase.WEIGHT]
    return out


@pytest.mark.parametrize("schedule", [Schedule.ONE_F_ONE_B, Schedule.GPIPE,
                                      Schedule.ZERO_BUBBLE_H1, Schedule.ZERO_BUBBLE_H2])
def test_the_executor_runs_the_tasks_in_the_tables_order(mlp, schedule):
    """Cost model and runtime agree: the order the executor logs is the table's clock order
    (fused last-stage tasks together), which `check_schedule` accepts; the zero-bubble
    tables run the backward as B and W executables and give the same step."""
    table = make_schedule(schedule, 2, M)
    ex, out = run_program(mlp, dataclasses.replace(mlp["program"], schedule=table))
    close(out, mlp["direct"])
    assert ex.stats.order == _as_run(table, ex._fused)
    assert len(ex.stats.order) == (3 if table.split_backward else 2) * 2 * M
    # B: each layer's input-gradient matmul; W: each kernel's gradient matmul. Stage 0 sends
    # no gradient back: its whole backward is W.
    s0, s1 = mlp["program"].stages
    for st in (s0, s1):
        dots = lambda ids: sum(st.graph.nodes[n].primitive == "dot_general" for n in ids)
        assert not set(st.backward_split.input_nodes) & set(st.backward_split.weight_nodes)
        kernels = len(st.slice.param_inputs) // 2
        assert dots(st.backward_split.input_nodes) == (kernels if st is s1 else 0)
        assert dots(st.backward_split.weight_nodes) >= kernels
    assert dots(s1.backward_split.weight_nodes) == 2 and not s0.backward_split.input_nodes
    ran = [[] for _ in range(table.num_groups)]
    for t in ex.stats.order:
        ran[table.group_of(t.stage)].append(t)
    assert [tuple(r) for r in ran] == [table.tasks_of(g) for g in range(2)]
    # the fused pairs break no dependency: as a table (one task per clock) it checks
    one = tuple(tuple(t if g == table.group_of(t.stage) else None for g in range(2))
                for t in ex.stats.order)
    check_schedule(dataclasses.replace(table, clocks=one))


@pytest.mark.parametrize("limit", [1, None])
def test_in_flight_throttle_keeps_results(mlp, limit):
    program = dataclasses.replace(mlp["program"], max_in_flight_calls=limit)
    ex, out = run_program(mlp, program)
    close(out, mlp["direct"], rtol=0)
    if limit is None:
        assert len(ex._window) == 0                  # nothing is tracked
    else:
        assert len(ex._window) <= limit


def test_gpipe_schedule_on_the_same_executables(mlp):
    program = dataclasses.replace(mlp["program"], schedule=make_schedule(Schedule.GPIPE, 2, M))
    ex, out = run_program(mlp, program)
    assert ex.stats.max_live_microbatches == [M, M]   # GPipe: B0 follows F3, nothing fused
    close(out, mlp["direct"])


# -- retarget ------------------------------------------------------------------------------

def _mesh(shape, first):
    n = int(np.prod(shape))
    return jax.sharding.Mesh(np.array(jax.devices()[first:first + n]).reshape(shape),
                             AXIS_NAMES)


def testretarget_keeps_a_dividing_spec():
    x = jax.device_put(jnp.zeros((4, 6)), NamedSharding(_mesh((2, 2), 0), P("data", None)))
    target = _mesh((2, 2), 4)
    sh = retarget(x, target)
    assert sh.mesh == target and sh.spec == P("data", None)
    y = jax.device_put(jnp.zeros((4, 6)), NamedSharding(_mesh((1, 2), 0), P(None, "model")))
    assert retarget(y, _mesh((2, 3), 2)).spec == P(None, "model")       # 6 % 3 == 0


def testretarget_replicates_when_the_spec_does_not_divide():
    x = jax.device_put(jnp.zeros((2, 6)), NamedSharding(_mesh((2, 2), 0), P("data", None)))
    sh = retarget(x, _mesh((4, 1), 4))           # 2 rows over 4 devices
    assert sh.spec == P() and sh.mesh.devices.size == 4
    y = jax.device_put(jnp.zeros((4, 4)), NamedSharding(_mesh((2, 2), 0),
                                                      P(("data", "model"), None)))
    assert retarget(y, _mesh((2, 4), 0)).spec == P()                     # 4 % 8 != 0
    assert retarget(y, _mesh((2, 2), 4)).spec == P(("data", "model"), None)


def testretarget_of_a_host_value_is_replicated():
    target = _mesh((1, 2), 0)
    assert retarget(np.zeros((3, 3)), target) == NamedSharding(target, P())


def testretarget_to_a_mesh_without_the_axis_replicates():
    x = jax.device_put(jnp.zeros((4,)), NamedSharding(_mesh((2, 2), 0), P("data")))
    other = jax.sharding.Mesh(np.array(jax.devices()[4:6]), ("batch",))
    assert retarget(x, other).spec == P()


# -- three stages: aux outputs, a tied parameter, a skip over a stage ------------------------

H, B = 16, 8


def _params(extra=False):
    key = jax.random.key(0)
    p = {f"l{i}": jax.random.normal(jax.random.fold_in(key, i), (H, H)) * 0.3
         for i in range(3)}
    if extra:
        p["unused"] = jnp.ones((H,))
    return p


BATCH = {"x": jax.random.normal(jax.random.key(10), (B, H)),
         "y": jax.random.normal(jax.random.key(11), (B, H))}


def marked_loss(p, x, y):
    h0 = autopar.mark_stage_boundary(jnp.tanh(x @ p["l0"]))
    h1 = autopar.mark_stage_boundary(jnp.tanh(h0 @ p["l1"]))
    out = (jnp.tanh(h1 @ p["l2"]) + h0) @ p["l0"].T          # skip from stage 0; tied l0
    err = out - y
    return jnp.mean(err ** 2), {"mae": jnp.mean(jnp.abs(err)), "count": jnp.sum(err > 0)}


def aux_step(params, batch):
    (loss, aux), grads = autopar.value_and_grad(marked_loss, has_aux=True)(
        params, batch["x"], batch["y"])
    return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads), loss, aux, grads


def three_stages(num_microbatches=M):
    """One layer per stage, two devices each (six of the eight devices)."""
    return autopar.parallelize(aux_step, mesh=mesh_of((2, 3)), method=autopar.PipeshardParallel(
        num_microbatches=num_microbatches, layer_option=autopar.ManualLayerOption(),
        stage_option=autopar.UniformStageOption(num_stages=3)))


def test_three_stages_with_aux_tied_parameter_and_skip_match_jit():
    par = three_stages()
    params = _params()
    new, loss, aux, grads = par(params, BATCH)
    want_new, want_loss, want_aux, want_grads = jax.jit(aux_step)(params, BATCH)
    close(loss, want_loss)
    close(aux["mae"], want_aux["mae"])            # float aux: mean of the microbatch means
    assert aux["count"].dtype == jnp.int32
    assert int(aux["count"]) == int(want_aux["count"])   # integer aux: summed
    close(grads, want_grads)                      # l0's gradient summed over stages 0 and 2
    close(new, want_new)
    prog = par.get_compiled(params, BATCH)
    slices = [st.slice for st in prog.stages]
    assert [sl.param_inputs for sl in slices] == [(0,), (1,), (0, 2)]
    assert [len(st.mesh.devices.flat) for st in prog.stages] == [2, 2, 2]
    (h0,) = slices[1].act_inputs
    assert h0 in slices[0].outputs and h0 in slices[2].act_inputs    # skips stage 1
    assert h0 not in slices[1].outputs
    assert par.get_executor(params, BATCH).stats.max_live_microbatches == [3, 2, 0]


def test_parameter_unused_by_the_loss_gets_a_zero_gradient():
    par = three_stages(num_microbatches=1)
    params = _params(extra=True)
    new, loss, aux, grads = par(params, BATCH)
    want = jax.jit(aux_step)(params, BATCH)
    np.testing.assert_array_equal(np.asarray(grads["unused"]), np.zeros(H))
    close((new, loss, grads), (want[0], want[1], want[3]))


# -- fused last-stage tasks -------------------------------------------------------------------

def test_fused_tasks_are_the_last_stages_adjacent_forward_and_backward():
    assert _fused_tasks(make_schedule(Schedule.ONE_F_ONE_B, 2, 3)) == {(1, 0), (1, 1), (1, 2)}
    assert _fused_tasks(make_schedule(Schedule.GPIPE, 2, 3)) == set()    # F0 F1 F2 B0 ...
    assert _fused_tasks(make_schedule(Schedule.GPIPE, 2, 1)) == {(1, 0)}
    assert _fused_tasks(make_schedule(Schedule.ONE_F_ONE_B, 1, 4)) == {(0, m) for m in range(4)}


def test_unfused_last_stage_gives_the_same_step(mlp):
    """The fused call and the forward/backward pair compute the same thing."""
    ex, out = run_program(mlp, mlp["program"], fused=frozenset())
    close(out, mlp["direct"])
    assert ex.stats.max_live_microbatches == [2, 1]


# -- a loss that closes over concrete arrays -------------------------------------------------

def const_loss(p, x, y):
    """Reads two arrays the step closes over: a numpy range and a list made an array."""
    h = autopar.mark_stage_boundary(jnp.tanh(x @ p["l0"]))
    h = autopar.mark_stage_boundary(jnp.tanh(h @ p["l1"]))
    out = h @ p["l2"] + np.arange(H, dtype=np.float32) * jnp.array([0.5, -0.25] * (H // 2))
    return jnp.mean((out - y) ** 2)


def const_step(params, batch):
    loss, grads = autopar.value_and_grad(const_loss)(params, batch["x"], batch["y"])
    new = jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)
    return new, loss, grads, jnp.array([1.0, 2.0])     # a result that is a constant too


@pytest.mark.parametrize("method", [
    autopar.ShardParallel(num_microbatches=2),
    autopar.PipeshardParallel(num_microbatches=1, layer_option=autopar.ManualLayerOption(),
                              stage_option=autopar.UniformStageOption(num_stages=3)),
    autopar.PipeshardParallel(num_microbatches=2, layer_option=autopar.ManualLayerOption(),
                              stage_option=autopar.UniformStageOption(num_stages=3)),
], ids=["accumulate-2", "pipeline-1", "pipeline-2"])
def test_loss_closing_over_concrete_arrays_matches_jit(method):
    """Closed-over arrays are constants of the step and operands of the gradient marker; the
    executor places them itself (issue 13, item 1: this raised StopIteration)."""
    par = autopar.parallelize(const_step, mesh=mesh_of((2, 3)), method=method)
    params = _params()
    want = jax.jit(const_step)(params, BATCH)
    got = par(params, BATCH)
    close(got, want)
    ex = par.get_executor(params, BATCH)
    transfers = ex.stats.num_transfers
    close(par(got[0], BATCH), jax.jit(const_step)(want[0], BATCH))      # a second step
    if ex.p.whole_step is not None:     # accumulation: one executable holds the constants
        assert (ex.stats.num_dispatches, ex.stats.num_transfers) == (1, 0)
    else:       # the constants were placed by the first step and are reused
        assert ex.stats.num_transfers < transfers
