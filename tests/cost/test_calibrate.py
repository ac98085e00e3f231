"""`autopar.calibrate` on 8 simulated CPU devices: a cluster description that is wrong on
purpose (1000x too fast) predicts far below the measured step; after calibrating, the re-plan's
prediction is much closer to what it measures, the dump shows predicted vs measured, and the
function it hands back still computes the same step."""
import math

import jax
import numpy as np
import optax
import pytest

import autopar
from support.steps import make_case, mesh_of

SMALL_PROFILE = dict(sizes=(1 << 12, 1 << 16), dtypes=("float32",), matmul_size=64, repeats=1)


def test_calibrate_moves_predictions_toward_measurements(tmp_path):
    step, state, batches = make_case("mlp", "linen", optax.sgd(0.1), hidden=64, batch_size=64)
    wrong = autopar.ClusterSpec.preset("cpu").with_(
        peak_flops_fp32_per_s=1e17, peak_flops_bf16_per_s=1e17, hbm_bandwidth_bytes_per_s=1e16,
        intra_host_alpha_s=1e-11, intra_host_beta_s_per_byte=1e-16, inter_host_alpha_s=1e-11,
        inter_host_beta_s_per_byte=1e-16)
    par = autopar.parallelize(step, mesh=mesh_of((2, 4)), cluster=wrong)
    cal = autopar.calibrate(par, state, batches[0], steps=2, profile_cache_dir=str(tmp_path),
                            profile_kwargs=SMALL_PROFILE)
    assert cal.error_before < -0.9                       # predicted far too fast
    assert cal.after is not None and cal.error_after is not None
    assert abs(math.log1p(cal.error_after)) < abs(math.log1p(cal.error_before))
    assert cal.efficiency > 0 and cal.before.measured["step_s"] > 0
    text = autopar.dump(cal.plan)
    assert "measured (autopar.calibrate, 2 steps): step" in text
    assert autopar.ParallelPlan.from_json(cal.plan.to_json()) == cal.plan   # measured kept
    # the function handed back computes the same step
    want = jax.jit(step)(state, batches[0])
    got = cal.function(state, batches[0])
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=1e-5)


def test_calibrate_checks_its_arguments():
    with pytest.raises(autopar.InvalidArgumentError, match="not a parallelized function"):
        autopar.calibrate(lambda x: x, 1)
    step, state, batches = make_case("mlp", "linen", optax.sgd(0.1))
    par = autopar.parallelize(step, mesh=mesh_of((2, 4)))
    with pytest.raises(autopar.InvalidArgumentError, match="steps=0"):
        autopar.calibrate(par, state, batches[0], steps=0)
