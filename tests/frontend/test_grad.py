"""`autopar.value_and_grad` / `autopar.grad`: equal to JAX's outside autopar (argnums, has_aux,
pytrees, closures over tracers under jit), argument errors, and the marker primitive in traces
(`trace(keep_grad=True)` keeps it as one node; the default expands it)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autopar
from autopar.frontend.grad import VALUE_AND_GRAD
from autopar.frontend.tracer import trace

KEY = jax.random.key(0)
W = jax.random.normal(jax.random.fold_in(KEY, 0), (3, 2))
X = jax.random.normal(jax.random.fold_in(KEY, 1), (4, 3))


def f(w, x):
    return jnp.sum(jnp.tanh(x @ w) ** 2)


def assert_trees_close(a, b, rtol=1e-6):
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        assert np.shape(x) == np.shape(y)
        assert jnp.result_type(x) == jnp.result_type(y)
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=1e-7)


@pytest.mark.parametrize("argnums", [0, 1, -1, (0,), (0, 1), (-1,)])
def test_value_and_grad_matches_jax(argnums):
    got = autopar.value_and_grad(f, argnums=argnums)(W, X)
    want = jax.value_and_grad(f, argnums=argnums)(W, X)
    assert_trees_close(got, want)
    # A single int gives the gradient itself, a tuple gives a tuple of gradients.
    assert isinstance(got[1], tuple) == (not isinstance(argnums, int))


@pytest.mark.parametrize("argnums", [0, (0, 1)])
def test_grad_matches_jax(argnums):
    assert_trees_close(autopar.grad(f, argnums=argnums)(W, X),
                       jax.grad(f, argnums=argnums)(W, X))


def test_pytree_parameters_and_nondifferentiated_pytree_arguments():
    params = {"dense": {"w": W, "b": jnp.arange(2.0)}, "scale": [jnp.float32(0.5)]}
    batch = {"x": X, "y": jnp.ones((4, 2))}

    def loss(p, b):
        out = jnp.tanh(b["x"] @ p["dense"]["w"] + p["dense"]["b"]) * p["scale"][0]
        return jnp.mean((out - b["y"]) ** 2)

    got = autopar.value_and_grad(loss)(params, batch)
    assert_trees_close(got, jax.value_and_grad(loss)(params, batch))
    assert np.abs(np.asarray(got[1]["dense"]["b"])).max() > 0   # a real, non-zero gradient


def test_has_aux_with_pytree_aux():
    def loss(w, x):
        out = x @ w
        return jnp.mean(out ** 2), {"max": jnp.max(out), "positive": jnp.sum(out > 0)}

    (value, aux), grads = autopar.value_and_grad(loss, has_aux=True)(W, X)
    (value_j, aux_j), grads_j = jax.value_and_grad(loss, has_aux=True)(W, X)
    assert_trees_close((value, aux, grads), (value_j, aux_j, grads_j))
    assert aux["positive"].dtype == jnp.int32      # integer aux passes through untouched

    g, a = autopar.grad(loss, has_aux=True)(W, X)
    assert_trees_close((g, a), jax.grad(loss, has_aux=True)(W, X))


def test_closure_over_tracers_inside_jit():
    """The loss closes over the batch (a tracer of the enclosing jit) and over a numpy
    constant: both become trailing operands of the marker."""
    const = np.linspace(0.5, 1.5, 6, dtype=np.float32).reshape(3, 2)

    def step(vg):
        @jax.jit
        def run(w, x):
            return vg(lambda w: f(w * const, x * 2.0))(w)
        return run(W, X)

    assert_trees_close(step(autopar.value_and_grad), step(jax.value_and_grad))
    jaxpr = jax.make_jaxpr(lambda w, x: autopar.grad(lambda w: f(w * const, x))(w))(W, X)
    eqn = next(e for e in jaxpr.jaxpr.eqns if e.primitive.name == VALUE_AND_GRAD)
    # operands: the differentiated w, then the closed-over x and constant
    assert eqn.params["num_diff"] == 1 and len(eqn.invars) == 3
    assert tuple(eqn.invars[0].aval.shape) == (3, 2)
    assert sorted(tuple(v.aval.shape) for v in eqn.invars[1:]) == [(3, 2), (4, 3)]


def test_marker_primitive_carries_the_loss_jaxpr():
    jaxpr = jax.make_jaxpr(autopar.value_and_grad(f, argnums=(0, 1)))(W, X)
    (eqn,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "autopar_value_and_grad"]
    assert eqn.params["num_diff"] == 2 and eqn.params["has_aux"] is False
    loss_jaxpr = eqn.params["jaxpr"]
    assert "dot_general" in {e.primitive.name for e in loss_jaxpr.jaxpr.eqns}
    assert "transpose" not in str(loss_jaxpr)       # the forward only, not the backward
    assert [tuple(a.shape) for a in loss_jaxpr.out_avals] == [()]
    # outputs: the loss, then one gradient per differentiated input
    assert [tuple(v.aval.shape) for v in eqn.outvars] == [(), (3, 2), (4, 3)]


def test_low_precision_gradients_keep_the_parameter_dtype():
    w16 = W.astype(jnp.bfloat16)
    g = autopar.grad(lambda w: jnp.sum(w.astype(jnp.float32) ** 2))(w16)
    assert g.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(g, np.float32), 2 * np.asarray(w16, np.float32),
                               rtol=1e-2)


# -- errors ---------------------------------------------------------------------------------

@pytest.mark.parametrize("argnums", [2, -3, (), (0, 5), (0.5,), "0"])
def test_bad_argnums(argnums):
    with pytest.raises(autopar.InvalidArgumentError, match="argnums"):
        autopar.value_and_grad(f, argnums=argnums)(W, X)


def test_no_arguments_to_differentiate():
    with pytest.raises(autopar.InvalidArgumentError, match="argnums=0"):
        autopar.grad(lambda: jnp.float32(1.0))()


@pytest.mark.parametrize("loss,what", [
    (lambda w: w * 2.0, "float32\\[3,2\\]"),                       # not a scalar
    (lambda w: jnp.sum(w).astype(jnp.int32), "int32"),             # not a float
])
def test_loss_must_be_a_float_scalar(loss, what):
    with pytest.raises(autopar.InvalidArgumentError, match=f"float scalar, got {what}"):
        autopar.value_and_grad(loss)(W)
    with pytest.raises(autopar.InvalidArgumentError, match="float scalar"):
        autopar.grad(loss)(W)


@pytest.mark.parametrize("ret", [
    lambda w: jnp.sum(w),                                    # a bare scalar
    lambda w: (jnp.sum(w), 1.0, 2.0),                        # a triple
])
def test_has_aux_requires_a_pair(ret):
    with pytest.raises(autopar.InvalidArgumentError, match="must return a pair"):
        autopar.value_and_grad(ret, has_aux=True)(W)


def test_errors_are_autopar_errors_inside_jit():
    with pytest.raises(autopar.AutoparError, match="float scalar"):
        jax.jit(autopar.grad(lambda w: w))(W)


def test_argnums_out_of_order_matches_jax():
    got = autopar.value_and_grad(f, argnums=(1, 0))(W, X)
    assert_trees_close(got, jax.value_and_grad(f, argnums=(1, 0))(W, X))


def test_has_aux_accepts_a_list_pair_like_jax():
    loss = lambda w: [jnp.sum(w ** 2), jnp.max(w)]
    assert_trees_close(autopar.value_and_grad(loss, has_aux=True)(W),
                       jax.value_and_grad(loss, has_aux=True)(W))


def test_vmap_of_grad_gives_per_example_gradients():
    xs = X[:, None, :]
    assert_trees_close(jax.vmap(autopar.grad(f), in_axes=(None, 0))(W, xs),
                       jax.vmap(jax.grad(f), in_axes=(None, 0))(W, xs))


def test_second_derivative_through_grad():
    g = lambda w: jnp.sum(autopar.grad(f)(w, X) ** 2)
    assert_trees_close(jax.grad(g)(W), jax.grad(lambda w: jnp.sum(jax.grad(f)(w, X) ** 2))(W))


# -- trace ----------------------------------------------------------------------------------

def _step(w, x):
    loss, g = autopar.value_and_grad(f)(w, x)
    return w - 0.1 * g, loss


def test_trace_keep_grad_keeps_one_marker_node():
    graph = trace(_step, (W, X), batch_argnums=(1,), keep_grad=True)
    prims = [n.primitive for n in graph.nodes]
    assert prims.count(VALUE_AND_GRAD) == 1
    assert "dot_general" not in prims           # the loss stays inside the marker
    node = graph.nodes[prims.index(VALUE_AND_GRAD)]
    assert node.inputs[:2] == graph.inputs      # w then x
    assert [graph.tensors[t].shape for t in node.outputs] == [(), (3, 2)]


def test_trace_default_expands_the_marker_into_forward_and_backward():
    graph = trace(_step, (W, X), batch_argnums=(1,))
    prims = [n.primitive for n in graph.nodes]
    assert VALUE_AND_GRAD not in prims
    # forward x @ w plus the backward's matmul for dw
    assert prims.count("dot_general") >= 2
    assert any("transpose(" in n.name_stack for n in graph.nodes)
    # The expanded graph computes the same as plain JAX.
    from autopar.frontend.interpret import run_nodes
    env = dict(graph.const_values)
    env.update(zip(graph.inputs, (W, X)))
    run_nodes(graph, graph.nodes, env)
    want = jax.jit(lambda w, x: (w - 0.1 * jax.grad(f)(w, x), f(w, x)))(W, X)
    assert_trees_close(tuple(env[t] for t in graph.outputs), want, rtol=1e-5)


def test_parallelize_shard_parallel_accepts_autopar_grad():
    """Outside PipeshardParallel the marker is just a gradient: ShardParallel plans and runs
    the step like one written with jax.value_and_grad."""
    par = autopar.parallelize(_step, mesh=jax.make_mesh((1, 2), ("data", "model"),
                                                        devices=jax.devices()[:2]))
    assert_trees_close(par(W, X), jax.jit(_step)(W, X), rtol=1e-5)
