"""autopar on a real GPU: the equivalence oracle, the cluster description and the profiler.

Every test is marked `gpu` and skipped where JAX sees no GPU (CI; `conftest.py` sets
`JAX_PLATFORMS=cpu` unless it is already set). On a GPU machine run

    JAX_PLATFORMS=cuda,cpu python -m pytest -q -m gpu tests/api/test_gpu.py

The steps run in fp32 at the highest matmul precision, so that a parallelized step and plain
`jax.jit` on the same GPU compute the same thing (TF32 rounding would hide real differences).
"""
import math

import jax
import numpy as np
import pytest

import autopar
from support.steps import assert_equivalent, make_case, run_steps, sgd_momentum_clip

pytestmark = pytest.mark.gpu

# Dense bf16 matmul peak of the fastest GPUs (B200: 2.25e15): no measurement may exceed it.
PHYSICAL_BOUND_FLOPS = 2.5e15


@pytest.fixture(scope="module")
def gpu():
    """The first GPU JAX sees; skips the test where there is none."""
    try:
        devices = jax.devices("gpu")
    except RuntimeError as e:        # no GPU backend (e.g. JAX_PLATFORMS=cpu)
        pytest.skip(f"no GPU visible to JAX ({e}); on a GPU machine set "
                    "JAX_PLATFORMS=cuda,cpu")
    if not devices:
        pytest.skip("no GPU visible to JAX")
    return devices[0]


@pytest.fixture(scope="module")
def mesh(gpu):
    return jax.sharding.Mesh(np.array([gpu]).reshape(1, 1), ("data", "model"))


def _on(device, tree):
    return jax.device_put(tree, device)


def _check_against_jit(gpu, mesh, method, value_and_grad, rtol):
    """3 GPT steps under autopar on the 1 x 1 GPU mesh against `jax.jit` on the same GPU."""
    with jax.default_matmul_precision("highest"):
        step, state, batches = make_case("gpt", "linen", sgd_momentum_clip(),
                                         value_and_grad=value_and_grad)
        state, batches = _on(gpu, state), _on(gpu, batches)
        ref = run_steps(jax.jit(step), state, batches)
        par = autopar.parallelize(step, mesh=mesh, method=method, batch_argnums=(1,))
        got = run_steps(par, state, batches)
        loss = par(state, batches[0])[1]
    assert loss.devices() == {gpu}, f"autopar's step ran on {loss.devices()}, not the GPU"
    assert all(np.isfinite(x) for x in got[1])
    assert_equivalent(ref, got, compare_params=True, rtol=rtol)


def test_gpt_on_one_gpu_matches_jit(gpu, mesh):
    _check_against_jit(gpu, mesh, autopar.ShardParallel(), jax.value_and_grad, rtol=1e-5)


def test_gradient_accumulation_on_one_gpu_matches_jit(gpu, mesh):
    """4 microbatches of 4 examples: the mean of their gradients is the full batch's."""
    _check_against_jit(gpu, mesh, autopar.ShardParallel(num_microbatches=4),
                       autopar.value_and_grad, rtol=2e-5)


def test_cluster_from_gpu_devices(gpu):
    spec = autopar.ClusterSpec.from_devices([gpu])
    assert spec.device_kind == gpu.device_kind
    assert spec.num_devices == 1
    stats = gpu.memory_stats()
    assert stats and stats["bytes_limit"] > 0, f"the GPU reports no memory limit: {stats}"
    assert spec.memory_bytes == stats["bytes_limit"]
    assert 2**30 < spec.memory_bytes <= 256 * 2**30
    if "H100" in gpu.device_kind or "H200" in gpu.device_kind:
        assert spec.peak_flops_bf16_per_s == 989e12      # the dgx-h100 numbers, not a fallback


def test_profile_one_gpu(mesh, tmp_path):
    p = autopar.profile(mesh, cache_dir=str(tmp_path), matmul_size=2048, repeats=5)
    assert p.platform == "gpu" and p.mesh_shape == (1, 1)
    for dtype in ("float32", "bfloat16"):
        flops = p.matmul_flops_per_s[dtype]
        assert math.isfinite(flops) and 1e11 < flops < PHYSICAL_BOUND_FLOPS, (dtype, flops)
    assert 0 < p.call_overhead_s < 0.05
    assert [a.size for a in p.axes] == [1, 1]
