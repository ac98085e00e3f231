"""Tests for models/wide_resnet.py (Wide-ResNet with per-example normalization)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from autopar.frontend.markers import STAGE_BOUNDARY
from autopar.models import (
    Norm,
    WideResNet,
    WideResNetConfig,
    classification_loss,
    make_image_batch,
    wide_resnet_flops_per_example,
    wide_resnet_param_count,
)
from support.steps import init_params, num_params

# WRN-10-1 on 8x8 images: one block per stage, channels 4 -> 4, 8, 16.
TINY = WideResNetConfig(image_size=8, num_classes=10, depth=10, width=1, base_channels=4,
                        norm_groups=2)


@pytest.fixture(scope="module")
def tiny():
    """(params, batch of 8) for TINY; an RBG key keeps the jitted init fast on CPU."""
    batch = make_image_batch(jax.random.key(0), 8, TINY)
    return init_params(WideResNet(TINY), batch["images"]), batch


@functools.cache
def _loss_and_grad(config):
    model = WideResNet(config)

    def loss_fn(params, images, labels):
        return classification_loss(model.apply({"params": params}, images), labels)

    return jax.jit(jax.value_and_grad(loss_fn))


def _param_shapes(config):
    images = jnp.zeros((1, config.image_size, config.image_size, 3), jnp.float32)
    return jax.eval_shape(WideResNet(config).init, jax.random.key(0), images)["params"]


# -- shapes, parameter counts, config ----------------------------------------------


def test_shapes_and_param_count(tiny):
    params, batch = tiny
    assert batch["images"].shape == (8, 8, 8, 3) and batch["images"].dtype == jnp.float32
    assert batch["labels"].shape == (8,) and batch["labels"].dtype == jnp.int32
    assert num_params(params) == wide_resnet_param_count(TINY)
    assert sorted(params) == ["block_0", "block_1", "block_2", "head", "norm_f", "stem"]
    assert "shortcut" not in params["block_0"]                        # 4 -> 4, stride 1
    assert params["block_1"]["shortcut"]["kernel"].shape == (1, 1, 4, 8)
    assert params["block_2"]["conv_2"]["kernel"].shape == (3, 3, 16, 16)
    logits = jax.jit(WideResNet(TINY).apply)({"params": params}, batch["images"])
    assert logits.shape == (8, TINY.num_classes) and logits.dtype == jnp.float32


@pytest.mark.parametrize("config", [
    WideResNetConfig(),                                                # WRN-10-2, 32x32
    WideResNetConfig(depth=16, width=3, base_channels=8, norm="layer", num_classes=7),
    WideResNetConfig(depth=8, num_stages=2, image_size=16, norm="batch"),
])
def test_param_count_other_configs(config):
    assert num_params(_param_shapes(config)) == wide_resnet_param_count(config)
    assert wide_resnet_flops_per_example(config) > 0


def test_config():
    assert WideResNetConfig(depth=28).blocks_per_stage == 4            # 6n + 4
    assert WideResNetConfig(norm="layer").norm is Norm.LAYER
    assert [b[2] for b in WideResNetConfig(depth=16).blocks()] == [1, 1, 2, 1, 2, 1]
    with pytest.raises(ValueError, match="depth"):
        WideResNetConfig(depth=12)
    with pytest.raises(ValueError, match="norm"):
        WideResNetConfig(norm="instance")
    with pytest.raises(ValueError, match="width"):
        WideResNetConfig(width=0)
    with pytest.raises(ValueError, match="H, W, 3"):
        WideResNet(TINY).init(jax.random.key(0), jnp.zeros((1, 8, 8, 1)))
    # Stem + 3x3 convs + 1x1 shortcuts + head, by hand for TINY (8x8, 4x4, 2x2).
    macs = (64 * 27 * 4 + 64 * (9 * 16 + 9 * 16) + 16 * (9 * 32 + 9 * 64 + 32)
            + 4 * (9 * 128 + 9 * 256 + 128) + 16 * 10)
    assert wide_resnet_flops_per_example(TINY) == 6 * macs


# -- semantics --------------------------------------------------------------------


def _halves_agree(config, params, batch):
    loss_grad = _loss_and_grad(config)
    x, y = batch["images"], batch["labels"]
    whole, g = loss_grad(params, x, y)
    (a, ga), (b, gb) = loss_grad(params, x[:4], y[:4]), loss_grad(params, x[4:], y[4:])
    close = functools.partial(np.allclose, atol=1e-6, rtol=1e-5)
    return close(whole, (a + b) / 2) and all(
        jax.tree.leaves(jax.tree.map(lambda u, v, w: close(u, (v + w) / 2), g, ga, gb)))


def test_examples_are_not_mixed(tiny):
    """GroupNorm: the batch loss and gradient are the means over its halves."""
    params, batch = tiny
    assert _halves_agree(TINY, params, batch)


def _logits_split_agree(config, params, images):
    apply = jax.jit(WideResNet(config).apply)
    whole = apply({"params": params}, images)
    halves = jnp.concatenate([apply({"params": params}, images[:4]),
                              apply({"params": params}, images[4:])])
    return np.allclose(whole, halves, atol=1e-6, rtol=1e-5)


def test_layer_norm_does_not_mix_and_batch_norm_does(tiny):
    params, batch = tiny
    assert _logits_split_agree(dataclasses.replace(TINY, norm="layer"), params, batch["images"])
    # The opt-in "batch" norm depends on how the batch is split.
    assert not _logits_split_agree(
        dataclasses.replace(TINY, norm="batch"), params, batch["images"])


def test_stage_boundaries_change_nothing(tiny):
    params, batch = tiny
    marked = dataclasses.replace(TINY, stage_boundaries=True)
    args = (params, batch["images"], batch["labels"])
    loss, grads = _loss_and_grad(TINY)(*args)
    loss_m, grads_m = _loss_and_grad(marked)(*args)
    np.testing.assert_allclose(loss_m, loss, rtol=1e-6)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7),
                 grads_m, grads)
    jaxpr = jax.make_jaxpr(
        lambda p: WideResNet(marked).apply({"params": p}, batch["images"]))(params)
    names = [e.primitive.name for e in jaxpr.jaxpr.eqns]
    assert names.count(STAGE_BOUNDARY) == TINY.num_blocks - 1


def test_training_reduces_loss(tiny):
    params, batch = tiny
    loss_grad = _loss_and_grad(TINY)
    tx = optax.sgd(0.1)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, images, labels):
        loss, grads = loss_grad(params, images, labels)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for _ in range(5):
        params, opt_state, loss = step(params, opt_state, batch["images"], batch["labels"])
        losses.append(float(loss))
    assert all(np.isfinite(losses)) and losses[-1] < losses[0], losses
