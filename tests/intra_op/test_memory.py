"""The memory model (`autopar.intra_op.memory`): the planner's peak per device against XLA's
`memory_analysis()`, and the ILP's memory points against `peak_memory`."""
import textwrap

import numpy as np
import optax
import pytest

import autopar
from autopar.cost.model import CostModel
from autopar.intra_op import ilp
from autopar.intra_op.hosting import hosted_temporaries, written_results
from autopar.intra_op.memory import (
    dead_nodes,
    memory_model,
    predicted_peak_bytes,
    run_order,
    schedule,
    tensor_bytes,
)
from autopar.intra_op.solve import build_intra_op, choice_peak, peak_memory, solve_built
from support.steps import make_case, mesh_of, run_under_memory_scheduler, sgd_momentum_clip


@pytest.mark.parametrize("value_and_grad", ["jax", "autopar-full"])
def test_ilp_memory_points_agree_with_peak_memory(value_and_grad):
    """The ILP's peak (its memory points, built for every budget) of the chosen plan is the
    plan's `peak_memory`, with and without rematerialized layers."""
    kw = {} if value_and_grad == "jax" else dict(value_and_grad=autopar.value_and_grad)
    step, state, batches = make_case("gpt", "linen", sgd_momentum_clip(), **kw)
    method = autopar.ShardParallel(remat="full" if kw else "none", memory_budget_bytes=10**9)
    par = autopar.parallelize(step, mesh=mesh_of((2, 4)), plan_cache=False, method=method)
    par.get_plan(state, batches[0])
    graph = par.get_graph(state, batches[0])
    cost = CostModel(mesh=par.cluster.logical_mesh((2, 4), ("data", "model")))
    problem = build_intra_op(graph, cost, method, graph.carried_outputs, points_above=0)
    assignment = solve_built(problem)
    rng = np.random.default_rng(0)
    choices = [np.asarray([0] * len(problem.built.group_size))]
    choices += [(rng.random(len(problem.built.group_size)) * problem.built.group_size
                 ).astype(int) for _ in range(3)]
    for choice in choices:
        assert ilp.peak_memory_bytes(problem.built.problem, tuple(choice)) == pytest.approx(
            choice_peak(graph, problem.built, choice, (2, 4)), rel=1e-9)
    assert assignment.peak_memory_bytes > 0


def test_model_rules_on_a_small_step():
    """Dead nodes read nothing, the tail (no matmul after it) runs last, and the arguments
    and results count for the whole step."""
    step, state, batches = make_case("mlp", "linen", sgd_momentum_clip())
    par = autopar.parallelize(step, mesh=mesh_of((2, 4)), plan_cache=False)
    graph = par.get_graph(state, batches[0])
    model = memory_model(graph)
    order = run_order(graph)
    assert sorted(order) == list(range(len(graph.nodes)))
    dots = [n.id for n in graph.nodes if n.primitive == "dot_general"]
    assert model.pos[dots[-1]] == max(model.pos[d] for d in dots)   # a weight gradient
    assert all(model.whole[t] for t in graph.inputs)
    assert all(model.whole[t] or not model.counted[t] for t in graph.outputs)
    dead = dead_nodes(graph)
    assert not any(model.counted[o] for n in dead for o in graph.nodes[n].outputs)


_BAND = textwrap.dedent("""
    import json, sys
    import autopar, optax
    from autopar.verify.memory_check import compiled_bytes
    from autopar.models.gpt import GPTConfig
    from support.steps import LONG_LM, make_case, mesh_of
    wide = GPTConfig(vocab_size=256, seq_len=128, num_layers=2, hidden=64, num_heads=4)
    out = []
    for name, kw, shape in [("mlp", dict(hidden=256, batch_size=128, num_layers=4), (1, 8)),
                            ("mlp", dict(hidden=256, batch_size=128, num_layers=4), (2, 4)),
                            ("gpt", dict(gpt_config=LONG_LM), (2, 4)),
                            ("gpt", dict(gpt_config=wide), (2, 4))]:
        step, state, batches = make_case(name, "linen", optax.adam(1e-3), **kw)
        par = autopar.parallelize(step, mesh=mesh_of(shape), plan_cache=False)
        out.append([name, list(shape), par.get_plan(state, batches[0]).peak_memory_bytes,
                    compiled_bytes(par.get_compiled(state, batches[0]))])
    print(json.dumps(out))
""")


