"""`autopar.profile` on 8 simulated CPU devices: it measures positive numbers, fits every axis,
caches the result by device kind and mesh, reuses it, and measures again when asked or when the
cached file is corrupt."""
import jax
import pytest

import autopar
from autopar.cost.profiler import DeviceProfile, cache_path

SMALL = dict(sizes=(1 << 12, 1 << 16), dtypes=("float32",), matmul_size=64, memory_size=1 << 16,
             repeats=1)


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 4), ("data", "model"), devices=jax.devices()[:8])


def test_profile_measures_and_caches(mesh, tmp_path):
    p = autopar.profile(mesh, cache_dir=str(tmp_path), **SMALL)
    assert p.mesh_shape == (2, 4) and p.device_kind == str(jax.devices()[0].device_kind)
    assert p.matmul_flops_per_s["float32"] > 0
    assert 0 < p.call_overhead_s < 1.0                    # a trivial call: well under a second
    # A fused elementwise kernel: well above 1 MB/s and below 10 TB/s on any host.
    assert 1e6 < p.memory_bytes_per_s < 1e13
    assert [a.name for a in p.axes] == ["data", "model"]
    for a in p.axes:
        assert a.alpha_s > 0 and a.beta_s_per_byte > 0
        assert sorted(a.samples) == sorted(["all-reduce", "all-gather", "reduce-scatter",
                                            "all-to-all"])
        assert all(len(v) == 2 and all(s > 0 for _, s in v) for v in a.samples.values())
    path = cache_path(str(tmp_path), p.device_kind, (2, 4))
    assert DeviceProfile.load(path) == p
    again = autopar.profile(mesh, cache_dir=str(tmp_path), **SMALL)
    assert again == p                                       # read back, not measured
    fresh = autopar.profile(mesh, cache_dir=str(tmp_path), refresh=True, **SMALL)
    assert fresh.extra["seconds"] != p.extra["seconds"]     # measured again
    cluster = autopar.ClusterSpec.from_profile(fresh)
    assert cluster.num_devices == 8
    assert cluster.call_overhead_s == fresh.call_overhead_s
    assert cluster.hbm_bandwidth_bytes_per_s == fresh.memory_bytes_per_s


def test_call_overhead_is_charged_once_per_call(mesh, tmp_path):
    """A single-mesh step pays the measured call overhead once; a 2-stage pipeline pays it per
    forward and backward task and per apply-gradient executable."""
    from support.steps import make_case, sgd_momentum_clip
    p = autopar.profile(mesh, cache_dir=str(tmp_path), **SMALL)
    cluster = autopar.ClusterSpec.from_profile(p)
    o = cluster.call_overhead_s
    step, state, batches = make_case("mlp", "linen", sgd_momentum_clip(), num_layers=4,
                                     value_and_grad=autopar.value_and_grad)
    single = autopar.parallelize(step, mesh=mesh, cluster=cluster).get_plan(state, batches[0])
    assert single.predicted_overhead_s == o
    assert single.predicted_step_s == pytest.approx(
        single.predicted_compute_s + single.predicted_comm_s + single.predicted_reshard_s + o)
    m = 4
    method = autopar.PipeshardParallel(num_microbatches=m,
                                       layer_option=autopar.AutoLayerOption(num_layers=2),
                                       stage_option=autopar.UniformStageOption(num_stages=2))
    pipe = autopar.parallelize(step, mesh=mesh, method=method,
                               cluster=cluster).get_plan(state, batches[0])
    lat = [s.latency_s for s in pipe.stages]
    scale = (sum(lat) + (m - 1) * max(lat)) / sum(lat)
    segments = pipe.pipeline["segments"]
    assert pipe.predicted_overhead_s == pytest.approx(scale * 2 * 2 * o + segments * o)
    assert "call overhead" in autopar.dump(pipe)
    zero = autopar.parallelize(step, mesh=mesh, method=method, cluster=cluster.with_(
        call_overhead_s=0.0)).get_plan(state, batches[0])
    assert zero.predicted_overhead_s == 0 and "call overhead" not in autopar.dump(zero)


def test_corrupt_cache_is_ignored_and_rebuilt(mesh, tmp_path, caplog):
    kind = str(jax.devices()[0].device_kind)
    path = cache_path(str(tmp_path), kind, (2, 4))
    tmp_path.joinpath(path.rsplit("/", 1)[-1]).write_text("{broken")
    with caplog.at_level("WARNING"):
        p = autopar.profile(mesh, cache_dir=str(tmp_path), **SMALL)
    assert "ignoring the cached profile" in caplog.text and "not valid JSON" in caplog.text
    assert DeviceProfile.load(path) == p


def test_profile_checks_its_arguments(mesh):
    with pytest.raises(autopar.InvalidArgumentError, match="not a jax.sharding.Mesh"):
        autopar.profile("mesh")
    with pytest.raises(autopar.InvalidArgumentError, match="2 or more"):
        autopar.profile(mesh, sizes=(1024,), use_cache=False)
