"""NNX models and steps in the Flax docs' style (the MNIST tutorial's CNN, BatchNorm with Dropout,
a regression MLP), and the comparison of NNX state against nnx.jit."""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import autopar
from support.equivalence import ROUTING_LOSS_RTOL, assert_params_close

MESH_SHAPE = (2, 4)


def _value(x):
    return jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x


def _kind(path, var):
    """The group a float leaf is compared in by norm: all parameters, each BatchNorm
    statistic, each optimizer moment (mu, nu, a momentum trace: the path down to its name),
    any other leaf (a metric's total) alone."""
    if isinstance(var, nnx.Param):
        return ("parameters",)
    if isinstance(var, nnx.BatchStat):
        return ("BatchNorm", path[-1])
    if isinstance(var, nnx.OptState):
        names = [i for i, k in enumerate(path) if i > 0 and isinstance(k, str)]
        return path[:names[0] + 1] if names else path
    return path


def assert_same_state(ref, got, *, steps: int = 1, smooth: bool = True):
    """`nnx.state(got)` equals `nnx.state(ref)` (same paths) after `steps` training steps.

    Every leaf entrywise (rtol 1e-5, atol 1e-5) where the model is `smooth` or was trained
    one step. After more steps of a routing model (ReLU, max pooling: see equivalence.py),
    the integer and key leaves (step and RNG counters, metric counts) exactly, the float
    leaves by the relative norm of each group of one kind (`_kind`: the parameters, each
    optimizer moment, ...), to the routing tolerance of `assert_params_close`."""
    a = list(nnx.to_flat_state(nnx.state(ref)))
    b = list(nnx.to_flat_state(nnx.state(got)))
    assert [p for p, _ in a] == [p for p, _ in b]
    tight = smooth or steps <= 1
    groups: dict[tuple, tuple[list, list]] = {}
    for (path, var), (_, other) in zip(a, b):
        x, y = np.asarray(_value(var[...])), np.asarray(_value(other[...]))
        if tight:
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5, err_msg=str(path))
        elif not np.issubdtype(x.dtype, np.floating):
            np.testing.assert_array_equal(y, x, err_msg=str(path))
        else:
            want, have = groups.setdefault(_kind(path, var), ([], []))
            want.append(x)
            have.append(y)
    for kind, (want, have) in groups.items():
        assert_params_close(want, have, steps=steps, smooth=smooth, what=" ".join(map(str, kind)))


def one_device_memory(step_fn, objects, batch):
    """memory_analysis of the step as plain jax.jit on one device (state donated)."""
    graphdef, state = nnx.split(objects)

    def pure(state, batch):
        objs = nnx.merge(graphdef, state)
        return step_fn(*objs, batch), nnx.state(objs)

    state, batch = jax.device_put((state, batch), jax.devices()[0])
    return jax.jit(pure, donate_argnums=(0,)).lower(state, batch).compile().memory_analysis()


class CNN(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 8, kernel_size=(3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(8, 16, kernel_size=(3, 3), rngs=rngs)
        self.avg_pool = partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
        self.linear1 = nnx.Linear(16 * 4 * 4, 32, rngs=rngs)
        self.linear2 = nnx.Linear(32, 10, rngs=rngs)

    def __call__(self, x):
        x = self.avg_pool(nnx.relu(self.conv1(x)))
        x = self.avg_pool(nnx.relu(self.conv2(x)))
        x = x.reshape(x.shape[0], -1)
        return self.linear2(nnx.relu(self.linear1(x)))


def mnist_loss(model, batch):
    logits = model(batch["image"])
    loss = optax.softmax_cross_entropy_with_integer_labels(
        logits=logits, labels=batch["label"]).mean()
    return loss, logits


def mnist_train_step(model: CNN, optimizer: nnx.Optimizer, metrics: nnx.MultiMetric, batch):
    grad_fn = nnx.value_and_grad(mnist_loss, has_aux=True)
    (loss, logits), grads = grad_fn(model, batch)
    metrics.update(loss=loss, logits=logits, labels=batch["label"])
    optimizer.update(model, grads)


def assert_same_metrics(ref, got):
    """The MNIST metrics of 3 steps: the accuracy (a count of argmaxes) to 1e-5, so exactly;
    the mean loss to `ROUTING_LOSS_RTOL`, as it holds step 2's loss of a routing model."""
    want, have = ref.compute(), got.compute()
    assert sorted(want) == sorted(have) == ["accuracy", "loss"]
    np.testing.assert_allclose(have["accuracy"], want["accuracy"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(have["loss"], want["loss"], rtol=max(1e-5, ROUTING_LOSS_RTOL))


def mnist_objects():
    model = CNN(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3, 0.9), wrt=nnx.Param)
    metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(),
                              loss=nnx.metrics.Average("loss"))
    return model, optimizer, metrics


def mnist_batches(n=3, batch_size=16):
    key = jax.random.key(0)
    return [{"image": jax.random.normal(jax.random.fold_in(key, i), (batch_size, 16, 16, 1)),
             "label": jax.random.randint(jax.random.fold_in(key, 100 + i), (batch_size,), 0, 10)}
            for i in range(n)]


class BnDropNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(8, 16, rngs=rngs)
        self.bn = nnx.BatchNorm(16, rngs=rngs)
        self.drop = nnx.Dropout(0.3, rngs=rngs)
        self.l2 = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.drop(nnx.relu(self.bn(self.l1(x)))))


def regression_batches(n=3, batch_size=16):
    key = jax.random.key(3)
    return [{"x": jax.random.normal(jax.random.fold_in(key, i), (batch_size, 8)),
             "y": jax.random.normal(jax.random.fold_in(key, 10 + i), (batch_size, 4))}
            for i in range(n)]


def mse(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def mse_step(model, optimizer, batch):
    """The usual NNX step: value and gradient, the optimizer's update in place."""
    loss, grads = nnx.value_and_grad(mse)(model, batch)
    optimizer.update(model, grads)
    return loss


def microbatch_methods(m: int):
    """Parametrize `method` over gradient accumulation and a 2-stage pipeline, m microbatches."""
    return pytest.mark.parametrize("method", [
        autopar.ShardParallel(num_microbatches=m),
        autopar.PipeshardParallel(num_microbatches=m,
                                  layer_option=autopar.AutoLayerOption(num_layers=2),
                                  stage_option=autopar.UniformStageOption(num_stages=2)),
    ], ids=["accumulation", "pipeline"])
