"""A four-layer MLP loss marked into layers and its pipeline stage fixtures (`loss`, `bounds`,
`cluster`: import them into a test module to use them), shared by the stage tests."""
import jax
import jax.numpy as jnp
import pytest

import autopar
from autopar.cost.cluster import ClusterSpec
from autopar.frontend.tracer import trace
from autopar.inter_op.pipeline import layer_boundaries, split_step
from support.steps import BATCH, PARAMS, marked_layers


def loss_fn(p, x, y):
    """Four marked layers; layers 1 and 2 are identical (their stage ILPs are shared)."""
    h = marked_layers(p, x)
    err = h - y
    return jnp.mean(err ** 2), jnp.sum(err > 0)


def step(params, batch):
    (loss, count), grads = autopar.value_and_grad(loss_fn, has_aux=True)(
        params, batch["x"], batch["y"])
    return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads), loss, count


@pytest.fixture(scope="module")
def loss():
    graph = trace(step, (PARAMS, BATCH), batch_argnums=(1,), keep_grad=True)
    return split_step(graph, graph, 1)


@pytest.fixture(scope="module")
def bounds(loss):
    return layer_boundaries(loss.forward, autopar.ManualLayerOption())


@pytest.fixture(scope="module")
def cluster():
    return ClusterSpec.from_devices(jax.devices()[:8])


def method(stage_option, **kw):
    return autopar.PipeshardParallel(stage_option=stage_option,
                                     layer_option=autopar.ManualLayerOption(), **kw)


def remat_step(policy):
    """The four marked layers, each under `jax.checkpoint` with `policy`."""
    def loss_fn(p, x, y):
        h = x
        for i in range(4):
            h = jax.checkpoint(lambda w, a: jnp.tanh(jnp.tanh(a @ w) @ w.T), policy=policy)(
                p[f"l{i}"], h)
            if i < 3:
                h = autopar.mark_stage_boundary(h)
        return jnp.mean((h - y) ** 2)

    def remat_step(params, batch):
        loss, grads = autopar.value_and_grad(loss_fn)(params, batch["x"], batch["y"])
        return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads), loss
    return remat_step
