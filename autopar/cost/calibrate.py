"""`autopar.calibrate`: close the loop between the cost model and the devices.

It runs the chosen plan for a few steps and compares the measured step time (and peak memory,
where the backend reports it) with the prediction; then it refits the cluster description:
the links and matmul throughput measured by `autopar.profile(mesh)`, and one efficiency factor
that scales every time (flop/s and bandwidth down, latency up) so the refitted model predicts
the measured step. When the prediction was off by more than `tolerance`, it re-plans with the
refitted cluster, measures the new plan too and keeps the faster of the two.

Example:
    >>> step = autopar.parallelize(train_step, mesh=mesh)
    >>> cal = autopar.calibrate(step, state, batch)
    >>> cal.error_before, cal.error_after       # predicted / measured - 1
    >>> state, loss = cal.function(state, batch)
    >>> print(autopar.dump(cal.plan))           # shows predicted vs measured
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import jax

from autopar.core.errors import InvalidArgumentError
from autopar.core.plan import ParallelPlan
from autopar.cost.cluster import ClusterSpec, memory_stats
from autopar.cost.measure import median_time, profile
from autopar.frontend.checks import is_parallelized

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Calibration:
    """What `calibrate` found. Plans carry `measured` ({"step_s", "peak_bytes", "steps"})."""
    before: ParallelPlan              # the original plan, as predicted by the original model
    after: ParallelPlan | None        # the re-plan under the refitted cluster (None: none)
    cluster: ClusterSpec              # the refitted cluster
    efficiency: float                 # measured / profile-based prediction of the first plan
    error_before: float               # predicted / measured - 1, original model
    error_after: float | None         # the re-plan's, under the refitted model (None: the
                                      # first prediction was within tolerance, no re-plan)
    function: object                  # the ParallelizedFunction to use from now on
    plan: ParallelPlan                # its plan (with `measured`)


def measure_step(fn, args: tuple, steps: int) -> dict:
    """Median wall time of `fn(*args)` over `steps` calls after one compiling call; donated
    arguments are copied before each call (outside the timing)."""
    donate = set(fn.donate_argnums)

    def fresh():
        return tuple(jax.tree_util.tree_map(lambda x: x.copy() if hasattr(x, "copy") else x, a)
                     if i in donate else a for i, a in enumerate(args))

    step_s = median_time(fn, repeats=steps, fresh_args=fresh)
    peaks = [s["peak_bytes_in_use"] for s in map(memory_stats, fn.mesh.devices.flat)
             if s and isinstance(s.get("peak_bytes_in_use"), int)]
    return {"step_s": step_s, "steps": steps, "peak_bytes": max(peaks) if peaks else None}


def _scaled(cluster: ClusterSpec, factor: float) -> ClusterSpec:
    """Every time the model predicts on `cluster`, times `factor`."""
    return cluster.with_(
        peak_flops_bf16_per_s=cluster.peak_flops_bf16_per_s / factor,
        peak_flops_fp32_per_s=cluster.peak_flops_fp32_per_s / factor,
        hbm_bandwidth_bytes_per_s=cluster.hbm_bandwidth_bytes_per_s / factor,
        intra_host_alpha_s=cluster.intra_host_alpha_s * factor,
        intra_host_beta_s_per_byte=cluster.intra_host_beta_s_per_byte * factor,
        inter_host_alpha_s=cluster.inter_host_alpha_s * factor,
        inter_host_beta_s_per_byte=cluster.inter_host_beta_s_per_byte * factor,
        call_overhead_s=cluster.call_overhead_s * factor)


def calibrate(fn, *args, steps: int = 3, tolerance: float = 0.25,
              refresh_profile: bool = False, profile_cache_dir: str | None = None,
              profile_kwargs: dict | None = None) -> Calibration:
    """Measure `fn`'s plan on `args`, refit the model and re-plan if it was off (see the module
    docstring). `fn` is what `autopar.parallelize` returned."""
    if not is_parallelized(fn):
        raise InvalidArgumentError(
            f"calibrate: {fn!r} is not a parallelized function. Fix: pass what "
            "autopar.parallelize(...) returned.")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise InvalidArgumentError(f"calibrate: steps={steps!r} must be an int >= 1.")
    mesh = fn.mesh
    before = fn.get_plan(*args)
    m0 = measure_step(fn, args, steps)
    err0 = before.predicted_step_s / m0["step_s"] - 1
    prof = profile(mesh, refresh=refresh_profile, cache_dir=profile_cache_dir,
                   **(profile_kwargs or {}))
    measured_cluster = ClusterSpec.from_profile(prof, base=fn.cluster)
    # The profiled cluster's prediction for the same step (the ILP may pick another plan
    # there; its prediction is what the efficiency factor corrects).
    probe = fn.with_cluster(measured_cluster)
    efficiency = m0["step_s"] / max(probe.get_plan(*args).predicted_step_s, 1e-30)
    cluster = _scaled(measured_cluster, efficiency)
    before = dataclasses.replace(before, measured=m0)
    log.info("autopar.calibrate: measured %.4g s vs predicted %.4g s (%+.0f%%); efficiency "
             "factor %.3g", m0["step_s"], before.predicted_step_s, 100 * err0, efficiency)
    if abs(err0) <= tolerance:
        kept, kept_plan, after, err1 = fn, before, None, None
    else:
        replanned = fn.with_cluster(cluster)
        m1 = measure_step(replanned, args, steps)
        after = dataclasses.replace(replanned.get_plan(*args), measured=m1)
        err1 = after.predicted_step_s / m1["step_s"] - 1
        kept, kept_plan = (replanned, after) if m1["step_s"] <= m0["step_s"] else (fn, before)
        log.info("autopar.calibrate: re-planned; measured %.4g s vs predicted %.4g s (%+.0f%%)",
                 m1["step_s"], after.predicted_step_s, 100 * err1)
    return Calibration(before=before, after=after, cluster=cluster, efficiency=efficiency,
                       error_before=err0, error_after=err1, function=kept, plan=kept_plan)
