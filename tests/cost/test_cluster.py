"""Tests for autopar.cluster: presets, validation, logical-mesh axis classification, discovery."""
from __future__ import annotations

import dataclasses
import logging
import os

import numpy as np
import pytest

from autopar.core.errors import InvalidArgumentError
from autopar.cost.cluster import ClusterSpec, LogicalMesh

PRESETS = ("v100-p3.16xlarge", "dgx-a100", "dgx-h100", "tpu-v4", "tpu-v5p", "cpu")


def test_preset_names_lists_every_preset():
    assert set(ClusterSpec.preset_names()) == set(PRESETS)


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_builds_with_plausible_numbers(name):
    spec = ClusterSpec.preset(name, num_hosts=2)
    assert spec.num_hosts == 2
    assert spec.num_devices == 2 * spec.devices_per_host
    assert 1e10 <= spec.peak_flops_bf16_per_s <= 2e15
    assert 1e10 <= spec.peak_flops_fp32_per_s <= spec.peak_flops_bf16_per_s
    assert 1 * 2**30 <= spec.memory_bytes <= 200 * 10**9
    assert 1e10 <= spec.hbm_bandwidth_bytes_per_s <= 1e13
    # latencies between 1 us and 100 us; bandwidths between 100 MB/s and 1 TB/s
    for alpha in (spec.intra_host_alpha_s, spec.inter_host_alpha_s):
        assert 1e-6 <= alpha <= 1e-4
    for beta in (spec.intra_host_beta_s_per_byte, spec.inter_host_beta_s_per_byte):
        assert 1e-12 <= beta <= 1e-8
    # crossing hosts is never cheaper than staying inside one
    assert spec.inter_host_alpha_s >= spec.intra_host_alpha_s
    assert spec.inter_host_beta_s_per_byte >= spec.intra_host_beta_s_per_byte


def test_preset_numbers_match_datasheets():
    v100 = ClusterSpec.preset("v100-p3.16xlarge")
    assert (v100.devices_per_host, v100.peak_flops_bf16_per_s) == (8, 125e12)
    assert v100.peak_flops_fp32_per_s == 15.7e12
    assert v100.hbm_bandwidth_bytes_per_s == 900e9
    # 25 Gb/s shared by 8 GPUs: well under 1 GB/s per device, far slower than NVLink
    assert 1 / v100.inter_host_beta_s_per_byte < 25e9 / 8 / 8 + 1
    assert v100.inter_host_beta_s_per_byte > 100 * v100.intra_host_beta_s_per_byte
    a100 = ClusterSpec.preset("dgx-a100")
    assert (a100.peak_flops_bf16_per_s, a100.peak_flops_fp32_per_s) == (312e12, 19.5e12)
    assert a100.hbm_bandwidth_bytes_per_s == 2.0e12
    h100 = ClusterSpec.preset("dgx-h100")
    assert (h100.peak_flops_bf16_per_s, h100.peak_flops_fp32_per_s) == (989e12, 67e12)
    assert h100.hbm_bandwidth_bytes_per_s == 3.35e12
    assert ClusterSpec.preset("tpu-v4").devices_per_host == 4
    assert ClusterSpec.preset("tpu-v5p").peak_flops_bf16_per_s == 459e12
    cpu = ClusterSpec.preset("cpu")
    assert (cpu.devices_per_host, cpu.memory_bytes) == (8, 2 * 2**30)
    assert cpu.intra_host_alpha_s == cpu.inter_host_alpha_s == 1e-5
    assert cpu.intra_host_beta_s_per_byte == cpu.inter_host_beta_s_per_byte == 1e-10


def test_unknown_preset_lists_valid_names():
    with pytest.raises(InvalidArgumentError) as info:
        ClusterSpec.preset("dgx-b200")
    message = str(info.value)
    assert "dgx-b200" in message
    for name in PRESETS:
        assert name in message


def test_preset_rejects_bad_num_hosts():
    with pytest.raises(InvalidArgumentError, match="num_hosts"):
        ClusterSpec.preset("cpu", num_hosts=0)