# Slow: make test checks the default scheduler's band; this subprocess runs in test-slow.
@pytest.mark.slow
def test_prediction_within_15_percent_under_the_memory_scheduler():
    """An MLP on 1x8 and 2x4 and two GPTs (seq 128) on 2x4: predicted peak within 15% of the
    compiled executable's, under XLA:CPU's memory-minimizing scheduler (GPU/TPU schedule for
    memory too; the flag is process-wide, hence the subprocess). The width-64 GPT with Adam
    needs the result-buffer rule (`hosted_temporaries`): without it, 1.16 x compiled."""
    rows = run_under_memory_scheduler(_BAND, timeout_s=600)
    assert len(rows) == 4
    for name, shape, predicted, compiled in rows:
        assert 0.85 <= predicted / compiled <= 1.15, (name, shape, predicted, compiled)


def test_temporaries_hosted_in_result_buffers():
    """XLA puts temporaries into the buffers of results not yet written: each hosted temporary
    fits a result's buffer and ends before that result is written, and the plan reports the
    peak without them (below the ILP's bound, at least the arguments and results)."""
    step, state, batches = make_case("gpt", "linen", optax.adam(1e-3))
    par = autopar.parallelize(step, mesh=mesh_of((2, 4)), plan_cache=False)
    plan = par.get_plan(state, batches[0])
    graph = par.get_graph(state, batches[0])
    cost = CostModel(mesh=par.cluster.logical_mesh((2, 4), ("data", "model")))
    solved = build_and_solve(graph, cost)
    specs, collective = solved.tensor_specs, solved.node_collective_bytes
    events = schedule(graph)
    per = tensor_bytes(graph, events.model, specs, (2, 4))
    hosted = hosted_temporaries(graph, events, per)
    assert hosted
    born = {t: p for p, ts in events.born.items() for t in ts}
    results = written_results(graph, events.model)
    ranges = [(born[t], events.model.end[t], per[t]) for t in hosted]
    for _a, b, size in ranges:
        assert any(per[r] >= size and events.model.pos[graph.tensors[r].producer] > b
                   for r in results)
    bound = peak_memory(graph, specs, (2, 4), collective)
    whole = sum(per[t] for t in events.start) + sum(per[t] for t in results
                                                     if t not in events.start)
    predicted = predicted_peak_bytes(graph, specs, (2, 4), collective)
    assert plan.peak_memory_bytes == pytest.approx(predicted, rel=1e-9)
    assert whole <= predicted < bound


def build_and_solve(graph, cost):
    return solve_built(build_intra_op(graph, cost, autopar.ShardParallel(),
                                      graph.carried_outputs))


_ZERO3 = textwrap.dedent("""
    import json
    import jax, optax
    import autopar
    from flax.training import train_state
    from autopar.cost.model import CostModel
    from autopar.intra_op.memory import predicted_peak_bytes
    from autopar.intra_op.solve import build_intra_op, solve_built
    from autopar.verify.memory_check import compiled_bytes
    from autopar.models.mlp import MLP, make_mlp_batch, mse_loss
    from support.steps import mesh_of
    batch = make_mlp_batch(jax.random.key(1), 32, 256, 256)
    net = MLP(num_layers=4, hidden=256)
    state = train_state.TrainState.create(apply_fn=net.apply, tx=optax.adam(1e-3),
                                          params=net.init(jax.random.key(0), batch["x"]))

    def step(state, batch):
        loss, grads = jax.value_and_grad(
            lambda p: mse_loss(state.apply_fn(p, batch["x"]), batch["y"]))(state.params)
        return state.apply_gradients(grads=grads), loss
    method = autopar.Zero3Parallel()
    par = autopar.parallelize(step, mesh=mesh_of((2, 4)), plan_cache=False, method=method,
                              donate_argnums=(0,))
    plan = par.get_plan(state, batch)
    graph = par.get_graph(state, batch)
    cost = CostModel(mesh=par.cluster.logical_mesh((2, 4), ("data", "model")))
    solved = solve_built(build_intra_op(graph, cost, method, graph.carried_outputs))
    without = predicted_peak_bytes(graph, solved.tensor_specs, (2, 4))
    partial = sum(p for p, _ in solved.node_collective_bytes)
    print(json.dumps([plan.peak_memory_bytes, without, partial,
                      compiled_bytes(par.get_compiled(state, batch))]))
""")


def test_gradient_collective_buffers_under_zero3():
    """ZeRO-3 (donated, 2x4) on an MLP under the memory scheduler: XLA:CPU computes every
    weight gradient whole, all-reduces them together after the last weight-gradient matmul
    (its operands and results live together) and slices the shard; the prediction counts
    those buffers (`memory.collective_buffers`) and is within 15% of the compiled bytes,
    where it is far below without them."""
    predicted, without, partial, compiled = run_under_memory_scheduler(_ZERO3, timeout_s=600)
    assert partial > 0
    assert predicted == pytest.approx(without + 2 * partial, rel=0.25)
    assert 0.85 <= predicted / compiled <= 1.15, (predicted, compiled)
    assert without / compiled < 0.85, (without, compiled)


