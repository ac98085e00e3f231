"""`autopar.profile(mesh)`: measure the devices the plans will run on.

Matmul throughput per dtype (square matmuls, every device of the mesh computing at once), the
memory bandwidth a fused elementwise kernel achieves (every device at once), the fixed cost of
one executable call on the whole mesh, and per mesh axis the time of all-reduce, all-gather,
reduce-scatter and all-to-all over that axis alone (`jax.shard_map` with the collective on one
axis name) for a range of sizes; each axis's link alpha/beta are
fitted through the cost model's formulas (`cost.profiler.fit_link`). The result is cached as JSON by
device kind and mesh shape, and reused unless `refresh=True`.

Example:
    >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
    >>> p = autopar.profile(mesh)
    >>> p.axes[1].beta_s_per_byte, p.matmul_flops_per_s["float32"]
"""
from __future__ import annotations

import datetime
import logging
import os
import statistics
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from autopar.core.errors import InvalidArgumentError, ProfileError
from autopar.cost.profiler import (
    COLLECTIVES,
    AxisProfile,
    DeviceProfile,
    cache_path,
    default_cache_dir,
    fit_link,
)

log = logging.getLogger(__name__)

DEFAULT_SIZES = (1 << 12, 1 << 15, 1 << 18, 1 << 21)     # bytes per collective (full tensor)


def median_time(fn, *args, repeats: int, fresh_args=None) -> float:
    """Median wall time of `fn(*args)` after one warm-up call (which compiles);
    `fresh_args()`, when given, makes each call's arguments (e.g. copies of donated ones)
    outside the timing."""
    make = fresh_args or (lambda: args)
    jax.block_until_ready(fn(*make()))
    times = []
    for _ in range(repeats):
        call_args = make()
        jax.block_until_ready(call_args)
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*call_args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _all_devices(mesh: jax.sharding.Mesh) -> jax.sharding.Mesh:
    """The mesh's devices as one axis "d"."""
    return jax.sharding.Mesh(np.array(list(mesh.devices.flat)), ("d",))


def measure_matmul(mesh: jax.sharding.Mesh, dtype: str, n: int, repeats: int) -> float:
    """Achieved flop/s per device of an n x n x n matmul that every device of `mesh` runs at
    the same time (each its own), as in an SPMD step: devices that share hardware (simulated
    CPU devices share the host's cores) are measured sharing it."""
    flat = _all_devices(mesh)
    x = jax.device_put(jnp.ones((flat.size, n, n), dtype), NamedSharding(flat, P("d")))
    f = jax.jit(lambda a: jnp.einsum("bij,bjk->bik", a, a))
    return 2.0 * n ** 3 / median_time(f, x, repeats=repeats)


