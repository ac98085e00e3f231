"""Rematerialization on one mesh (`remat_plan`): a step whose fastest plan does not fit its
budget is re-traced with the loss's layers under `jax.checkpoint`, recomputing as little as
fits; the plan records the choice, replays it, and trains like jax.jit."""
import textwrap

import jax
import jax.numpy as jnp
import pytest

import autopar
from autopar.frontend.tracer import trace
from autopar.inter_op.remat_plan import step_layers
from autopar.inter_op.step_remat import forward_nodes
from autopar.models.gpt import GPTConfig
from support.steps import (
    assert_equivalent,
    long_lm_case,
    make_case,
    mesh_of,
    run_steps,
    run_under_memory_scheduler,
    sgd_momentum_clip,
)


@pytest.fixture(scope="module")
def case():
    return long_lm_case()


def _least(step, state, batch) -> int:
    """The least memory any plan without recomputation needs (the error at a tiny budget)."""
    with pytest.raises(autopar.InfeasiblePlanError) as e:
        autopar.parallelize(step, mesh=mesh_of((2, 4)), method=autopar.ShardParallel(
            remat="none", memory_budget_bytes=1000)).get_plan(state, batch)
    return e.value.needed_bytes


_ACCEPTANCE = textwrap.dedent("""
    import json
    import jax
    import autopar
    from autopar.verify.memory_check import compiled_bytes
    from autopar.models.gpt import GPTConfig
    from support.steps import assert_equivalent, make_case, mesh_of, run_steps, sgd_momentum_clip

    config = GPTConfig(vocab_size=64, seq_len=256, num_layers=8, hidden=32, num_heads=2)
    step, state, batches = make_case("gpt", "linen", sgd_momentum_clip(), batch_size=16,
                                     value_and_grad=autopar.value_and_grad, gpt_config=config)
    batches = batches[:2]

    def needed(budget):
        try:
            autopar.parallelize(step, mesh=mesh_of((2, 4)), method=autopar.ShardParallel(
                remat="none", memory_budget_bytes=budget)).get_plan(state, batches[0])
        except autopar.InfeasiblePlanError as e:
            return e.needed_bytes

    least = needed(1000)
    budget = int(0.7 * least)
    par = autopar.parallelize(step, mesh=mesh_of((2, 4)),
                              method=autopar.ShardParallel(memory_budget_bytes=budget))
    plan = par.get_plan(state, batches[0])
    assert_equivalent(run_steps(jax.jit(step), state, batches), run_steps(par, state, batches),
                      compare_params=True, rtol=2e-5, smooth=True)
    again = autopar.ParallelPlan.from_json(plan.to_json())
    replay = autopar.parallelize(step, mesh=mesh_of((2, 4)), plan=again)
    print(json.dumps(dict(
        least=least, budget=budget, none_needed=needed(budget), predicted=plan.peak_memory_bytes,
        compiled=compiled_bytes(par.get_compiled(state, batches[0])), remat=plan.remat,
        dumped="rematerialization" in autopar.dump(plan), timings=list(plan.timings_s),
        replay_barrier="optimization_barrier" in replay.lower(state, batches[0]).as_text(),
        replay_remat=again.remat == plan.remat)))
""")


@pytest.mark.slow   # the remat search at this size takes minutes on 2 cores: make test-slow
def test_shard_parallel_recomputes_to_fit_70_percent_of_its_least_memory():
    """Acceptance (issue 15): an activation-heavy LM (8 blocks, sequence 256, width 32) on 2x4
    at 70% of the least memory any plan needs without recomputation: remat='none' raises
    carrying that least; the default finds a remat plan whose predicted peak fits, whose
    compiled memory fits, and which trains like jax.jit; the plan records, dumps and replays
    the choice. Under XLA:CPU's memory-minimizing scheduler (what GPU/TPU do; its default
    scheduler ignores memory, so recomputation saves little there: see the next test)."""
    r = run_under_memory_scheduler(_ACCEPTANCE)
    assert r["none_needed"] == r["least"]
    assert r["predicted"] <= r["budget"] and r["compiled"] <= r["budget"]
    layers = r["remat"]["layers"]
    assert any(c != "none" for c in layers) and len(layers) == len(
        r["remat"]["layer_boundaries"]) - 1
    assert r["dumped"] and "remat_search" in r["timings"]
    assert r["replay_barrier"] and r["replay_remat"]


