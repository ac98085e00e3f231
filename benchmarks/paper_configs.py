"""The Alpa paper's weak-scaling configurations and the Megatron-style grid (pure Python: no
jax, so the tests import it cheaply).

Sources, read with the code-search tools from the public repository alpa-projects/alpa:

- GPT: `benchmark/alpa/suite_paper_manual_gpt.py` and `suite_manual_gpt.py` (`gpt_specs`: seq,
  hidden, layers, heads, vocab), `benchmark/alpa/suite_auto_gpt.py` (`max_global_batch_size =
  1024`; `perf_test_suite`: which model on how many GPUs, 350M on 1 ... 39B on 64;
  `grid_search_suite`: auto layers and microbatches searched). Alpa ran GPT in fp16
  (`benchmark_one_case_gpt_bert.py`: `dtype = jnp.float16`, adamw, fp32 master copy).
- GShard MoE: `benchmark/alpa/suite_manual_moe.py` (`moe_specs`: seq, hidden, layers, heads,
  vocab, experts, expert group size 2048), `suite_auto_moe.py` (batch 1024, GPUs per model,
  auto layers and microbatches). Alpa's MoE layer (`alpa/model/moe.py`): every other layer,
  top-2 gating, capacity C = 2 S / E per group of S tokens; `benchmark_3d_one_case_moe.py`:
  `intermediate_size=hidden_size * 8` (also `compute_moe_parameter_count(mlp_factor=8)`).
- Wide-ResNet: `benchmark/alpa/suite_wresnet.py` (`wresnet_specs`: image 224, ResNet depth
  50 or 101, base channels, width factor, fp32; `perf_test_auto_suite`: batch 1536, 1520 on
  64 GPUs; 16 auto layers for depth 50, 33 for 101), `benchmark_one_case_wresnet.py`
  (1024 classes, SGD with Nesterov momentum 0.9). The older `suite_paper_wresnet.py` lists the
  13B model as (depth 50, 320 channels, width 32); the newer `suite_wresnet.py` as (101, 320,
  16); we follow the newer file.

Hardware (the same files and `benchmark/alpa/README.md`): AWS p3.16xlarge, 8 V100 16 GB per
host; autopar's `ClusterSpec.preset("v100-p3.16xlarge")` describes it.
"""
from __future__ import annotations

from dataclasses import dataclass

PRESET = "v100-p3.16xlarge"
DEVICES_PER_HOST = 8

# The planning-time scale part: a GPT of the 350M shape planned for 8 to 1024 V100s, with the
# pipeline benchmark's batch and microbatches.
SCALE_LAYERS = (24, 48)
SCALE_HOSTS = (1, 8, 128)
SCALE_CFG = dict(hidden=1024, num_heads=16, seq_len=1024, vocab_size=51200)
SCALE_BATCH, SCALE_MICROBATCHES, SCALE_AUTO_LAYERS = 32, 8, 8


@dataclass(frozen=True)
class PaperConfig:
    family: str              # "gpt", "moe" or "wrn"
    name: str                # Alpa's label (parameter count)
    gpus: int
    batch: int               # global batch (sequences or images)
    dims: dict               # model hyper-parameters in Alpa's terms
    auto_layers: tuple       # AutoLayerOption(num_layers=) values Alpa used (see below)
    alpa_microbatches: tuple  # what Alpa's grid search tried (with rematerialization)

    @property
    def key(self) -> str:
        return f"{self.family}-{self.name}"


def _ks(auto_layers) -> tuple:
    return tuple(auto_layers) if isinstance(auto_layers, tuple) else (auto_layers,)


def _gpt(name, gpus, hidden, layers, heads, auto_layers, mbs):
    return PaperConfig("gpt", name, gpus, 1024, dict(seq_len=1024, hidden=hidden,
                       num_layers=layers, num_heads=heads, vocab_size=51200),
                       _ks(auto_layers), mbs)


def _moe(name, gpus, hidden, layers, heads, experts, auto_layers, mbs):
    return PaperConfig("moe", name, gpus, 1024, dict(seq_len=1024, hidden=hidden,
                       num_layers=layers, num_heads=heads, vocab_size=32000,
                       num_experts=experts, expert_group_size=2048, mlp_ratio=8),
                       _ks(auto_layers), mbs)