def measure_memory_bandwidth(mesh: jax.sharding.Mesh, nbytes: int, repeats: int) -> float:
    """Achieved bytes/s per device of one fused elementwise kernel (`x * 2 + 1` on an
    `nbytes` float32 array per device) that every device of `mesh` runs at the same time:
    the bandwidth the fusion-aware compute model (`intra_op/fusion.py`) divides a fusion's
    bytes by. The bytes are what XLA's `cost_analysis` counts for the kernel (x read once, the
    result written once)."""
    flat = _all_devices(mesh)
    x = jax.device_put(jnp.ones((flat.size, max(1, nbytes // 4)), jnp.float32),
                       NamedSharding(flat, P("d")))
    f = jax.jit(lambda a: a * 2.0 + 1.0)
    cost = f.lower(x).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    moved = float(cost.get("bytes accessed", 0.0)) if cost else 0.0
    moved = moved if moved > 0 else 2.0 * x.nbytes / flat.size
    return moved / median_time(f, x, repeats=repeats)


def measure_call_overhead(mesh: jax.sharding.Mesh, repeats: int) -> float:
    """Wall time of one call of a trivial jitted computation on every device of `mesh`
    (dispatch, launch, synchronization; no work to speak of): the fixed cost of each
    executable call, which a step with many small calls (a pipeline's tasks) pays many times."""
    flat = _all_devices(mesh)
    x = jax.device_put(jnp.zeros((flat.size, 8), jnp.float32), NamedSharding(flat, P("d")))
    return median_time(jax.jit(lambda a: a + 1.0), x, repeats=max(repeats, 20))


def _collective_fn(kind: str, mesh, axis: str):
    """A jitted collective over `axis` alone, on a [n * rows, 128] float32 array sharded over
    every mesh axis along dimension 0 (each device holds its own rows)."""
    spec = P(tuple(mesh.axis_names))
    if kind == "all-reduce":
        body = lambda x: jax.lax.psum(x, axis)                       # noqa: E731
    elif kind == "all-gather":
        body = lambda x: jax.lax.all_gather(x, axis, tiled=True)     # noqa: E731
    elif kind == "reduce-scatter":
        body = lambda x: jax.lax.psum_scatter(x, axis, tiled=True)   # noqa: E731
    else:
        body = lambda x: jax.lax.all_to_all(x, axis, 0, 0, tiled=True)  # noqa: E731
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec,
                                 check_vma=False))


def measure_collective(kind: str, mesh, axis: str, nbytes: int, repeats: int) -> tuple[float,
                                                                                       float]:
    """(bytes of the full tensor the cost model prices, seconds) of one collective over `axis`.

    The cost model prices an all-gather / all-to-all / reduce-scatter by the full tensor and an
    all-reduce by the tensor each device holds; the local block here is sized so that this
    number is about `nbytes`."""
    n = mesh.shape[axis]
    total = mesh.devices.size
    cols = 128
    if kind == "all-reduce":
        rows = max(1, nbytes // (4 * cols))                # per device
    elif kind == "all-gather":
        rows = max(1, nbytes // (4 * cols * n))            # the gathered result is n x local
    else:
        rows = max(n, (nbytes // (4 * cols)) // n * n)     # divisible by n for the split
    x = jax.device_put(jnp.ones((rows * total, cols), jnp.float32),
                       NamedSharding(mesh, P(tuple(mesh.axis_names))))
    seconds = median_time(_collective_fn(kind, mesh, axis), x, repeats=repeats)
    local = rows * cols * 4
    priced = local if kind == "all-reduce" else (local * n if kind == "all-gather" else local)
    return float(priced), seconds


def profile(mesh: jax.sharding.Mesh, *, sizes: Sequence[int] = DEFAULT_SIZES,
            dtypes: Sequence[str] = ("float32", "bfloat16"), matmul_size: int = 1024,
            memory_size: int | None = None, repeats: int = 5, cache_dir: str | None = None,
            refresh: bool = False, use_cache: bool = True) -> DeviceProfile:
    """Measure `mesh` (or read its cached profile); see the module docstring.

    Args:
      sizes: collective sizes in bytes (at least 2; each axis is fitted over all of them).
      dtypes: matmul dtypes to measure.
      matmul_size: n of the n x n x n matmul.
      memory_size: bytes per device of the elementwise kernel's operand (bandwidth); default
        16 MiB on CPU, 256 MiB on accelerators (large enough to hide the launch).
      repeats: timed calls per measurement (median; one warm-up call first).
      cache_dir: where profiles live (default `cost.profiler.default_cache_dir()`).
      refresh: measure even if a cached profile exists (and replace it).
      use_cache: False neither reads nor writes the cache.
    """
    if not isinstance(mesh, jax.sharding.Mesh):
        raise InvalidArgumentError(f"profile: mesh={mesh!r} is not a jax.sharding.Mesh. Fix: "
                                   "jax.make_mesh((2, 4), ('data', 'model')).")
    if len(sizes) < 2 or any(int(s) <= 0 for s in sizes):
        raise InvalidArgumentError(f"profile: sizes={tuple(sizes)!r} needs 2 or more positive "
                                   "byte counts (a line needs two points).")
    first = mesh.devices.flat[0]
    kind, shape = str(first.device_kind), tuple(int(n) for n in mesh.devices.shape)
    path = cache_path(cache_dir or default_cache_dir(), kind, shape)
    if use_cache and not refresh and os.path.exists(path):
        try:
            cached = DeviceProfile.load(path)
            cached.check_matches(kind, shape, f"cached profile {path!r}")
            log.info("autopar: using the cached profile %s", path)
            return cached
        except ProfileError as e:
            log.warning("autopar: ignoring the cached profile (%s); measuring again", e)
    t0 = time.perf_counter()
    log.info("autopar: profiling %s x %s (matmul, then %d collectives per axis)", kind, shape,
             len(COLLECTIVES) * len(sizes))
    flops = {d: measure_matmul(mesh, d, matmul_size, repeats) for d in dtypes}
    overhead = measure_call_overhead(mesh, repeats)
    if memory_size is None:
        memory_size = 1 << 24 if first.platform == "cpu" else 1 << 28
    bandwidth = measure_memory_bandwidth(mesh, memory_size, repeats)
    axes = []
    for axis, n in zip(mesh.axis_names, shape):
        if n == 1:       # no link to measure: the fit of a 1-device axis is never used
            axes.append(AxisProfile(name=str(axis), size=1, samples={}, alpha_s=1e-15,
                                    beta_s_per_byte=1e-15))
            continue
        samples = {k: tuple(measure_collective(k, mesh, axis, int(s), repeats) for s in sizes)
                   for k in COLLECTIVES}
        alpha, beta = fit_link(samples, n)
        axes.append(AxisProfile(name=str(axis), size=n, samples=samples, alpha_s=alpha,
                                beta_s_per_byte=beta))
    prof = DeviceProfile(
        platform=str(first.platform), device_kind=kind, mesh_shape=shape,
        num_hosts=len({d.process_index for d in mesh.devices.flat}),
        matmul_flops_per_s=flops, axes=tuple(axes), call_overhead_s=overhead,
        memory_bytes_per_s=bandwidth,
        jax_version=jax.__version__,
        created_utc=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        extra={"sizes": [int(s) for s in sizes], "repeats": repeats,
               "matmul_size": matmul_size, "memory_size": memory_size,
               "seconds": time.perf_counter() - t0})
    prof.check()
    if use_cache:
        prof.save(path)
        log.info("autopar: profile saved to %s (%.1f s)", path, time.perf_counter() - t0)
    return prof


__all__ = ["profile", "measure_matmul", "measure_memory_bandwidth", "measure_call_overhead",
           "measure_collective", "median_time", "DEFAULT_SIZES"]
