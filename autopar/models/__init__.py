"""Reference Flax models (linen and NNX) used by autopar's tests, examples and benchmarks."""

from autopar.models.gpt import (
                                GPT,
                                GPTConfig,
                                NnxGPT,
                                gpt_flops_per_token,
                                gpt_loss,
                                gpt_param_count,
                                make_gpt_batch,
)
from autopar.models.lm1b import (
                                Lm1bConfig,
                                Lm1bTransformer,
                                make_lm1b_batch,
                                sinusoid_table,
                                weighted_cross_entropy,
)
from autopar.models.mlp import MLP, NnxMLP, make_mlp_batch, mse_loss
from autopar.models.moe import (
                                MoE,
                                MoEConfig,
                                expert_capacity,
                                make_moe_batch,
                                moe_flops_per_token,
                                moe_loss,
                                moe_param_count,
                                top2_gating,
)
from autopar.models.wide_resnet import (
                                Norm,
                                WideResNet,
                                WideResNetConfig,
                                classification_loss,
                                make_image_batch,
                                wide_resnet_flops_per_example,
                                wide_resnet_param_count,
)

__all__ = [
    "GPT",
    "GPTConfig",
    "Lm1bConfig",
    "Lm1bTransformer",
    "MLP",
    "MoE",
    "MoEConfig",
    "NnxGPT",
    "NnxMLP",
    "Norm",
    "WideResNet",
    "WideResNetConfig",
    "classification_loss",
    "expert_capacity",
    "gpt_flops_per_token",
    "gpt_loss",
    "gpt_param_count",
    "make_gpt_batch",
    "make_image_batch",
    "make_lm1b_batch",
    "make_mlp_batch",
    "make_moe_batch",
    "moe_flops_per_token",
    "moe_loss",
    "moe_param_count",
    "mse_loss",
    "sinusoid_table",
    "top2_gating",
    "wide_resnet_flops_per_example",
    "weighted_cross_entropy",
    "wide_resnet_param_count",
]