# Slow: the compile check at the edge; make test has it in test_step_remat's acceptance and
# tests/verify/test_memory_check.py.
@pytest.mark.slow
def test_a_remat_plan_at_the_edge_of_its_budget_is_compiled_and_never_over_it(case):
    """At 85% of the least memory, even recomputing every layer leaves the plan at the very
    edge of the budget (this 2-block LM keeps its attention scores); the plan is compiled
    and checked (memory_check): either XLA's peak fits the budget, or the error says what
    XLA compiled it to. Never a plan silently over its budget."""
    step, state, batches, _ = case
    budget = int(0.85 * _least(step, state, batches[0]))
    try:
        plan = autopar.parallelize(step, mesh=mesh_of((2, 4)), method=autopar.ShardParallel(
            memory_budget_bytes=budget)).get_plan(state, batches[0])
    except autopar.InfeasiblePlanError as e:
        assert "XLA compiled it to" in str(e)
        assert e.needed_bytes > budget and e.budget_bytes == budget
    else:
        assert plan.remat and plan.measured["compiled_bytes"] <= budget


def test_fitting_plans_keep_todays_behaviour(case):
    """remat='auto' with room to spare, and remat='none', give the plan without recomputation."""
    step, state, batches, _ = case
    plans = [autopar.parallelize(step, mesh=mesh_of((2, 4)), method=autopar.ShardParallel(
        remat=r)).get_plan(state, batches[0]) for r in ("auto", "none")]
    assert plans[0].remat == {} == plans[1].remat
    assert plans[0].peak_memory_bytes == plans[1].peak_memory_bytes
    assert plans[0].predicted_step_s == plans[1].predicted_step_s


def test_full_remat_everywhere_on_request(case):
    step, state, batches, ref = case
    par = autopar.parallelize(step, mesh=mesh_of((2, 4)),
                              method=autopar.ShardParallel(remat="full"))
    plan = par.get_plan(state, batches[0])
    assert set(plan.remat["layers"]) == {"full"}
    none = autopar.parallelize(step, mesh=mesh_of((2, 4)), method=autopar.ShardParallel(
        remat="none")).get_plan(state, batches[0])
    assert plan.peak_memory_bytes < none.peak_memory_bytes
    assert plan.predicted_compute_s > none.predicted_compute_s     # the recomputed forward
    assert_equivalent(ref, run_steps(par, state, batches), compare_params=True, rtol=2e-5,
                      smooth=True)


def test_a_stock_jax_value_and_grad_step_recomputes_and_trains_like_jax_jit():
    """No autopar marker: jax.value_and_grad's backward pass is found in the trace, and
    remat='full' recomputes each layer there (behind a barrier tied to its cotangent)."""
    step, state, batches = make_case("mlp", "linen", sgd_momentum_clip(), num_layers=4)
    par = autopar.parallelize(step, mesh=mesh_of((2, 4)),
                              method=autopar.ShardParallel(remat="full"))
    plan = par.get_plan(state, batches[0])
    assert set(plan.remat["layers"]) == {"full"}
    assert "optimization_barrier" in par.lower(state, batches[0]).as_text()
    assert_equivalent(run_steps(jax.jit(step), state, batches), run_steps(par, state, batches),
                      compare_params=True, rtol=2e-5, smooth=True)


def test_a_step_without_a_gradient_says_there_is_nothing_to_recompute():
    def evaluate(params, x):
        return jnp.tanh(x @ params["w"]).sum()
    params, x = {"w": jnp.ones((8, 8))}, jnp.ones((16, 8))
    with pytest.raises(autopar.UnsupportedError, match="takes no gradient"):
        autopar.parallelize(evaluate, mesh=mesh_of((2, 4)), method=autopar.ShardParallel(
            remat="full")).get_plan(params, x)
    with pytest.raises(autopar.InfeasiblePlanError):
        autopar.parallelize(evaluate, mesh=mesh_of((2, 4)), method=autopar.ShardParallel(
            memory_budget_bytes=100)).get_plan(params, x)


@pytest.mark.parametrize("blocks,layers", [(2, 4), (5, 5)])
def test_step_layers_follow_repeated_blocks(blocks, layers):
    """One layer per block when a block repeats 4+ times, else DEFAULT_LAYERS (4) layers."""
    config = GPTConfig(vocab_size=64, seq_len=8, num_layers=blocks, hidden=16, num_heads=2)
    step, state, batches = make_case("gpt", "linen", sgd_momentum_clip(), batch_size=4,
                                     gpt_config=config)
    graph = trace(step, (state, batches[0]), batch_argnums=(1,))
    bounds = step_layers(graph)
    assert len(bounds) - 1 == layers and list(bounds) == sorted(set(bounds))
    assert bounds[-1] == len(forward_nodes(graph))


def test_step_layers_of_a_step_without_a_gradient():
    graph = trace(lambda w, x: jnp.tanh(x @ w), (jnp.ones((4, 4)), jnp.ones((2, 4))))
    assert step_layers(graph) is None


# --- users' styles: NNX modules in place, a scanned layer stack ---------------------------