def _wrn(name, gpus, depth, channels, width, batch, mbs, ours):
    """`ours`: (base_channels, blocks per stage) of models/wide_resnet.py's WRN that stands in
    for Alpa's bottleneck ResNet (see WRN_NOTE). Auto layers: one per residual block, as Alpa
    (16 for depth 50, 33 for 101; ours has 16 and 32 blocks)."""
    return PaperConfig("wrn", name, gpus, batch, dict(
        image_size=224, resnet_depth=depth, alpa_channels=channels, width=width,
        num_classes=1024, base_channels=ours[0], blocks_per_stage=ours[1]),
        (4 * ours[1],), mbs)


# (Alpa: 1 auto layer and 512 microbatches for 350M on 1 GPU in perf_test_suite; the other
# auto-layer counts and microbatch lists are grid_search_suite's, joined by the auto-layer
# count of perf_test_suite's solution where it differs: GPT-39B's published plan (57.0
# TFLOPS/GPU) was found with 16 auto layers, 16 stages of 1x4, while the grid lists only 8.
# `paper.py` searches each count and keeps the best plan, as Alpa's grid search did.)
GPT = (
    _gpt("350M", 1, 1024, 24, 16, 1, (512,)),
    _gpt("760M", 2, 1536, 24, 16, (6, 12), (32, 64, 128, 256)),
    _gpt("1.3B", 4, 2048, 24, 32, (6, 12), (32, 64, 128)),
    _gpt("2.6B", 8, 2560, 32, 32, (8, 16), (64, 128, 256)),
    _gpt("6.7B", 16, 4096, 32, 32, 8, (32, 64, 128, 256)),
    _gpt("15B", 32, 5120, 48, 40, 16, (64, 128, 256, 512)),
    _gpt("39B", 64, 8192, 48, 64, (8, 16), (128, 256, 512, 1024)),
)
MOE = (
    _moe("380M", 1, 768, 8, 16, 8, 1, (512,)),
    _moe("690M", 2, 768, 8, 16, 16, 8, (16, 32, 64)),
    _moe("1.3B", 4, 768, 16, 16, 16, 8, (16, 32, 64)),
    _moe("2.4B", 8, 1024, 16, 16, 16, 8, (16, 32, 64)),
    _moe("10B", 16, 1536, 16, 16, 32, 8, (16, 32, 64)),
    _moe("27B", 32, 2048, 16, 16, 48, 8, (32, 64, 128)),
    _moe("70B", 64, 2048, 32, 16, 64, 8, (64,)),
)
# Our base channels: the value whose models/wide_resnet.py parameter count is closest to
# Alpa's label (with Alpa's width factor; 4 stages of 4 basic blocks for depth 50, of 8 for
# depth 101).
WRN = (
    _wrn("250M", 1, 50, 160, 2, 1536, (24,), (104, 4)),
    _wrn("500M", 2, 50, 224, 2, 1536, (24,), (144, 4)),
    _wrn("1B", 4, 50, 320, 2, 1536, (24,), (208, 4)),
    _wrn("2B", 8, 50, 448, 2, 1536, (24,), (296, 4)),
    _wrn("4B", 16, 50, 640, 2, 1536, (32,), (416, 4)),
    _wrn("6.8B", 32, 50, 320, 16, 1536, (32,), (64, 4)),
    _wrn("13B", 64, 101, 320, 16, 1520, (38,), (64, 8)),
)
ALL = {c.key: c for c in (*GPT, *MOE, *WRN)}
# What `paper.py` runs by default (about 15 minutes on a 2-core machine): 1 GPU, one host, two
# or more hosts, and the configurations the goals and the published numbers name.
DEFAULT = {"gpt": ("350M", "1.3B", "6.7B", "39B"), "moe": ("380M", "2.4B", "10B"),
           "wrn": ("250M", "2B", "13B")}
FAMILIES = {"gpt": GPT, "moe": MOE, "wrn": WRN}

WRN_NOTE = ("models/wide_resnet.py is a CIFAR-style WRN (3x3 stem at full resolution, basic "
            "blocks, GroupNorm), not Alpa's ImageNet bottleneck ResNet-50/101 (7x7 stride-2 "
            "stem, max-pool, bottleneck blocks, BatchNorm): at 224x224 it has the parameter "
            "count of Alpa's label but far more FLOPs and activation bytes per image.")