def test_resharded_copies_count_once_from_first_to_last_consumer():
    """A tensor moved to one layout for two consumers is one copy, live from the first to
    the last (XLA's CSE merges the two collectives); another layout is another copy."""
    from autopar.intra_op.memory import copy_buffers
    step, state, batches = make_case("mlp", "linen", sgd_momentum_clip())
    graph = autopar.parallelize(step, mesh=mesh_of((2, 4)), plan_cache=False).get_graph(
        state, batches[0])
    events = schedule(graph)
    consumers = graph.consumers()
    tid = next(t.id for t in graph.tensors if t.rank == 2 and len(consumers[t.id]) >= 2)
    first, last = sorted(consumers[tid], key=lambda n: events.model.pos[n])[::len(
        consumers[tid]) - 1]
    rows, cols = ((0,), ()), ((), (1,))
    copies = copy_buffers(graph, events, [(tid, first, rows), (tid, last, rows),
                                          (tid, last, cols)], (2, 4))
    nbytes = graph.tensors[tid].nbytes
    assert sorted(copies) == sorted([
        (events.model.pos[first], events.model.pos[last], nbytes / 2),
        (events.model.pos[last], events.model.pos[last], nbytes / 4)])


_WRN = textwrap.dedent("""
    import json
    import jax, optax
    from flax.training import train_state
    import autopar
    from autopar.models import wide_resnet as wrn
    from autopar.verify.memory_check import compiled_bytes
    from support.steps import mesh_of
    cfg = wrn.WideResNetConfig(image_size=16, depth=10, width=2, base_channels=16)
    batch = wrn.make_image_batch(jax.random.key(1), 16, cfg)
    net = wrn.WideResNet(cfg)
    state = train_state.TrainState.create(apply_fn=net.apply, tx=optax.adam(1e-3),
                                          params=net.init(jax.random.key(0), batch["images"]))
    def step(state, batch):
        loss, grads = jax.value_and_grad(lambda p: wrn.classification_loss(
            state.apply_fn(p, batch["images"]), batch["labels"]))(state.params)
        return state.apply_gradients(grads=grads), loss
    par = autopar.parallelize(step, mesh=mesh_of((1, 8)), plan_cache=False)
    plan = par.get_plan(state, batch)
    print(json.dumps([len(plan.reshards), plan.peak_memory_bytes,
                      compiled_bytes(par.get_compiled(state, batch))]))
""")


# Slow (a 30 s compile in a subprocess under the memory scheduler): make test checks the rule
# on its own (the test above) and in the least-memory error (the test below).
@pytest.mark.slow
def test_wide_resnet_prediction_counts_the_copies_kept_for_the_backward():
    """Wide-ResNet on 1x8 reshards activations that the backward reads again: XLA keeps the
    copies from the forward to the backward (0.81 of compiled when they were not counted);
    with them the prediction is within 10% under the memory-minimizing scheduler."""
    reshards, predicted, compiled = run_under_memory_scheduler(_WRN, timeout_s=600)
    assert reshards > 0
    assert 0.9 <= predicted / compiled <= 1.1, (predicted, compiled)


def test_least_memory_in_the_error_counts_the_copies_xla_compiles():
    """A budget nothing fits: the least memory the error names is what that plan compiles to,
    its resharded copies included (the search's rows alone said 4,104 bytes for 12,292)."""
    import jax.numpy as jnp

    from autopar.verify.memory_check import compiled_bytes

    def layer(w, x):
        return jnp.tanh(x @ w).sum()
    w, x = jnp.ones((64, 64)), jnp.ones((32, 64))
    with pytest.raises(autopar.InfeasiblePlanError) as e:
        autopar.parallelize(layer, mesh=mesh_of((2, 4)), method=autopar.ShardParallel(
            memory_budget_bytes=100)).get_plan(w, x)
    par = autopar.parallelize(layer, mesh=mesh_of((2, 4)), method=autopar.ShardParallel(
        memory_budget_bytes=e.value.needed_bytes))
    plan = par.get_plan(w, x)
    assert plan.peak_memory_bytes <= e.value.needed_bytes
    assert compiled_bytes(par.get_compiled(w, x)) <= e.value.needed_bytes
    assert "resharded copies included" in str(e.value)
