"""A plain multi-layer perceptron in ``flax.linen`` and Flax NNX.

Both versions compute the same function: ``num_layers`` dense layers with a
ReLU between consecutive layers and none after the last. Parameters live in
``param_dtype`` (float32); the matmuls run in ``dtype``.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

Dtype = Any


def _check_num_layers(num_layers: int) -> None:
    if num_layers < 1:
        raise ValueError(
            f"MLP needs num_layers >= 1, got num_layers={num_layers}."
        )


class MLP(nn.Module):
    """Linen MLP: ``Dense_0 .. Dense_{num_layers-1}`` with ReLU in between.

    Every layer but the last maps to ``hidden`` features; the last maps to
    ``out_dim`` (``hidden`` when None).
    """

    num_layers: int
    hidden: int
    out_dim: int | None = None
    use_bias: bool = True
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        _check_num_layers(self.num_layers)
        out_dim = self.hidden if self.out_dim is None else self.out_dim
        for i in range(self.num_layers):
            last = i == self.num_layers - 1
            x = nn.Dense(
                out_dim if last else self.hidden,
                use_bias=self.use_bias,
                dtype=self.dtype,
                param_dtype=self.param_dtype,
            )(x)
            if not last:
                x = jax.nn.relu(x)
        return x


class NnxMLP(nnx.Module):
    """NNX MLP with the same math as :class:`MLP`; layers in ``self.layers``."""

    def __init__(
        self,
        num_layers: int,
        in_dim: int,
        hidden: int,
        *,
        out_dim: int | None = None,
        use_bias: bool = True,
        dtype: Dtype = jnp.float32,
        param_dtype: Dtype = jnp.float32,
        rngs: nnx.Rngs,
    ):
        _check_num_layers(num_layers)
        out_dim = hidden if out_dim is None else out_dim
        dims = [in_dim] + [hidden] * (num_layers - 1) + [out_dim]
        self.layers = nnx.List(
            [
                nnx.Linear(
                    dims[i],
                    dims[i + 1],
                    use_bias=use_bias,
                    dtype=dtype,
                    param_dtype=param_dtype,
                    rngs=rngs,
                )
                for i in range(num_layers)
            ]
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        n = len(self.layers)
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < n - 1:
                x = jax.nn.relu(x)
        return x


def megatron_rules(num_layers: int, model_axis: str = "model", data_axis: str | None = "data",
                   batch_pattern: str = r"^batch") -> tuple[tuple[str, tuple], ...]:
    """Megatron-style tensor parallelism for :class:`MLP` as `autopar` ``sharding_rules``:
    ``Dense_0`` column-parallel, ``Dense_1`` row-parallel, and so on in pairs (one all-reduce
    per pair); batch leaves split over ``data_axis``; everything else replicated.

    Example:
        >>> autopar.ShardParallel(sharding_rules=megatron_rules(num_layers=4))
    """
    rules = []
    for i in range(num_layers):
        if i % 2 == 0:
            rules += [(rf"\['Dense_{i}'\]\['kernel'\]", (None, model_axis)),
                      (rf"\['Dense_{i}'\]\['bias'\]", (model_axis,))]
        else:
            rules.append((rf"\['Dense_{i}'\]\['kernel'\]", (model_axis, None)))
    if data_axis is not None:
        rules.append((batch_pattern, (data_axis,)))
    return tuple(rules) + ((r".", ()),)


def mse_loss(pred: jax.Array, target: jax.Array) -> jax.Array:
    """Mean squared error over all elements, computed in float32."""
    diff = pred.astype(jnp.float32) - target.astype(jnp.float32)
    return jnp.mean(diff * diff)


def make_mlp_batch(
    key: jax.Array, batch_size: int, in_dim: int, out_dim: int
) -> dict[str, jax.Array]:
    """A random regression batch: ``x`` float32[B, in_dim], ``y`` float32[B, out_dim]."""
    kx, ky = jax.random.split(key)
    return {
        "x": jax.random.normal(kx, (batch_size, in_dim), jnp.float32),
        "y": jax.random.normal(ky, (batch_size, out_dim), jnp.float32),
    }