# Per-GPU TFLOPS published for the paper's runs. Only what our sources contain: the project's
# issue #4 quotes these from the Alpa paper (the paper's text is not among our sources, and
# Alpa's repository holds no table of them). Everything else is "not in our sources".
PUBLISHED = {
    "gpt-39B": {"Alpa": 57.0, "Megatron-LM": 57.8},
    "moe-10B": {"Alpa": 45.4, "DeepSpeed": 12.9},
}
PUBLISHED_SOURCE = "quoted in the project's issue #4 (Alpa paper, OSDI 2022)"


# ---------------------------------------------------------------------------------------------
# The Megatron-style manual grid.
# ---------------------------------------------------------------------------------------------

def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def cluster_shape(gpus: int, dph: int = DEVICES_PER_HOST) -> tuple[int, int]:
    """(hosts, devices per host): whole hosts of `dph`, or one smaller host below that."""
    return (gpus // dph, dph) if gpus >= dph else (1, gpus)


def submesh(devices: int, dph: int = DEVICES_PER_HOST) -> tuple[int, int]:
    """A stage's submesh as (hosts, devices per host) for `devices` devices."""
    if devices >= dph:
        if devices % dph:
            raise ValueError(f"{devices} devices do not fill whole hosts of {dph}")
        return devices // dph, dph
    return 1, devices


@dataclass(frozen=True)
class GridPoint:
    d: int                   # data-parallel degree (logical axis "data")
    t: int                   # tensor-parallel degree (logical axis "model"), within a host
    p: int                   # pipeline stages
    m: int                   # microbatches
    skip: str | None = None  # why it is not planned (None: planned)


def megatron_grid(gpus: int, num_layers: int, batch: int, *, tensor: bool = True,
                  microbatch_sizes=(1,), dph: int = DEVICES_PER_HOST,
                  state_bytes: float | None = None, budget_bytes: float | None = None,
                  ) -> list[GridPoint]:
    """Every (d, t, p, M) with d * t * p = gpus, t <= devices per host (t = 1 without
    `tensor`), p dividing `num_layers`, and M = batch / (d * b) for each per-replica
    microbatch size b (M an integer >= 1). A point whose training state (parameters and
    optimizer state, `state_bytes`) cannot fit even split t * p ways (Megatron replicates it
    over d) gets `skip` set: a lower bound, so no point that could fit is dropped. Ordered by
    t * p descending (least state per device first: for large models the points that can fit),
    then p, then M descending."""
    out = []
    for p in divisors(gpus):
        if num_layers % p:
            continue
        for t in divisors(gpus // p):
            if t > dph or (t > 1 and not tensor):
                continue
            d = gpus // (p * t)
            per = d * t
            if per > dph and per % dph:
                continue          # a stage must be 1 x n (n <= dph) or whole hosts
            for b in microbatch_sizes:
                if batch % (d * b):
                    continue
                skip = None
                if state_bytes is not None and budget_bytes is not None \
                        and state_bytes / (t * p) > budget_bytes:
                    skip = (f"state {state_bytes / (t * p) / 2**30:.1f} GiB per device even "
                            f"split {t * p} ways > {budget_bytes / 2**30:.0f} GiB")
                out.append(GridPoint(d, t, p, batch // (d * b), skip))
    return sorted(out, key=lambda g: (-g.t * g.p, g.p, -g.m))


def manual_stage_layout(point: GridPoint, dph: int = DEVICES_PER_HOST):
    """(auto layers, layer spans, submeshes, logical shapes) of a uniform pipeline: p stages
    of one auto layer each (K = p), every stage on d * t devices viewed as (d, t)."""
    p, per = point.p, point.d * point.t
    spans = tuple((i, i) for i in range(p))
    return p, spans, (submesh(per, dph),) * p, ((point.d, point.t),) * p


def auto_microbatches(batch: int, tries: int = 3) -> list[int]:
    """Microbatch counts autopar's search tries, in order: batch, batch / 2, batch / 4, ...
    (one, two, four examples per microbatch)."""
    out = []
    for k in range(tries):
        if batch % (2 ** k) == 0:
            out.append(batch // 2 ** k)
    return out