@pytest.mark.parametrize("stock", [True, False], ids=["nnx.value_and_grad", "autopar"])
def test_nnx_in_place_step_recomputes_and_matches_nnx_jit(stock):
    """An NNX model updated in place (`nnx.Optimizer`), the gradient by
    `nnx.value_and_grad(loss)(model, batch)` (or autopar's): remat='full' recomputes its layers
    and the step still equals nnx.jit's."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    class Stack(nnx.Module):
        def __init__(self, rngs):
            self.layers = nnx.List([nnx.Linear(16, 16, rngs=rngs) for _ in range(4)])
            self.head = nnx.Linear(16, 4, rngs=rngs)

        def __call__(self, x):
            for layer in self.layers:
                x = nnx.gelu(layer(x))
            return self.head(x)

    def loss(model, batch):
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

    def make_step(vg):
        def step(model, optimizer, batch):
            value, grads = vg(loss)(model, batch)
            optimizer.update(model, grads)
            return value
        return step

    def objects():
        model = Stack(nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.sgd(0.05, momentum=0.9), wrt=nnx.Param)

    vg = nnx.value_and_grad if stock else autopar.value_and_grad
    key = jax.random.key(5)
    batches = [{"x": jax.random.normal(jax.random.fold_in(key, i), (16, 16)),
                "y": jax.random.normal(jax.random.fold_in(key, 9 + i), (16, 4))}
               for i in range(3)]
    ref, got = objects(), objects()
    par = autopar.parallelize(make_step(vg), mesh=mesh_of((2, 4)),
                              batch_argnums=(2,), method=autopar.ShardParallel(remat="full"))
    plan = par.get_plan(*got, batches[0])
    assert set(plan.remat["layers"]) == {"full"}
    assert "optimization_barrier" in par.lower(*got, batches[0]).as_text()
    ref_step = nnx.jit(make_step(nnx.value_and_grad))
    for batch in batches:
        np.testing.assert_allclose(par(*got, batch), ref_step(*ref, batch), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(nnx.state(ref[0], nnx.Param)),
                    jax.tree.leaves(nnx.state(got[0], nnx.Param))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_scanned_stack_recomputes_and_matches_jax_jit():
    """A `lax.scan` over stacked layers (jax.value_and_grad): the scan stays as traced (its
    residuals kept; wrap its body in jax.checkpoint to recompute it), the layers around it
    are recomputed under remat='full', and the step trains like jax.jit."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    def forward(p, x):
        def body(h, w):
            return jnp.tanh(h @ w), None
        h = jax.lax.scan(body, x @ p["w_in"], p["ws"])[0]
        return h @ p["w_out"]

    def make_step(vg):
        def step(p, batch):
            value, g = vg(lambda q: jnp.mean((forward(q, batch["x"]) - batch["y"]) ** 2))(p)
            return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), value
        return step

    key = jax.random.key(7)
    k = jax.random.split(key, 5)
    p = {"w_in": jax.random.normal(k[0], (8, 32)) * 0.3,
         "ws": jax.random.normal(k[1], (4, 32, 32)) * 0.2,
         "w_out": jax.random.normal(k[2], (32, 4)) * 0.3}
    batch = {"x": jax.random.normal(k[3], (32, 8)), "y": jax.random.normal(k[4], (32, 4))}
    par = autopar.parallelize(make_step(jax.value_and_grad), mesh=mesh_of((2, 4)),
                              method=autopar.ShardParallel(remat="full"))
    plan = par.get_plan(p, batch)
    assert plan.remat and set(plan.remat["layers"]) == {"full"}
    got, ref = p, p
    for _ in range(3):
        got, got_loss = par(got, batch)
        ref, ref_loss = jax.jit(make_step(jax.value_and_grad))(ref, batch)
        np.testing.assert_allclose(got_loss, ref_loss, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(got)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_step_layers_follow_the_users_stage_markers():
    """`autopar.mark_stage_boundary` between blocks cuts the forward there (3 markers, 4
    layers), whatever the gradient (jax.value_and_grad here)."""
    def step(ws, x):
        def loss(ws):
            h = x
            for i, w in enumerate(ws):
                h = jnp.tanh(h @ w)
                if i < len(ws) - 1:
                    h = autopar.mark_stage_boundary(h)
            return jnp.mean(h ** 2)
        return jax.value_and_grad(loss)(ws)
    ws = [jnp.full((8, 8), 0.1) for _ in range(4)]
    graph = trace(step, (ws, jnp.ones((4, 8))))
    bounds = step_layers(graph)
    assert len(bounds) == 5 and bounds[-1] == len(forward_nodes(graph))
    fwd = forward_nodes(graph)
    starts = [graph.nodes[fwd[b]] for b in bounds[1:-1]]
    assert all(n.primitive == "dot_general" for n in starts)        # each layer opens on h @ w
