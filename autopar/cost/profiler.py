"""Measured device profiles: the numbers `autopar.profile(mesh)` measures, fitted to the cost
model and stored as versioned JSON, so a later run reuses them and `ClusterSpec.from_profile`
plans with them.

A profile holds, for one device kind and one mesh shape: matmul throughput per dtype, and per
mesh axis the measured times of all-reduce / all-gather / reduce-scatter / all-to-all over a
range of sizes, with the link latency (alpha) and inverse bandwidth (beta) fitted so that the
cost model's ring formulas (`cost.py`) reproduce them. Pure Python: measuring lives in
`measure.py`.

Example:
    >>> p = autopar.profile(mesh)                        # measured, or read from the cache
    >>> cluster = autopar.ClusterSpec.from_profile(p)
    >>> p.save("v100-2x4.json"); again = DeviceProfile.load("v100-2x4.json")
"""
from __future__ import annotations

import json
import math
import os
import re
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from autopar.core.errors import ProfileError

FORMAT = "autopar-profile"
VERSION = 3     # 2: call_overhead_s; matmul flop/s with every device of the mesh busy
                # 3: memory_bytes_per_s (a fused elementwise kernel, every device busy)
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all")


def ring_coefficients(kind: str, n: int) -> tuple[float, float]:
    """(steps, volume factor) of the cost model's ring algorithm: time = steps * alpha +
    factor * bytes * beta for a collective over n devices (`bytes`: the full tensor)."""
    if kind == "all-reduce":
        return 2.0 * (n - 1), 2.0 * (n - 1) / n
    if kind in ("all-gather", "reduce-scatter", "all-to-all"):
        return float(n - 1), (n - 1) / n
    raise ProfileError(f"unknown collective {kind!r}; known: {', '.join(COLLECTIVES)}.")


@dataclass(frozen=True, slots=True, kw_only=True)
class AxisProfile:
    """One mesh axis: samples[kind] = ((bytes, seconds), ...) and the fitted link numbers."""
    name: str
    size: int
    samples: dict[str, tuple[tuple[float, float], ...]]
    alpha_s: float
    beta_s_per_byte: float


