"""`autopar.profile` on 8 simulated CPU devices: it measures positive numbers, fits every axis,
caches the result by device kind and mesh, reuses it, and measures again when asked or when the
cached file is corrupt."""
import jax
import pytest

import autopar
from autopar.profile import DeviceProfile, cache_path

SMALL = dict(sizes=(1 << 12, 1 << 16), dtypes=("float32",), matmul_size=64, repeats=1)


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 4), ("data", "model"), devices=jax.devices()[:8])


def test_profile_measures_and_caches(mesh, tmp_path):
    p = autopar.profile(mesh, cache_dir=str(tmp_path), **SMALL)
    assert p.mesh_shape == (2, 4) and p.device_kind == str(jax.devices()[0].device_kind)
    assert p.matmul_flops_per_s["float32"] > 0
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
