"""`autopar.value_and_grad` on Equinox modules computes what `eqx.filter_value_and_grad`
computes (`frontend.filter_grad`): gradients of the floating arrays, None elsewhere."""
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import autopar


def _model():
    return eqx.nn.MLP(3, 2, 8, 1, key=jax.random.key(0))


def _loss(m, x):
    return jnp.mean(jax.vmap(m)(x) ** 2)


def test_equals_eqx_filter_value_and_grad():
    m, x = _model(), jnp.linspace(-1, 1, 12).reshape(4, 3)
    (loss, grads), (want_loss, want) = (autopar.value_and_grad(_loss)(m, x),
                                        eqx.filter_value_and_grad(_loss)(m, x))
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    assert grads.activation is None and want.activation is None
    assert jax.tree_util.tree_structure(grads) == jax.tree_util.tree_structure(want)
    for a, b in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    # under jit, with aux and with a second differentiated argument
    def aux_loss(m, scale, x):
        out = jax.vmap(m)(x) * scale["s"]
        return jnp.mean(out ** 2), out
    scale = {"s": jnp.float32(2.0), "name": "scale"}
    (l2, out), (gm, gs) = eqx.filter_jit(lambda m, x: autopar.value_and_grad(
        aux_loss, argnums=(0, 1), has_aux=True)(m, scale, x))(m, x)
    assert out.shape == (4, 2) and gs["name"] is None
    want_gs = jax.grad(lambda s: aux_loss(m, {**scale, "s": s}, x)[0])(scale["s"])
    np.testing.assert_allclose(gs["s"], want_gs, rtol=1e-6)
    np.testing.assert_allclose(jax.tree_util.tree_leaves(gm)[0],
                               jax.tree_util.tree_leaves(eqx.filter_grad(
                                   lambda m: aux_loss(m, scale, x)[0])(m))[0], rtol=1e-6)
