"""mark_stage_boundary: identity values, survives grad / jit / vmap, recorded by the trace."""
import jax
import jax.numpy as jnp
import numpy as np

import autopar
from autopar.frontend.markers import STAGE_BOUNDARY
from autopar.frontend.tracer import trace
from support.steps import mesh_of


def two_layer(w, x, marked=True):
    h = jnp.tanh(x @ w["a"])
    if marked:
        h = autopar.mark_stage_boundary(h, name="cut")
    return jnp.mean((h @ w["b"]) ** 2)


W = {"a": jnp.linspace(-1, 1, 32).reshape(4, 8), "b": jnp.linspace(1, -1, 16).reshape(8, 2)}
X = jnp.linspace(0, 1, 24).reshape(6, 4)


def test_values_pass_through_unchanged():
    a, b = jnp.ones(3), {"k": jnp.zeros((2, 2))}
    out_a, out_b = autopar.mark_stage_boundary(a, b)
    np.testing.assert_array_equal(out_a, a)
    np.testing.assert_array_equal(out_b["k"], b["k"])
    np.testing.assert_array_equal(autopar.mark_stage_boundary(a), a)


def test_gradients_unchanged_under_grad_jit_and_vmap():
    plain = jax.grad(lambda w, x: two_layer(w, x, marked=False))(W, X)
    for fn in (jax.grad(two_layer), jax.jit(jax.grad(two_layer))):
        got = fn(W, X)
        for k in W:
            np.testing.assert_allclose(got[k], plain[k], rtol=1e-6)
    per_example = jax.vmap(jax.grad(two_layer), in_axes=(None, 0))(W, X[:, None])
    assert per_example["a"].shape == (6, 4, 8)


def test_marker_appears_in_forward_and_backward_of_the_jaxpr():
    jaxpr = jax.make_jaxpr(jax.grad(two_layer))(W, X).jaxpr
    assert sum(e.primitive.name == STAGE_BOUNDARY for e in jaxpr.eqns) == 2


def test_trace_drops_markers_and_records_their_positions():
    graph = trace(jax.value_and_grad(two_layer), (W, X))
    assert all(n.primitive != STAGE_BOUNDARY for n in graph.nodes)
    fwd, bwd = graph.stage_markers
    assert (fwd.name, fwd.backward, bwd.backward) == ("cut", False, True)
    before = [n.primitive for n in graph.nodes[:fwd.position]]
    assert "dot_general" in before and "tanh" in before     # layer 0 precedes the cut
    assert fwd.position < bwd.position <= len(graph.nodes)


def test_parallelized_step_with_markers_matches_jit():
    def step(w, batch):
        loss, g = jax.value_and_grad(two_layer)(w, batch)
        return jax.tree_util.tree_map(lambda p, d: p - 0.1 * d, w, g), loss
    par = autopar.parallelize(step, mesh=mesh_of((2, 4)), batch_argnums=(1,))
    batch = jnp.tile(X, (4, 1))
    (w1, l1), (w2, l2) = par(W, batch), jax.jit(step)(W, batch)
    np.testing.assert_allclose(l1, l2, rtol=1e-6)
    for k in W:
        np.testing.assert_allclose(w1[k], w2[k], rtol=1e-6, atol=1e-7)