def test_peak_flops_by_dtype():
    spec = ClusterSpec.preset("dgx-a100")
    assert spec.peak_flops_per_s("bfloat16") == 312e12
    assert spec.peak_flops_per_s("float16") == 312e12
    assert spec.peak_flops_per_s("float32") == 19.5e12
    assert spec.peak_flops_per_s("int32") == 19.5e12
    mesh = spec.logical_mesh((8,))
    assert mesh.peak_flops_per_s("bfloat16") == 312e12
    assert mesh.peak_flops_per_s("float32") == 19.5e12


@pytest.mark.parametrize("field, value", [
    ("num_hosts", 0), ("devices_per_host", -1), ("memory_bytes", 1.5),
    ("peak_flops_bf16_per_s", 0.0), ("intra_host_alpha_s", -1e-6),
    ("inter_host_beta_s_per_byte", float("nan")), ("name", ""), ("call_overhead_s", -1e-6),
])
def test_validation_names_the_field(field, value):
    with pytest.raises(InvalidArgumentError, match=field):
        ClusterSpec.preset("cpu").with_(**{field: value})


def test_with_replaces_fields_and_rejects_unknown():
    spec = ClusterSpec.preset("cpu").with_(intra_host_beta_s_per_byte=2e-10, num_hosts=2)
    assert spec.intra_host_beta_s_per_byte == 2e-10 and spec.num_devices == 16
    with pytest.raises(InvalidArgumentError, match="bandwidth"):
        spec.with_(bandwidth=1.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.num_hosts = 3  # type: ignore[misc]


def test_logical_mesh_two_hosts_axis_classification():
    spec = ClusterSpec.preset("v100-p3.16xlarge", num_hosts=2)
    mesh = spec.logical_mesh((2, 8), ("dp", "tp"))
    assert isinstance(mesh, LogicalMesh)
    assert mesh.num_devices == 16 and mesh.axis_names == ("dp", "tp")
    assert mesh.alpha_s == (spec.inter_host_alpha_s, spec.intra_host_alpha_s)
    assert mesh.beta_s_per_byte == (spec.inter_host_beta_s_per_byte,
                                    spec.intra_host_beta_s_per_byte)
    assert mesh.peak_flops_bf16_per_s == spec.peak_flops_bf16_per_s
    assert mesh.memory_bytes == spec.memory_bytes

    flat = spec.logical_mesh((1, 16))
    assert flat.beta_s_per_byte[1] == spec.inter_host_beta_s_per_byte  # 16 devices span 2 hosts
    assert flat.beta_s_per_byte[0] == spec.intra_host_beta_s_per_byte  # size-1 axis: no links

    # (4, 4): axis 1 groups 4 neighbours inside a host; axis 0 groups strides of 4 across hosts
    square = spec.logical_mesh((4, 4))
    assert square.beta_s_per_byte == (spec.inter_host_beta_s_per_byte,
                                      spec.intra_host_beta_s_per_byte)
    assert square.axis_names == ("mesh_0", "mesh_1")


def test_logical_mesh_single_host_is_all_intra():
    spec = ClusterSpec.preset("dgx-a100")
    mesh = spec.logical_mesh((2, 2, 2))
    assert mesh.beta_s_per_byte == (spec.intra_host_beta_s_per_byte,) * 3
    assert mesh.alpha_s == (spec.intra_host_alpha_s,) * 3


def test_logical_mesh_group_straddling_hosts_is_inter():
    # 3 hosts x 8: an axis of 6 neighbours (blocks 0-5, 6-11, ...) crosses hosts 0 and 1.
    spec = ClusterSpec.preset("dgx-a100", num_hosts=3)
    mesh = spec.logical_mesh((4, 6))
    assert mesh.beta_s_per_byte[1] == spec.inter_host_beta_s_per_byte


def test_logical_mesh_wrong_product_names_both_numbers():
    spec = ClusterSpec.preset("v100-p3.16xlarge", num_hosts=2)
    with pytest.raises(InvalidArgumentError) as info:
        spec.logical_mesh((3, 4))
    assert "12" in str(info.value) and "16" in str(info.value)


def test_logical_mesh_axis_name_count_must_match():
    with pytest.raises(InvalidArgumentError, match="axis_names"):
        ClusterSpec.preset("cpu").logical_mesh((2, 4), ("x",))
    with pytest.raises(InvalidArgumentError, match="duplicates"):
        ClusterSpec.preset("cpu").logical_mesh((2, 4), ("x", "x"))


def test_logical_mesh_rejects_bad_axis_size():
    with pytest.raises(InvalidArgumentError, match="shape"):
        ClusterSpec.preset("cpu").logical_mesh((0, 8))


def test_from_devices_on_cpu():
    jax = pytest.importorskip("jax")
    devices = jax.devices("cpu")
    spec = ClusterSpec.from_devices(devices)
    cpu = ClusterSpec.preset("cpu")
    assert spec.name == "cpu:cpu" and spec.device_kind == "cpu"
    assert spec.num_hosts == 1 and spec.num_devices == len(devices)
    assert spec.peak_flops_fp32_per_s == cpu.peak_flops_fp32_per_s
    assert spec.intra_host_beta_s_per_byte == cpu.intra_host_beta_s_per_byte
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert spec.memory_bytes == ram // len(jax.local_devices(backend="cpu"))
    # a numpy array of devices (as in a Mesh) is flattened
    same = ClusterSpec.from_devices(np.array(devices, dtype=object).reshape(1, -1))
    assert same == spec
    assert spec.logical_mesh((len(devices),)).num_devices == len(devices)


class _FakeDevice:
    def __init__(self, process_index, platform="gpu", device_kind="NVIDIA H100 80GB HBM3",
                 stats=None):
        self.process_index = process_index
        self.platform = platform
        self.device_kind = device_kind
        self._stats = stats

    def memory_stats(self):
        return self._stats


def test_from_devices_gpu_hosts_and_memory_stats():
    devices = [_FakeDevice(h, stats={"bytes_limit": 70 * 2**30}) for h in (0, 1) for _ in range(8)]
    spec = ClusterSpec.from_devices(devices)
    h100 = ClusterSpec.preset("dgx-h100")
    assert (spec.num_hosts, spec.devices_per_host) == (2, 8)
    assert spec.name == "gpu:NVIDIA H100 80GB HBM3"
    assert spec.memory_bytes == 70 * 2**30
    assert spec.peak_flops_bf16_per_s == h100.peak_flops_bf16_per_s
    assert spec.inter_host_beta_s_per_byte == h100.inter_host_beta_s_per_byte


def test_from_devices_h200_and_tpu():
    h200 = ClusterSpec.from_devices([_FakeDevice(0, device_kind="NVIDIA H200")] * 8)
    assert h200.memory_bytes == 141 * 10**9 and h200.hbm_bandwidth_bytes_per_s == 4.8e12
    v4 = ClusterSpec.from_devices([_FakeDevice(0, platform="tpu", device_kind="TPU v4")] * 4)
    assert v4.peak_flops_bf16_per_s == 275e12


def test_from_devices_unknown_kind_falls_back_with_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="autopar.cost.cluster"):
        spec = ClusterSpec.from_devices([_FakeDevice(0, device_kind="Mystery X1")] * 4)
    assert spec.peak_flops_bf16_per_s == ClusterSpec.preset("dgx-a100").peak_flops_bf16_per_s
    assert "Mystery X1" in caplog.text


def test_from_devices_rejects_unbalanced_hosts_and_empty():
    with pytest.raises(InvalidArgumentError, match="same number of devices"):
        ClusterSpec.from_devices([_FakeDevice(0)] * 3 + [_FakeDevice(1)])
    with pytest.raises(InvalidArgumentError, match="no devices"):
        ClusterSpec.from_devices([])