def fit_link(samples: dict[str, Sequence[tuple[float, float]]], n: int) -> tuple[float, float]:
    """Least-squares (alpha, beta) of one axis of n devices from every collective's samples,
    through the cost model's ring formulas; both kept positive (a fit that would make one
    negative is redone with it pinned near 0).

    Example (an 8-device ring, alpha 1 us, beta 1 ns/byte):
        >>> t = lambda nbytes: 7 * 1e-6 + 7 / 8 * nbytes * 1e-9
        >>> fit_link({"all-gather": [(1e6, t(1e6)), (2e6, t(2e6))]}, 8)   # ~ (1e-06, 1e-09)
    """
    rows, times = [], []
    for kind, pts in samples.items():
        steps, factor = ring_coefficients(kind, n)
        for nbytes, seconds in pts:
            rows.append((steps, factor * nbytes))
            times.append(seconds)
    if len(rows) < 2:
        raise ProfileError(f"fit_link needs at least 2 samples, got {len(rows)}; measure more "
                           "sizes.")
    a, t = np.asarray(rows, dtype=float), np.asarray(times, dtype=float)
    (alpha, beta), *_ = np.linalg.lstsq(a, t, rcond=None)
    tiny = 1e-15
    if beta <= 0:           # sizes too small to see bandwidth: latency only
        alpha, beta = max(float(t @ a[:, 0] / (a[:, 0] @ a[:, 0])), tiny), tiny
    elif alpha <= 0:        # latency below the noise: bandwidth only
        alpha, beta = tiny, max(float(t @ a[:, 1] / (a[:, 1] @ a[:, 1])), tiny)
    return float(alpha), float(beta)


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceProfile:
    """What `autopar.profile(mesh)` measured (see the module docstring)."""
    platform: str
    device_kind: str
    mesh_shape: tuple[int, ...]
    num_hosts: int
    matmul_flops_per_s: dict[str, float]            # dtype name -> achieved flop/s per device
    axes: tuple[AxisProfile, ...]
    call_overhead_s: float = 0.0                    # one trivial call on the whole mesh
    memory_bytes_per_s: float = 0.0                 # bytes/s per device a fused elementwise
                                                    # kernel moves, every device busy (0: not
                                                    # measured)
    jax_version: str = ""
    created_utc: str = ""
    version: int = VERSION
    extra: dict = field(default_factory=dict)

    # -- JSON ----------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps({
            "format": FORMAT, "version": self.version, "platform": self.platform,
            "device_kind": self.device_kind, "mesh_shape": list(self.mesh_shape),
            "num_hosts": self.num_hosts, "jax_version": self.jax_version,
            "created_utc": self.created_utc, "matmul_flops_per_s": self.matmul_flops_per_s,
            "call_overhead_s": self.call_overhead_s,
            "memory_bytes_per_s": self.memory_bytes_per_s,
            "axes": [{"name": a.name, "size": a.size, "alpha_s": a.alpha_s,
                      "beta_s_per_byte": a.beta_s_per_byte,
                      "samples": {k: [list(p) for p in v] for k, v in a.samples.items()}}
                     for a in self.axes],
            "extra": self.extra}, indent=1)

    @classmethod
    def from_json(cls, text: str, *, where: str = "profile") -> DeviceProfile:
        """Parse and check a profile; a corrupt, foreign or other-version one raises
        `ProfileError` saying which."""
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ProfileError(f"{where} is not valid JSON ({e}). Fix: delete it; autopar."
                               "profile(mesh) measures again.") from None
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ProfileError(f"{where} is not an autopar profile (format "
                               f"{d.get('format') if isinstance(d, dict) else None!r}, expected "
                               f"{FORMAT!r}). Fix: point at a file autopar.profile wrote.")
        if d.get("version") != VERSION:
            raise ProfileError(
                f"{where} has profile version {d.get('version')!r}; this autopar reads version "
                f"{VERSION}. Fix: measure again with autopar.profile(mesh, refresh=True).")
        try:
            axes = tuple(AxisProfile(
                name=str(a["name"]), size=int(a["size"]), alpha_s=float(a["alpha_s"]),
                beta_s_per_byte=float(a["beta_s_per_byte"]),
                samples={str(k): tuple((float(b), float(s)) for b, s in v)
                         for k, v in a["samples"].items()}) for a in d["axes"])
            prof = cls(platform=str(d["platform"]), device_kind=str(d["device_kind"]),
                       mesh_shape=tuple(int(x) for x in d["mesh_shape"]),
                       num_hosts=int(d["num_hosts"]),
                       matmul_flops_per_s={str(k): float(v)
                                           for k, v in d["matmul_flops_per_s"].items()},
                       axes=axes, call_overhead_s=float(d["call_overhead_s"]),
                       memory_bytes_per_s=float(d["memory_bytes_per_s"]),
                       jax_version=str(d.get("jax_version", "")),
                       created_utc=str(d.get("created_utc", "")), extra=dict(d.get("extra", {})))
        except (KeyError, TypeError, ValueError) as e:
            raise ProfileError(f"{where} is missing or has a malformed field ({type(e).__name__}: "
                               f"{e}). Fix: delete it and measure again.") from None
        prof.check()
        return prof

    def check(self) -> None:
        """Every number positive and finite, one axis per mesh dimension."""
        bad = [f"matmul_flops_per_s[{k}]={v}" for k, v in self.matmul_flops_per_s.items()
               if not (math.isfinite(v) and v > 0)]
        bad += [f"axis {a.name}: alpha_s={a.alpha_s}, beta_s_per_byte={a.beta_s_per_byte}"
                for a in self.axes if not (math.isfinite(a.alpha_s) and a.alpha_s > 0
                                           and math.isfinite(a.beta_s_per_byte)
                                           and a.beta_s_per_byte > 0)]
        if not (math.isfinite(self.call_overhead_s) and self.call_overhead_s >= 0):
            bad.append(f"call_overhead_s={self.call_overhead_s}")
        if not (math.isfinite(self.memory_bytes_per_s) and self.memory_bytes_per_s >= 0):
            bad.append(f"memory_bytes_per_s={self.memory_bytes_per_s}")
        if tuple(a.size for a in self.axes) != tuple(self.mesh_shape):
            bad.append(f"axis sizes {[a.size for a in self.axes]} vs mesh {self.mesh_shape}")
        if not self.matmul_flops_per_s:
            bad.append("no matmul throughput")
        if bad:
            raise ProfileError("profile has invalid numbers: " + "; ".join(bad) + ". Fix: "
                               "measure again with autopar.profile(mesh, refresh=True).")

    def check_matches(self, device_kind: str, mesh_shape: Sequence[int], where: str) -> None:
        if self.device_kind != device_kind or tuple(self.mesh_shape) != tuple(mesh_shape):
            raise ProfileError(
                f"{where} was measured on {self.device_kind!r} with mesh {self.mesh_shape}, not "
                f"{device_kind!r} with mesh {tuple(mesh_shape)}. Fix: profile this mesh "
                "(autopar.profile(mesh)) or load the matching file.")

    # -- files ---------------------------------------------------------------------------
    def save(self, path: str) -> None:
        """Write atomically (a crash leaves the old file or the new one, never half)."""
        folder = os.path.dirname(os.path.abspath(path))
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".profile-", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(self.to_json())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    @classmethod
    def load(cls, path: str) -> DeviceProfile:
        try:
            with open(path) as f:
                text = f.read()
        except OSError as e:
            raise ProfileError(f"cannot read profile {path!r}: {e}.") from None
        return cls.from_json(text, where=f"profile {path!r}")


def cache_path(cache_dir: str, device_kind: str, mesh_shape: Sequence[int]) -> str:
    """Where the profile of this device kind and mesh lives in `cache_dir`."""
    kind = re.sub(r"[^A-Za-z0-9._-]+", "_", device_kind).strip("_") or "device"
    return os.path.join(cache_dir, f"{kind}-{'x'.join(map(str, mesh_shape))}-v{VERSION}.json")


def default_cache_dir() -> str:
    """$AUTOPAR_CACHE_DIR, else $XDG_CACHE_HOME/autopar, else ~/.cache/autopar."""
    if os.environ.get("AUTOPAR_CACHE_DIR"):
        return os.environ["AUTOPAR_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "autopar", "profiles")
