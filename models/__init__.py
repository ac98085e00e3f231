"""Reference Flax models (linen and NNX) used by autopar's tests, examples and benchmarks."""

from models.gpt import (
    GPT,
    GPTConfig,
    NnxGPT,
    gpt_flops_per_token,
    gpt_loss,
    gpt_param_count,
    make_gpt_batch,
)
from models.mlp import MLP, NnxMLP, make_mlp_batch, mse_loss

__all__ = [
    "GPT",
    "GPTConfig",
    "MLP",
    "NnxGPT",
    "NnxMLP",
    "gpt_flops_per_token",
    "gpt_loss",
    "gpt_param_count",
    "make_gpt_batch",
    "make_mlp_batch",
    "mse_loss",
]
