"""Device profiles without JAX: the alpha/beta fit against known link numbers, the JSON round
trip, and the refusals (corrupt, foreign, other version, other device or mesh)."""
import dataclasses
import json

import numpy as np
import pytest

from autopar.core.errors import ProfileError
from autopar.cost.cluster import ClusterSpec
from autopar.cost.profiler import (
    COLLECTIVES,
    VERSION,
    AxisProfile,
    DeviceProfile,
    cache_path,
    fit_link,
    ring_coefficients,
)


def synthetic(alpha, beta, n, sizes=(1e4, 1e5, 1e6, 1e7), noise=0.0, seed=0):
    rng = np.random.default_rng(seed)
    out = {}
    for kind in COLLECTIVES:
        steps, factor = ring_coefficients(kind, n)
        out[kind] = tuple((s, (steps * alpha + factor * s * beta) * (1 + noise * rng.normal()))
                          for s in sizes)
    return out


@pytest.mark.parametrize("n", [2, 4, 8])
def test_fit_recovers_the_link(n):
    alpha, beta = fit_link(synthetic(5e-6, 2e-10, n), n)
    assert alpha == pytest.approx(5e-6, rel=1e-6) and beta == pytest.approx(2e-10, rel=1e-6)


def test_fit_with_noise_stays_close():
    alpha, beta = fit_link(synthetic(5e-6, 2e-10, 4, noise=0.02), 4)
    assert alpha == pytest.approx(5e-6, rel=0.2) and beta == pytest.approx(2e-10, rel=0.05)


def test_fit_keeps_both_numbers_positive():
    # times that fall with size (noise) would fit a negative beta: latency only
    alpha, beta = fit_link({"all-reduce": ((1e3, 2e-5), (1e4, 1e-5))}, 2)
    assert alpha > 0 and 0 < beta < 1e-12
    # times through the origin would fit a negative alpha: bandwidth only
    alpha, beta = fit_link({"all-gather": ((1e6, 0.9e-3), (2e6, 2.1e-3))}, 2)
    assert 0 < alpha < 1e-12 and beta > 0
    with pytest.raises(ProfileError, match="at least 2 samples"):
        fit_link({"all-gather": ((1e6, 1e-3),)}, 2)
    with pytest.raises(ProfileError, match="unknown collective"):
        ring_coefficients("broadcast", 4)


def make_profile(kind="Tesla V100-SXM2-16GB", shape=(2, 8), hosts=2):
    axes = tuple(AxisProfile(name=nm, size=n, samples=synthetic(a, b, n), alpha_s=a,
                             beta_s_per_byte=b)
                 for nm, n, a, b in zip(("data", "model"), shape, (3e-5, 8e-6), (4e-9, 8e-12)))
    return DeviceProfile(platform="gpu", device_kind=kind, mesh_shape=shape, num_hosts=hosts,
                         matmul_flops_per_s={"float32": 14e12, "bfloat16": 100e12}, axes=axes,
                         call_overhead_s=2.5e-5, memory_bytes_per_s=7.5e11, jax_version="0.x",
                         created_utc="2026-11-22T00:00:00+00:00")


def test_round_trip(tmp_path):
    p = make_profile()
    path = str(tmp_path / "p.json")
    p.save(path)
    assert DeviceProfile.load(path) == p
    assert DeviceProfile.from_json(p.to_json()) == p
    assert not [f for f in tmp_path.iterdir() if f.name.endswith(".tmp")]   # atomic write


@pytest.mark.parametrize("edit,match", [
    (lambda d: "{not json", "not valid JSON"),
    (lambda d: json.dumps({**d, "format": "something-else"}), "not an autopar profile"),
    (lambda d: json.dumps({**d, "version": VERSION + 1}), f"version {VERSION + 1}"),
    (lambda d: json.dumps({k: v for k, v in d.items() if k != "axes"}), "malformed field"),
    (lambda d: json.dumps({**d, "matmul_flops_per_s": {"float32": -1}}), "invalid numbers"),
    (lambda d: json.dumps({**d, "mesh_shape": [4, 4]}), "axis sizes"),
    (lambda d: json.dumps({**d, "call_overhead_s": -1.0}), "call_overhead_s=-1.0"),
    (lambda d: json.dumps({k: v for k, v in d.items() if k != "call_overhead_s"}),
     "malformed field"),
    (lambda d: json.dumps({**d, "memory_bytes_per_s": float("nan")}), "memory_bytes_per_s=nan"),
    (lambda d: json.dumps({k: v for k, v in d.items() if k != "memory_bytes_per_s"}),
     "malformed field"),
])
def test_corrupt_or_foreign_profiles_are_refused(edit, match):
    text = edit(json.loads(make_profile().to_json()))
    with pytest.raises(ProfileError, match=match):
        DeviceProfile.from_json(text)


def test_mismatched_device_or_mesh_is_refused(tmp_path):
    p = make_profile()
    p.check_matches("Tesla V100-SXM2-16GB", (2, 8), "here")
    with pytest.raises(ProfileError, match="measured on 'Tesla V100-SXM2-16GB' with mesh"):
        p.check_matches("NVIDIA H100 80GB HBM3", (2, 8), "here")
    with pytest.raises(ProfileError, match=r"not 'Tesla V100-SXM2-16GB' with mesh \(4, 4\)"):
        p.check_matches("Tesla V100-SXM2-16GB", (4, 4), "here")
    with pytest.raises(ProfileError, match="cannot read"):
        DeviceProfile.load(str(tmp_path / "missing.json"))


def test_cache_path_is_keyed_by_device_and_mesh(tmp_path):
    a = cache_path(str(tmp_path), "NVIDIA A100-SXM4-80GB", (2, 4))
    assert a != cache_path(str(tmp_path), "NVIDIA A100-SXM4-80GB", (4, 2))
    assert a != cache_path(str(tmp_path), "NVIDIA H100 80GB HBM3", (2, 4))
    assert "/" not in a[len(str(tmp_path)) + 1:] and a.endswith(f"-2x4-v{VERSION}.json")


def test_cluster_from_profile_uses_the_measured_numbers():
    c = ClusterSpec.from_profile(make_profile())
    assert (c.num_hosts, c.devices_per_host) == (2, 8)
    assert c.call_overhead_s == 2.5e-5
    assert c.peak_flops_fp32_per_s == 14e12 and c.peak_flops_bf16_per_s == 100e12
    # the fast axis is the intra-host link, the slow one the inter-host link
    assert (c.intra_host_alpha_s, c.intra_host_beta_s_per_byte) == (8e-6, 8e-12)
    assert (c.inter_host_alpha_s, c.inter_host_beta_s_per_byte) == (3e-5, 4e-9)
    assert c.memory_bytes == ClusterSpec.preset("v100-p3.16xlarge").memory_bytes
    assert c.hbm_bandwidth_bytes_per_s == 7.5e11           # measured, not the datasheet's
    unmeasured = dataclasses.replace(make_profile(), memory_bytes_per_s=0.0)
    assert ClusterSpec.from_profile(unmeasured).hbm_bandwidth_bytes_per_s == \
        ClusterSpec.preset("v100-p3.16xlarge").hbm_bandwidth_bytes_per_s
    mesh = c.logical_mesh((2, 8), ("data", "model"))
    assert mesh.beta_s_per_byte == (4e-9, 8e-12)
    one_host = ClusterSpec.from_profile(make_profile(shape=(2, 4), hosts=1))
    assert one_host.inter_host_beta_s_per_byte == one_host.intra_host_beta_s_per_byte == 8e-12
