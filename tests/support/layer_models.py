"""Common-layer models for the tests: a 3-block CNN with BatchNorm and pooling, a depthwise CNN
and an MLP with dropout, each with a train step builder `step(state, batch) -> (state, loss,
grads)` that `steps.run_steps` / `steps.assert_equivalent` accept.

Example:
    >>> step, state, batches = cnn_case(batch_size=32, image_size=32)
    >>> par = autopar.parallelize(step, mesh=mesh_of((2, 4)), batch_argnums=(1,))
    >>> ref, got = run_steps(jax.jit(step), state, batches), run_steps(par, state, batches)
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import struct
from flax.training import train_state


class CNN(nn.Module):
    """3 x (Conv 3x3 without bias -> BatchNorm -> relu -> max_pool 2x2), then avg_pool 2x2, a
    spatial mean and a Dense head."""
    channels: tuple[int, ...] = (16, 32, 64)
    num_classes: int = 10

    @nn.compact
    def __call__(self, x, train: bool = True):
        for c in self.channels:
            x = nn.Conv(c, (3, 3), use_bias=False)(x)   # BatchNorm follows: a bias is moot
            x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
            x = nn.relu(x)
            x = nn.max_pool(x, (2, 2), strides=(2, 2))
        x = nn.avg_pool(x, (2, 2), strides=(2, 2))
        x = x.mean(axis=(1, 2))
        return nn.Dense(self.num_classes)(x)


class DepthwiseCNN(nn.Module):
    """A 1x1 conv to `channels`, two depthwise 3x3 convs (feature_group_count = channels) with
    tanh, and a Dense head."""
    channels: int = 32
    num_classes: int = 10

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(self.channels, (1, 1), name="expand")(x)
        for i in range(2):
            x = jnp.tanh(nn.Conv(self.channels, (3, 3), feature_group_count=self.channels,
                                 name=f"depthwise_{i}")(x))
        return nn.Dense(self.num_classes, name="head")(x.mean(axis=(1, 2)))


class DropoutMLP(nn.Module):
    """Dense -> relu -> Dropout, twice, then a Dense head."""
    hidden: int = 256
    rate: float = 0.5
    num_layers: int = 2

    @nn.compact
    def __call__(self, x, deterministic: bool):
        for _ in range(self.num_layers):
            x = nn.relu(nn.Dense(self.hidden)(x))
            x = nn.Dropout(self.rate, deterministic=deterministic)(x)
        return nn.Dense(10)(x)


class BatchNormState(train_state.TrainState):
    batch_stats: Any = struct.field(default=None)


def image_batches(key, n: int, batch_size: int, image_size: int, channels: int = 3,
                  num_classes: int = 10) -> list[dict]:
    out = []
    for i in range(n):
        k1, k2 = jax.random.split(jax.random.fold_in(key, i))
        out.append({"x": jax.random.normal(k1, (batch_size, image_size, image_size, channels)),
                    "y": jax.random.randint(k2, (batch_size,), 0, num_classes)})
    return out


def _xent(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def cnn_case(*, batch_size: int = 32, image_size: int = 32, channels=(16, 32, 64), seed: int = 0,
             tx=None):
    """(step, state, batches) for `CNN`: BatchNorm statistics in training mode, the new running
    statistics returned in the new state."""
    model = CNN(channels=tuple(channels))
    batches = image_batches(jax.random.key(seed + 1), 3, batch_size, image_size)
    variables = model.init(jax.random.key(seed), batches[0]["x"])
    state = BatchNormState.create(apply_fn=model.apply, params=variables["params"],
                                  batch_stats=variables["batch_stats"],
                                  tx=tx or optax.sgd(0.05, momentum=0.9))

    def step(state, batch):
        def loss_fn(params):
            logits, updates = state.apply_fn(
                {"params": params, "batch_stats": state.batch_stats}, batch["x"],
                mutable=["batch_stats"])
            return _xent(logits, batch["y"]), updates["batch_stats"]
        (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads).replace(batch_stats=stats), loss, grads
    return step, state, batches


def depthwise_case(*, batch_size: int = 8, image_size: int = 8, channels: int = 32,
                   seed: int = 0, tx=None):
    """(step, state, batches) for `DepthwiseCNN`."""
    model = DepthwiseCNN(channels=channels)
    batches = image_batches(jax.random.key(seed + 1), 3, batch_size, image_size)
    params = model.init(jax.random.key(seed), batches[0]["x"])["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                          tx=tx or optax.sgd(0.05))

    def step(state, batch):
        def loss_fn(params):
            return _xent(state.apply_fn({"params": params}, batch["x"]), batch["y"])
        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss, grads
    return step, state, batches


def dropout_case(*, batch_size: int = 64, features: int = 64, hidden: int = 256,
                 deterministic: bool = False, seed: int = 0, tx=None):
    """(step, state, batches) for `DropoutMLP`: the dropout key is derived from the step
    counter (`fold_in(key(seed), state.step)`), so the step is a pure function of its
    arguments and every step draws new masks."""
    model = DropoutMLP(hidden=hidden)
    key = jax.random.key(seed)
    batches = []
    for i in range(3):
        k1, k2 = jax.random.split(jax.random.fold_in(key, 100 + i))
        batches.append({"x": jax.random.normal(k1, (batch_size, features)),
                        "y": jax.random.randint(k2, (batch_size,), 0, 10)})
    params = model.init(key, batches[0]["x"], deterministic=True)["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                          tx=tx or optax.sgd(0.05))

    def step(state, batch):
        rng = jax.random.fold_in(jax.random.key(seed + 1), state.step)

        def loss_fn(params):
            logits = state.apply_fn({"params": params}, batch["x"], deterministic=deterministic,
                                    rngs={"dropout": rng})
            return _xent(logits, batch["y"])
        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss, grads
    return step, state, batches


def moe_layer_case():
    """(step, state, batch): one top-2 MoE layer (`autopar.models.moe.MoeMlp`: hidden 64, 4
    experts, 16 tokens per sequence) regressing a random target, batch 8, SGD; the step
    returns (state, loss)."""
    from autopar.models.moe import MoEConfig, MoeMlp
    cfg = MoEConfig(vocab_size=64, seq_len=16, num_layers=1, hidden=64, num_heads=4,
                    num_experts=4, expert_every=1)

    class Layer(nn.Module):
        @nn.compact
        def __call__(self, x):
            return MoeMlp(cfg)(x)

    batch = {"x": jax.random.normal(jax.random.key(0), (8, 16, 64)),
             "y": jax.random.normal(jax.random.key(1), (8, 16, 64))}
    state = train_state.TrainState.create(
        apply_fn=Layer().apply, params=Layer().init(jax.random.key(2), batch["x"]),
        tx=optax.sgd(0.1))

    def step(state, batch):
        def loss_fn(p):
            out, aux = state.apply_fn(p, batch["x"])
            return jnp.mean((out - batch["y"]) ** 2) + 0.01 * aux.mean()
        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss
    return step, state, batch


def moe_lm_case():
    """(step, state, batch): the MoE LM (`autopar.models.moe.MoE`: 2 layers, block 1 routed,
    hidden 64, 4 experts, vocab 64, seq 16), batch 8, SGD (Adam's first step is sign(g): an
    entry near zero flips between layouts); the step returns (state, loss)."""
    from autopar.models.moe import MoE, MoEConfig, make_moe_batch, moe_loss
    cfg = MoEConfig(vocab_size=64, seq_len=16, num_layers=2, hidden=64, num_heads=4,
                    num_experts=4)
    batch, model = make_moe_batch(jax.random.key(0), 8, cfg), MoE(cfg)
    state = train_state.TrainState.create(
        apply_fn=model.apply, params=model.init(jax.random.key(2), batch["tokens"]),
        tx=optax.sgd(0.1))

    def step(state, batch):
        def loss_fn(p):
            logits, aux = state.apply_fn(p, batch["tokens"], return_aux=True)
            return moe_loss(logits, batch["tokens"], aux)
        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss
    return step, state, batch
