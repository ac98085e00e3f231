"""The machine a plan runs on: hosts x devices, peak flop/s, memory, and link costs.

`ClusterSpec` describes the physical cluster (per-device numbers, intra- and inter-host
alpha/beta). `ClusterSpec.logical_mesh` views it as an n-D logical mesh whose axes each get the
latency (alpha) and inverse bandwidth (beta) of the links they actually cross.

Devices are numbered host-major (device ``h * devices_per_host + i`` is device ``i`` of host
``h``) and a logical mesh lays them out row-major, so the last mesh axis is the fastest-varying.

Pure Python at import time: `jax` is imported only inside `ClusterSpec.from_devices`.
"""
from __future__ import annotations

import dataclasses
import enum
import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from autopar.core._format import short_repr
from autopar.core.errors import InvalidArgumentError

logger = logging.getLogger(__name__)

_GB = 1e9
_GIB = 2**30
_GBIT_BYTES = 1e9 / 8  # one Gb/s in bytes/s
_TFLOP = 1e12
# Fraction of a link's nominal bandwidth that collectives achieve (NCCL bus bandwidth / nominal).
_EFFICIENCY = 0.9
_HALF_PRECISION = frozenset({"bfloat16", "float16"})


def _positive_number(owner: str, field: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value <= 0:
        raise InvalidArgumentError(
            f"{owner}.{field} must be a positive finite number, got {value!r}; pass e.g. "
            f"{field}=1e-6.")


def _non_negative(owner: str, field: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < 0:
        raise InvalidArgumentError(
            f"{owner}.{field} must be a finite number >= 0, got {value!r}; pass e.g. "
            f"{field}=0.0.")


# The collective algorithms of `cost.CollectiveAlgorithm` (by value; cost imports this module).
ALGORITHMS = ("ring", "tree", "butterfly", "recursive_halving")
# NCCL implements all-reduce as Ring or Tree (CollNet / NVLS need switch hardware) and
# all-gather / reduce-scatter / all-to-all as rings; it picks by size.
_NCCL = ("ring", "tree")


class FusionStyle(enum.Enum):
    """How the backend's XLA fuses elementwise work, for the fusion-aware compute model
    (`intra_op/fusion.py`).

    MULTI_OUTPUT (XLA:GPU, TPU): a reduction fuses its elementwise producers, and fusions that
    share operands or feed each other merge into multi-output kernels (an Adam update reads
    the gradient once). SINGLE_OUTPUT (XLA:CPU): one kernel per written result, cheap producers
    recomputed in each, and a reduction reads a materialized operand. UNFUSED prices every
    node as a kernel of its own (autopar's roofline before fusion was modelled).
    """

    MULTI_OUTPUT = "multi-output"
    SINGLE_OUTPUT = "single-output"
    UNFUSED = "unfused"   # no fusion: every node reads every operand and writes every result
                          # (the plain per-node roofline; for comparisons)


def _check_fusion_style(owner: str, value: Any) -> None:
    if not isinstance(value, FusionStyle):
        raise InvalidArgumentError(
            f"{owner}.fusion_style must be a FusionStyle, got {value!r}; use "
            f"autopar.cost.cluster.FusionStyle.MULTI_OUTPUT (GPU, TPU) or SINGLE_OUTPUT (CPU).")


def _check_algorithms(owner: str, names: Any) -> None:
    if not isinstance(names, tuple) or any(n not in ALGORITHMS for n in names):
        raise InvalidArgumentError(
            f"{owner}.collective_algorithms={names!r} must be a tuple of names from "
            f"{ALGORITHMS} (empty: all of them).")


def _positive_int(owner: str, field: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(
            f"{owner}.{field} must be an int >= 1, got {value!r}; pass e.g. {field}=1.")


@dataclass(frozen=True, slots=True, kw_only=True)
class LogicalMesh:
    """A logical n-D view of a cluster, with per-axis link costs. No devices inside.

    Example:
        >>> mesh = ClusterSpec.preset("dgx-a100", num_hosts=2).logical_mesh((2, 8), ("dp", "tp"))
        >>> mesh.num_devices, mesh.alpha_s[1] < mesh.alpha_s[0]
        (16, True)
    """

    shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    alpha_s: tuple[float, ...]
    beta_s_per_byte: tuple[float, ...]
    peak_flops_bf16_per_s: float
    peak_flops_fp32_per_s: float
    hbm_bandwidth_bytes_per_s: float
    memory_bytes: int
    collective_algorithms: tuple[str, ...] = ()   # what the backend implements; (): every one
    call_overhead_s: float = 0.0                  # fixed cost of one executable call
    reduce_scatter_is_all_reduce: bool = False    # the backend compiles a reduce-scatter as an
                                                  # all-reduce and a slice (XLA:CPU)
    fusion_style: FusionStyle = FusionStyle.MULTI_OUTPUT   # how XLA fuses on this backend

    def __post_init__(self) -> None:
        _check_algorithms("LogicalMesh", self.collective_algorithms)
        _check_fusion_style("LogicalMesh", self.fusion_style)
        _non_negative("LogicalMesh", "call_overhead_s", self.call_overhead_s)
        rank = len(self.shape)
        for field in ("axis_names", "alpha_s", "beta_s_per_byte"):
            if len(getattr(self, field)) != rank:
                raise InvalidArgumentError(
                    f"LogicalMesh.{field} has {len(getattr(self, field))} entries but shape "
                    f"{self.shape} has {rank} axes; give one entry per mesh axis.")
        for i, n in enumerate(self.shape):
            _positive_int("LogicalMesh", f"shape[{i}]", n)
        if len(set(self.axis_names)) != rank:
            raise InvalidArgumentError(
                f"LogicalMesh.axis_names {self.axis_names} has duplicates; use distinct names.")
        for i in range(rank):
            _positive_number("LogicalMesh", f"alpha_s[{i}]", self.alpha_s[i])
            _positive_number("LogicalMesh", f"beta_s_per_byte[{i}]", self.beta_s_per_byte[i])
        for field in ("peak_flops_bf16_per_s", "peak_flops_fp32_per_s",
                      "hbm_bandwidth_bytes_per_s"):
            _positive_number("LogicalMesh", field, getattr(self, field))
        _positive_int("LogicalMesh", "memory_bytes", self.memory_bytes)

    @property
    def num_devices(self) -> int:
        return math.prod(self.shape)

    def peak_flops_per_s(self, dtype_name: str) -> float:
        """Peak flop/s per device: the bf16 peak for "bfloat16"/"float16", else the fp32 peak."""
        if dtype_name in _HALF_PRECISION:
            return self.peak_flops_bf16_per_s
        return self.peak_flops_fp32_per_s


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterSpec:
    """Hosts x devices with per-device peak flop/s, memory, and alpha-beta link costs.

    All rates and sizes are per device. alpha is the latency of one collective step; beta is the
    inverse of the bandwidth a device achieves on that link (seconds per byte).

    Example:
        >>> spec = ClusterSpec.preset("v100-p3.16xlarge", num_hosts=2)
        >>> spec.num_devices
        16
        >>> spec.with_(memory_bytes=8 * 2**30).memory_bytes
        8589934592
    """

    name: str
    num_hosts: int
    devices_per_host: int
    device_kind: str
    peak_flops_bf16_per_s: float
    peak_flops_fp32_per_s: float
    memory_bytes: int
    hbm_bandwidth_bytes_per_s: float
    intra_host_alpha_s: float
    intra_host_beta_s_per_byte: float
    inter_host_alpha_s: float
    inter_host_beta_s_per_byte: float
    collective_algorithms: tuple[str, ...] = ()   # what the backend implements; (): every one
    # Fixed wall time of one executable call (dispatch, launch, synchronization), charged once
    # per step and once per pipeline task. 0 in the presets (not measured there); measured by
    # `autopar.profile` (`ClusterSpec.from_profile`).
    call_overhead_s: float = 0.0
    # XLA:CPU has no reduce-scatter: it compiles one as an all-reduce and a slice (JAX_NOTES),
    # so the "cpu" preset prices it as that.
    reduce_scatter_is_all_reduce: bool = False
    # How XLA fuses on this backend, for the fusion-aware compute model (intra_op/fusion.py);
    # the "cpu" preset has SINGLE_OUTPUT.
    fusion_style: FusionStyle = FusionStyle.MULTI_OUTPUT

    def hoists_recomputation(self) -> bool:
        """Whether XLA on this backend may run a recomputation before the backward pass needs
        it, undoing what it saves: XLA:CPU removes optimization barriers before it schedules,
        so its schedulers may move recomputed values into the forward pass (its default,
        concurrency-optimized one does: the issue-24 LM compiled as if nothing were
        recomputed). GPU and TPU schedule with the barriers in place. Where this is True,
        `inter_op.step_remat` ties the recomputation to the backward by arithmetic."""
        return self.device_kind == "cpu"

    def __post_init__(self) -> None:
        _check_algorithms("ClusterSpec", self.collective_algorithms)
        _check_fusion_style("ClusterSpec", self.fusion_style)
        _non_negative("ClusterSpec", "call_overhead_s", self.call_overhead_s)
        for field in ("name", "device_kind"):
            value = getattr(self, field)
            if not isinstance(value, str) or not value:
                raise InvalidArgumentError(
                    f"ClusterSpec.{field} must be a non-empty string, got {value!r}.")
        for field in ("num_hosts", "devices_per_host", "memory_bytes"):
            _positive_int("ClusterSpec", field, getattr(self, field))
        for field in ("peak_flops_bf16_per_s", "peak_flops_fp32_per_s",
                      "hbm_bandwidth_bytes_per_s", "intra_host_alpha_s",
                      "intra_host_beta_s_per_byte", "inter_host_alpha_s",
                      "inter_host_beta_s_per_byte"):
            _positive_number("ClusterSpec", field, getattr(self, field))

    @property
    def num_devices(self) -> int:
        return self.num_hosts * self.devices_per_host

    def peak_flops_per_s(self, dtype_name: str) -> float:
        """Peak flop/s per device: the bf16 peak for "bfloat16"/"float16", else the fp32 peak."""
        if dtype_name in _HALF_PRECISION:
            return self.peak_flops_bf16_per_s
        return self.peak_flops_fp32_per_s

    def with_(self, **changes: Any) -> ClusterSpec:
        """A copy with some fields replaced (validated again), e.g. measured link numbers."""
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - names)
        if unknown:
            raise InvalidArgumentError(
                f"ClusterSpec.with_ got unknown field(s) {unknown}; valid fields are "
                f"{sorted(names)}.")
        return dataclasses.replace(self, **changes)

    @staticmethod
    def preset_names() -> tuple[str, ...]:
        return tuple(_PRESETS)

    @classmethod
    def preset(cls, name: str, *, num_hosts: int = 1) -> ClusterSpec:
        """A known cluster with `num_hosts` identical hosts (see `preset_names()`)."""
        if name not in _PRESETS:
            raise InvalidArgumentError(
                f"unknown cluster preset {name!r}; valid presets are "
                f"{', '.join(repr(n) for n in _PRESETS)}, or build a ClusterSpec with explicit "
                f"numbers.")
        _positive_int("ClusterSpec.preset", "num_hosts", num_hosts)
        return dataclasses.replace(_PRESETS[name], num_hosts=num_hosts)

    @classmethod
    def from_devices(cls, devices: Any) -> ClusterSpec:
        """Describe the given JAX devices (a sequence or numpy array of them).

        Numbers come from the preset matching the platform and device kind; memory comes from
        `device.memory_stats()["bytes_limit"]` where the backend reports it (on CPU: physical RAM
        shared among the local devices).
        """
        import jax  # lazy: keep this module importable without touching devices
        import numpy as np

        flat = list(np.asarray(devices, dtype=object).reshape(-1))
        if not flat:
            raise InvalidArgumentError(
                "ClusterSpec.from_devices got no devices; pass e.g. jax.devices().")
        per_host: dict[int, int] = {}
        for d in flat:
            per_host[d.process_index] = per_host.get(d.process_index, 0) + 1
        counts = set(per_host.values())
        if len(counts) != 1:
            raise InvalidArgumentError(
                f"ClusterSpec.from_devices needs the same number of devices on every host, got "
                f"{dict(sorted(per_host.items()))} (process_index -> count); pass a balanced "
                f"subset of devices.")
        first = flat[0]
        platform, kind = str(first.platform), str(first.device_kind)
        base = _base_for(platform, kind)
        memory_bytes = base.memory_bytes
        if platform == "cpu":
            local = max(1, len(jax.local_devices(backend="cpu")))
            memory_bytes = _physical_ram_bytes() // local or base.memory_bytes
        stats = memory_stats(first)
        if stats and isinstance(stats.get("bytes_limit"), int) and stats["bytes_limit"] > 0:
            memory_bytes = int(stats["bytes_limit"])
        return dataclasses.replace(
            base, name=f"{platform}:{kind}", device_kind=kind, num_hosts=len(per_host),
            devices_per_host=counts.pop(), memory_bytes=memory_bytes)

    @classmethod
    def from_profile(cls, profile: Any, *, num_hosts: int | None = None,
                     base: ClusterSpec | None = None) -> ClusterSpec:
        """The cluster a measured `DeviceProfile` describes: `base` (default: the known numbers
        for its device kind) for memory, measured matmul flop/s as the peaks, the measured
        bandwidth of a fused elementwise kernel as the memory bandwidth (`base`'s where the
        profile has none), and measured
        link alpha/beta: the fastest measured axis as the intra-host link, the slowest as the
        inter-host one (on one host both come from inside it).

        Example:
            >>> cluster = ClusterSpec.from_profile(autopar.profile(mesh))
        """
        base = base or _base_for(profile.platform, profile.device_kind)
        axes = [a for a in profile.axes if a.size > 1]
        if not axes:
            raise InvalidArgumentError(
                f"ClusterSpec.from_profile: the profile of mesh {profile.mesh_shape} has no axis "
                "with more than one device, so no link was measured. Fix: profile a mesh with "
                "at least 2 devices.")
        fast = min(axes, key=lambda a: a.beta_s_per_byte)
        slow = max(axes, key=lambda a: a.beta_s_per_byte) if profile.num_hosts > 1 else fast
        flops = profile.matmul_flops_per_s
        fp32 = flops.get("float32", max(flops.values()))
        hosts = num_hosts or profile.num_hosts
        devices = math.prod(profile.mesh_shape)
        if devices % profile.num_hosts:
            raise InvalidArgumentError(
                f"ClusterSpec.from_profile: {devices} devices do not split over "
                f"{profile.num_hosts} hosts.")
        return dataclasses.replace(
            base, name=f"profile:{profile.platform}:{profile.device_kind}",
            device_kind=profile.device_kind, num_hosts=hosts,
            devices_per_host=devices // profile.num_hosts,
            peak_flops_fp32_per_s=fp32, peak_flops_bf16_per_s=flops.get("bfloat16", fp32),
            intra_host_alpha_s=fast.alpha_s, intra_host_beta_s_per_byte=fast.beta_s_per_byte,
            inter_host_alpha_s=slow.alpha_s, inter_host_beta_s_per_byte=slow.beta_s_per_byte,
            hbm_bandwidth_bytes_per_s=(profile.memory_bytes_per_s
                                       or base.hbm_bandwidth_bytes_per_s),
            call_overhead_s=profile.call_overhead_s)

    def logical_mesh(self, shape: Sequence[int],
                     axis_names: Sequence[str] | None = None) -> LogicalMesh:
        """View the devices as a row-major mesh of `shape`; each axis gets intra- or inter-host
        alpha/beta depending on whether its device groups stay inside one host."""
        shape = tuple(shape)
        for i, n in enumerate(shape):
            _positive_int("logical_mesh", f"shape[{i}]", n)
        if math.prod(shape) != self.num_devices:
            raise InvalidArgumentError(
                f"logical mesh shape {shape} has {math.prod(shape)} devices but cluster "
                f"{self.name!r} has {self.num_devices} ({self.num_hosts} hosts x "
                f"{self.devices_per_host}); pick a shape whose product is {self.num_devices}.")
        if axis_names is None:
            axis_names = tuple(f"mesh_{i}" for i in range(len(shape)))
        axis_names = tuple(axis_names)
        if len(axis_names) != len(shape):
            raise InvalidArgumentError(
                f"axis_names {axis_names} has {len(axis_names)} names but shape {shape} has "
                f"{len(shape)} axes; give one name per axis.")
        alphas, betas = [], []
        for i in range(len(shape)):
            if self._axis_is_intra_host(shape, i):
                alphas.append(self.intra_host_alpha_s)
                betas.append(self.intra_host_beta_s_per_byte)
            else:
                alphas.append(self.inter_host_alpha_s)
                betas.append(self.inter_host_beta_s_per_byte)
        return LogicalMesh(
            shape=shape, axis_names=axis_names, alpha_s=tuple(alphas),
            beta_s_per_byte=tuple(betas), peak_flops_bf16_per_s=self.peak_flops_bf16_per_s,
            peak_flops_fp32_per_s=self.peak_flops_fp32_per_s,
            hbm_bandwidth_bytes_per_s=self.hbm_bandwidth_bytes_per_s,
            memory_bytes=self.memory_bytes, collective_algorithms=self.collective_algorithms,
            call_overhead_s=self.call_overhead_s,
            reduce_scatter_is_all_reduce=self.reduce_scatter_is_all_reduce,
            fusion_style=self.fusion_style)

    def _axis_is_intra_host(self, shape: tuple[int, ...], axis: int) -> bool:
        # The group of axis i is `shape[i]` devices `stride` apart inside an aligned block of
        # `stride * shape[i]` consecutive devices; it stays in one host iff that block tiles a host.
        if shape[axis] == 1:
            return True
        block = math.prod(shape[axis + 1:]) * shape[axis]
        return block <= self.devices_per_host and self.devices_per_host % block == 0


def _gpu(name: str, kind: str, *, bf16_tflops: float, fp32_tflops: float, memory_bytes: int,
         hbm_bytes_per_s: float, intra_bytes_per_s: float, inter_bytes_per_s: float,
         intra_alpha_s: float, inter_alpha_s: float, devices_per_host: int = 8,
         collective_algorithms: tuple[str, ...] = _NCCL) -> ClusterSpec:
    return ClusterSpec(
        name=name, num_hosts=1, devices_per_host=devices_per_host, device_kind=kind,
        peak_flops_bf16_per_s=bf16_tflops * _TFLOP, peak_flops_fp32_per_s=fp32_tflops * _TFLOP,
        memory_bytes=memory_bytes, hbm_bandwidth_bytes_per_s=hbm_bytes_per_s,
        intra_host_alpha_s=intra_alpha_s, intra_host_beta_s_per_byte=1.0 / intra_bytes_per_s,
        inter_host_alpha_s=inter_alpha_s, inter_host_beta_s_per_byte=1.0 / inter_bytes_per_s,
        collective_algorithms=collective_algorithms)


_PRESETS: dict[str, ClusterSpec] = {
    # AWS p3.16xlarge, Alpa's evaluation cluster (Zheng et al. OSDI'22 §8): 8 x V100-SXM2 16 GB.
    # NVIDIA V100 datasheet: 125 TFLOP/s fp16 tensor, 15.7 fp32, 900 GB/s HBM2. NVLink 2.0
    # hybrid cube-mesh, 150 GB/s per GPU per direction; NCCL reaches ~130 GB/s bus bandwidth.
    # Hosts: 25 Gb/s Ethernet per instance, shared by its 8 GPUs.
    "v100-p3.16xlarge": _gpu(
        "v100-p3.16xlarge", "Tesla V100-SXM2-16GB", bf16_tflops=125.0, fp32_tflops=15.7,
        memory_bytes=16 * _GIB, hbm_bytes_per_s=900 * _GB, intra_bytes_per_s=130 * _GB,
        inter_bytes_per_s=_EFFICIENCY * 25 * _GBIT_BYTES / 8, intra_alpha_s=8e-6,
        inter_alpha_s=30e-6),
    # NVIDIA DGX A100 datasheet / A100 80GB SXM datasheet: 312 TFLOP/s bf16 dense, 19.5 fp32,
    # 2.0 TB/s HBM2e; NVLink 3 600 GB/s bidirectional (300 per direction, NCCL ~235 GB/s);
    # 8 x 200 Gb/s HDR InfiniBand (one NIC per GPU).
    "dgx-a100": _gpu(
        "dgx-a100", "NVIDIA A100-SXM4-80GB", bf16_tflops=312.0, fp32_tflops=19.5,
        memory_bytes=80 * _GIB, hbm_bytes_per_s=2.0e12, intra_bytes_per_s=235 * _GB,
        inter_bytes_per_s=_EFFICIENCY * 200 * _GBIT_BYTES, intra_alpha_s=6e-6,
        inter_alpha_s=20e-6),
    # NVIDIA DGX H100 datasheet / H100 SXM5 datasheet: 989 TFLOP/s bf16 dense, 67 fp32,
    # 3.35 TB/s HBM3; NVLink 4 900 GB/s bidirectional (450 per direction, NCCL ~360 GB/s);
    # 8 x 400 Gb/s NDR InfiniBand (one NIC per GPU).
    "dgx-h100": _gpu(
        "dgx-h100", "NVIDIA H100 80GB HBM3", bf16_tflops=989.0, fp32_tflops=67.0,
        memory_bytes=80 * _GIB, hbm_bytes_per_s=3.35e12, intra_bytes_per_s=360 * _GB,
        inter_bytes_per_s=_EFFICIENCY * 400 * _GBIT_BYTES, intra_alpha_s=5e-6,
        inter_alpha_s=20e-6),
    # (TPU collectives are XLA's own over the ICI torus: no algorithm set is assumed.)
    # Google Cloud TPU v4 system architecture page / Jouppi et al. ISCA'23: 4 chips per host,
    # 275 TFLOP/s bf16, 32 GiB HBM2 at 1.2 TB/s, ICI 6 links x 50 GB/s in a 3-D torus (a mesh axis
    # uses the 2 links of its ring: ~100 GB/s). No native fp32 MXU: fp32 matmuls run as 3 bf16
    # passes (Precision.HIGH), so fp32 peak = bf16 / 3. Hosts in a slice also talk over ICI.
    "tpu-v4": _gpu(
        "tpu-v4", "TPU v4", bf16_tflops=275.0, fp32_tflops=275.0 / 3, memory_bytes=32 * _GIB,
        hbm_bytes_per_s=1.2e12, intra_bytes_per_s=_EFFICIENCY * 100 * _GB,
        inter_bytes_per_s=_EFFICIENCY * 100 * _GB, intra_alpha_s=2e-6, inter_alpha_s=4e-6,
        devices_per_host=4, collective_algorithms=()),
    # Google Cloud TPU v5p page: 4 chips per host, 459 TFLOP/s bf16, 95 GB HBM2e at 2.76 TB/s,
    # ICI 4800 Gb/s per chip over 6 links in a 3-D torus (~200 GB/s per mesh axis).
    "tpu-v5p": _gpu(
        "tpu-v5p", "TPU v5p", bf16_tflops=459.0, fp32_tflops=459.0 / 3, memory_bytes=95 * 10**9,
        hbm_bytes_per_s=2.76e12, intra_bytes_per_s=_EFFICIENCY * 200 * _GB,
        inter_bytes_per_s=_EFFICIENCY * 200 * _GB, intra_alpha_s=2e-6, inter_alpha_s=4e-6,
        devices_per_host=4, collective_algorithms=()),
    # Simulated host-platform devices (XLA_FLAGS=--xla_force_host_platform_device_count=8):
    # round numbers so CPU plans behave like a small, slow cluster.
    "cpu": ClusterSpec(
        name="cpu", num_hosts=1, devices_per_host=8, device_kind="cpu",
        peak_flops_bf16_per_s=5e10, peak_flops_fp32_per_s=5e10, memory_bytes=2 * _GIB,
        hbm_bandwidth_bytes_per_s=2e10, intra_host_alpha_s=1e-5, intra_host_beta_s_per_byte=1e-10,
        inter_host_alpha_s=1e-5, inter_host_beta_s_per_byte=1e-10,
        reduce_scatter_is_all_reduce=True, fusion_style=FusionStyle.SINGLE_OUTPUT),
}
# NVIDIA H200 SXM datasheet: H100 compute with 141 GB HBM3e at 4.8 TB/s. Not a named preset;
# `from_devices` uses it for H200 devices.
_H200 = dataclasses.replace(
    _PRESETS["dgx-h100"], name="dgx-h200", device_kind="NVIDIA H200", memory_bytes=141 * 10**9,
    hbm_bandwidth_bytes_per_s=4.8e12)


def _base_for(platform: str, kind: str) -> ClusterSpec:
    upper = kind.upper()
    if platform == "cpu":
        return _PRESETS["cpu"]
    if platform in ("gpu", "cuda", "rocm"):
        for key, spec in (("V100", _PRESETS["v100-p3.16xlarge"]), ("A100", _PRESETS["dgx-a100"]),
                          ("H100", _PRESETS["dgx-h100"]), ("H200", _H200)):
            if key in upper:
                return spec
    if platform == "tpu":
        if "V4" in upper:
            return _PRESETS["tpu-v4"]
        if "V5P" in upper or ("V5" in upper and "LITE" not in upper and "V5E" not in upper):
            return _PRESETS["tpu-v5p"]
    logger.warning("no cluster numbers known for platform %r device kind %r; using dgx-a100 "
                   "numbers. Pass explicit numbers with ClusterSpec.with_(...) for better plans.",
                   platform, kind)
    return _PRESETS["dgx-a100"]


def _physical_ram_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # not available on this OS
        return 0


def memory_stats(device: Any) -> dict | None:
    """`device.memory_stats()`, or None where the backend reports none."""
    try:
        stats = device.memory_stats()
    except (NotImplementedError, RuntimeError, AttributeError):  # backend has no stats
        return None
    return stats if isinstance(stats, dict) else None


def check_cluster(cluster, *, required: bool = False):
    """`cluster` if it is a `ClusterSpec` (or, unless `required`, None: read off the
    devices)."""
    if (cluster is not None or required) and not isinstance(cluster, ClusterSpec):
        raise InvalidArgumentError(
            f"cluster={short_repr(cluster)} is not an autopar.ClusterSpec. Fix: pass "
            f"autopar.ClusterSpec.preset(name) (presets: {list(ClusterSpec.preset_names())}) "
            f"or autopar.ClusterSpec.from_devices(jax.devices()).")
    return cluster
