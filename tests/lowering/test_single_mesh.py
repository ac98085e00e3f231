"""The one-mesh lowering (`lowering.single_mesh`): a plan and its traced graph become one
`jax.jit` whose arguments and results carry the plan's shardings, whose constrained
intermediates hold them, and whose results equal jax.jit's on one device; a plan for another
mesh or other devices is refused with the fix. (The pipeline lowering is checked with its
executor in tests/runtime/test_executor.py; every method end to end in tests/api.)"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autopar
from autopar.core.errors import PlanMismatchError
from autopar.frontend.tracer import trace
from autopar.lowering.single_mesh import has_sharding, lower, named, plan_input_shardings
from support.steps import mesh_of


def step(params, x):
    def loss_fn(p):
        return jnp.mean(jnp.tanh(x @ p["w1"]) @ p["w2"] ** 2)
    loss, g = jax.value_and_grad(loss_fn)(params)
    return jax.tree.map(lambda a, b: a - 0.1 * b, params, g), loss


PARAMS = {"w1": jax.random.normal(jax.random.key(0), (16, 64)) * 0.2,
          "w2": jax.random.normal(jax.random.key(1), (64, 16)) * 0.2}
X = jax.random.normal(jax.random.key(2), (32, 16))


@pytest.fixture(scope="module")
def planned():
    mesh = mesh_of((2, 4))
    plan = autopar.parallelize(step, mesh=mesh).get_plan(PARAMS, X)
    graph = trace(step, (PARAMS, X), batch_argnums=(1,))
    return mesh, plan, graph


def test_the_jitted_step_carries_the_plans_shardings_and_equals_jit(planned):
    mesh, plan, graph = planned
    lowered = lower(graph, plan, mesh)
    assert [s.spec for s in lowered.in_shardings] == [
        s.spec for s in plan_input_shardings(plan)]
    flat = jax.tree.leaves((PARAMS, X))
    args = [jax.device_put(a, s) for a, s in zip(flat, lowered.in_shardings)]
    got = lowered.jitted(*args)
    for leaf, sharding in zip(got, lowered.out_shardings):
        assert has_sharding(leaf, sharding)
    want = jax.tree.leaves(jax.jit(step)(PARAMS, X))
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
    text = lowered.jitted.lower(*args).as_text()
    assert text.count("sharding_constraint") >= len(plan.constraints) > 0


def test_named_spells_a_plan_spec_over_the_mesh_axes(planned):
    mesh, plan, _ = planned
    batch = next(t for t in plan.inputs if t.role == "batch")
    sharding = named(mesh, batch.spec)
    assert sharding.mesh.axis_names == ("data", "model") and len(sharding.spec) <= 2
    assert has_sharding(jax.device_put(X, sharding), sharding)


def test_a_plan_for_another_mesh_or_devices_is_refused(planned):
    _, plan, graph = planned
    with pytest.raises(PlanMismatchError, match=r"mesh shape \(2, 4\).*Fix: re-plan"):
        lower(graph, plan, mesh_of((1, 8)))
    with pytest.raises(PlanMismatchError, match="not among this runtime's devices.*Fix"):
        plan_input_shardings(plan, devices=jax.devices()[:4])
