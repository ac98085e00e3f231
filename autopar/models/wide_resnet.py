"""Wide-ResNet (Zagoruyko & Komodakis 2016) in ``flax.linen``; the CNN of Alpa's evaluation.

WRN-``depth``-``width``: a 3x3 stem convolution to ``base_channels``, then
``num_stages`` stages of ``n = (depth - 4) / (2 * num_stages)`` pre-activation
basic blocks (with the paper's 3 stages: ``depth = 6n + 4``; ``depth=10`` is
one block per stage, ``depth=28`` four). Stage ``k`` has ``base_channels *
width * 2**k`` channels and halves the resolution for ``k > 0``. A block is::

    y = conv3x3(relu(norm(conv3x3_stride(relu(norm(x))))))
    out = y + (x  if same shape  else  conv1x1_stride(relu(norm(x))))

then ``relu(norm(.))``, global average pooling and a dense classifier. No
dropout, no RNG at apply time; convolutions have no bias (a norm follows).

Normalization (``WideResNetConfig.norm``) must not mix examples if splitting a
batch into microbatches is to leave the result unchanged, so the default is
``"group"`` (GroupNorm with ``gcd(norm_groups, channels)`` groups). ``"layer"``
normalizes each example over (H, W, C). ``"batch"`` normalizes with the
statistics of the batch it is given (no running averages are kept: a
training-only model) and so depends on how the batch is split.

Parameter names: ``stem``, ``block_{i}/{norm_1,conv_1,norm_2,conv_2,shortcut}``
(blocks numbered across stages; ``shortcut`` only where the shape changes),
``norm_f``, ``head``.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from autopar.frontend.markers import mark_stage_boundary
from autopar.models.gpt import check_positive_ints

Dtype = Any


class Norm(enum.StrEnum):
    GROUP = "group"
    LAYER = "layer"
    BATCH = "batch"


@dataclasses.dataclass(frozen=True)
class WideResNetConfig:
    """Hyper-parameters of :class:`WideResNet` (``norm`` accepts a string)."""

    image_size: int = 32
    num_classes: int = 10
    depth: int = 10
    width: int = 2
    base_channels: int = 16
    num_stages: int = 3
    norm: Norm = Norm.GROUP
    norm_groups: int = 8
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    stage_boundaries: bool = False

    def __post_init__(self):
        check_positive_ints(self, ("image_size", "num_classes", "depth", "width",
                                   "base_channels", "num_stages", "norm_groups"))
        per_stage = 2 * self.num_stages
        if self.depth < 4 + per_stage or (self.depth - 4) % per_stage:
            raise ValueError(
                f"WideResNetConfig.depth must be 4 + 2 * num_stages * n for some n >= 1 "
                f"(blocks per stage), got depth={self.depth} with num_stages="
                f"{self.num_stages}; e.g. depth={4 + per_stage} for one block per stage."
            )
        try:
            object.__setattr__(self, "norm", Norm(self.norm))
        except ValueError:
            raise ValueError(
                f"WideResNetConfig.norm must be one of {[n.value for n in Norm]}, "
                f"got {self.norm!r}."
            ) from None

    @property
    def blocks_per_stage(self) -> int:
        return (self.depth - 4) // (2 * self.num_stages)

    @property
    def num_blocks(self) -> int:
        return self.blocks_per_stage * self.num_stages

    def stage_channels(self, k: int) -> int:
        return self.base_channels * self.width * 2**k

    def blocks(self) -> list[tuple[int, int, int]]:
        """``(in_channels, out_channels, stride)`` of each block, in order."""
        out, cin = [], self.base_channels
        for k in range(self.num_stages):
            cout = self.stage_channels(k)
            for j in range(self.blocks_per_stage):
                out.append((cin, cout, 2 if (k > 0 and j == 0) else 1))
                cin = cout
        return out


# ---------------------------------------------------------------------------
# flax.linen
# ---------------------------------------------------------------------------


class BatchStatNorm(nn.Module):
    """Normalizes over (batch, H, W) with the current batch's statistics (no state)."""

    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    epsilon: float = 1e-5

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = x.shape[-1]
        scale = self.param("scale", nn.initializers.ones, (c,), self.param_dtype)
        bias = self.param("bias", nn.initializers.zeros, (c,), self.param_dtype)
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=(0, 1, 2))
        var = jnp.mean(jnp.square(x32 - mean), axis=(0, 1, 2))
        y = (x32 - mean) * jax.lax.rsqrt(var + self.epsilon)
        return (y * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(self.dtype)


def _norm(config: WideResNetConfig, channels: int, name: str) -> nn.Module:
    kw = dict(dtype=config.dtype, param_dtype=config.param_dtype, name=name)
    if config.norm is Norm.GROUP:
        return nn.GroupNorm(num_groups=math.gcd(config.norm_groups, channels), **kw)
    if config.norm is Norm.LAYER:
        return nn.LayerNorm(reduction_axes=(-3, -2, -1), feature_axes=-1, **kw)
    return BatchStatNorm(**kw)


def _conv(config: WideResNetConfig, channels: int, kernel: int, stride: int, name: str):
    return nn.Conv(channels, (kernel, kernel), strides=(stride, stride), padding="SAME",
                   use_bias=False, dtype=config.dtype, param_dtype=config.param_dtype,
                   name=name)


class WideBasicBlock(nn.Module):
    """Pre-activation basic block (two 3x3 convolutions)."""

    config: WideResNetConfig
    in_channels: int
    out_channels: int
    stride: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        a = jax.nn.relu(_norm(c, self.in_channels, "norm_1")(x))
        y = _conv(c, self.out_channels, 3, self.stride, "conv_1")(a)
        y = jax.nn.relu(_norm(c, self.out_channels, "norm_2")(y))
        y = _conv(c, self.out_channels, 3, 1, "conv_2")(y)
        if self.stride != 1 or self.in_channels != self.out_channels:
            x = _conv(c, self.out_channels, 1, self.stride, "shortcut")(a)
        return x + y


class WideResNet(nn.Module):
    """Linen Wide-ResNet: ``images`` float32[B, H, W, 3] -> logits float32[B, num_classes].

    With ``config.stage_boundaries`` the activation between consecutive blocks
    is marked with :func:`autopar.mark_stage_boundary`.
    """

    config: WideResNetConfig

    @nn.compact
    def __call__(self, images: jax.Array) -> jax.Array:
        c = self.config
        if images.ndim != 4 or images.shape[-1] != 3:
            raise ValueError(
                f"WideResNet expects images of shape [batch, H, W, 3], got {images.shape}."
            )
        x = _conv(c, c.base_channels, 3, 1, "stem")(images.astype(c.dtype))
        blocks = c.blocks()
        for i, (cin, cout, stride) in enumerate(blocks):
            x = WideBasicBlock(c, cin, cout, stride, name=f"block_{i}")(x)
            if c.stage_boundaries and i < len(blocks) - 1:
                x = mark_stage_boundary(x)
        x = jax.nn.relu(_norm(c, blocks[-1][1], "norm_f")(x))
        x = jnp.mean(x, axis=(1, 2))
        logits = nn.Dense(c.num_classes, dtype=c.dtype, param_dtype=c.param_dtype,
                          name="head")(x)
        return logits.astype(jnp.float32)


# ---------------------------------------------------------------------------
# Loss, data, accounting
# ---------------------------------------------------------------------------


def classification_loss(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy over the batch, in float32."""
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), labels).mean()


def make_image_batch(key: jax.Array, batch_size: int,
                     config: WideResNetConfig) -> dict[str, jax.Array]:
    """``images`` float32[B, image_size, image_size, 3] ~ N(0, 1) and ``labels``
    int32[B] uniform in [0, num_classes)."""
    ki, kl = jax.random.split(key)
    s = config.image_size
    return {
        "images": jax.random.normal(ki, (batch_size, s, s, 3), jnp.float32),
        "labels": jax.random.randint(kl, (batch_size,), 0, config.num_classes, jnp.int32),
    }


def wide_resnet_param_count(config: WideResNetConfig) -> int:
    """Exact number of parameters of :class:`WideResNet`.

    Stem ``27 * C0``; per block ``2*Cin + 9*Cin*Cout + 2*Cout + 9*Cout^2``
    (+ ``Cin*Cout`` for a shortcut convolution); ``2*C`` for the final norm
    and ``C*classes + classes`` for the head. Every norm has a scale and a
    bias per channel.
    """
    n = 27 * config.base_channels
    for cin, cout, stride in config.blocks():
        n += 2 * cin + 9 * cin * cout + 2 * cout + 9 * cout * cout
        if stride != 1 or cin != cout:
            n += cin * cout
    c = config.blocks()[-1][1]
    return n + 2 * c + c * config.num_classes + config.num_classes


def wide_resnet_flops_per_example(config: WideResNetConfig) -> float:
    """Estimated FLOPs per image of one training step (forward + backward).

    ``3 * 2 * MACs`` of the convolutions and the head (backward costs twice
    the forward); norms, ReLUs, pooling and additions are ignored. A
    convolution with stride ``s`` on ``R x R`` outputs ``ceil(R / s)``
    squared positions (SAME padding).
    """
    r = config.image_size
    macs = r * r * 27 * config.base_channels
    for cin, cout, stride in config.blocks():
        r_out = -(-r // stride)
        macs += r_out * r_out * (9 * cin * cout + 9 * cout * cout)
        if stride != 1 or cin != cout:
            macs += r_out * r_out * cin * cout
        r = r_out
    macs += config.blocks()[-1][1] * config.num_classes
    return float(6 * macs)
