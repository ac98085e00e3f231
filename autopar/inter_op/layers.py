"""Automatic layer construction (Alpa §5.1): cut the forward graph into L layers.

Nodes are taken in their traced (topological) order. A cut between node c-1 and node c costs
the bytes of every tensor made before c and read at or after c (what a pipeline would send
across that boundary). `cluster_layers` chooses L - 1 cuts that minimize the total bytes cut,
subject to every layer's FLOPs staying within a factor `(1 + imbalance)` of the mean, above
and below; among equal cuts it prefers the better-balanced plan. The lower bound matters when
one operator (a language model's head) is heavier than the mean: the upper bound must then be
relaxed, and without a floor the cheapest cuts would isolate operators with no work, giving
layers (and, later, pipeline stages) that only hold devices. Pure numpy: tested without JAX.

Example:
    >>> flops = np.array([1, 1, 1, 1.0]); cut = np.array([0, 5, 1, 5, 0.0])
    >>> cluster_layers(flops, cut, 2).boundaries
    (0, 2, 4)
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from autopar.core.errors import InvalidArgumentError


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerClustering:
    boundaries: tuple[int, ...]     # node index where each layer starts, plus the end: len L + 1
    layer_flops: tuple[float, ...]
    cut_bytes: float                # total bytes crossing the L - 1 inner boundaries
    max_imbalance: float            # max layer FLOPs / mean layer FLOPs - 1

    @property
    def num_layers(self) -> int:
        return len(self.boundaries) - 1


def cut_bytes_from_liveness(defined_at: Sequence[int], last_used_at: Sequence[int],
                            nbytes: Sequence[float], num_nodes: int) -> np.ndarray:
    """Bytes crossing each of the num_nodes + 1 cut positions: tensor t (made by node
    `defined_at[t]`, -1 for graph inputs, read last by node `last_used_at[t]`) crosses cut c
    when defined_at[t] < c <= last_used_at[t]. Graph inputs (parameters) are excluded: every
    stage holds its own."""
    diff = np.zeros(num_nodes + 2)
    for d, u, b in zip(defined_at, last_used_at, nbytes):
        if d < 0 or u <= d:
            continue
        diff[d + 1] += b
        diff[min(u, num_nodes) + 1] -= b
    return np.cumsum(diff)[: num_nodes + 1]


def cluster_layers(node_flops: np.ndarray, cut_bytes: np.ndarray, num_layers: int, *,
                   imbalance: float = 0.25) -> LayerClustering:
    """Choose `num_layers` contiguous layers over the nodes (see the module docstring).

    Args:
      node_flops: FLOPs per node, length N.
      cut_bytes: bytes crossing cut position c for c = 0..N (0 and N are the ends).
      num_layers: L, 1 <= L <= N.
      imbalance: each layer's FLOPs must stay within [mean / (1 + imbalance),
        (1 + imbalance) * mean], mean = total / L. If no cut meets the upper bound it is
        relaxed step by step (doubling the slack) until one does; then the floor is relaxed
        the same way, down to "at least one operator with FLOPs", and dropped only if even
        that admits no plan (more layers than operators with work).
    """
    flops = np.asarray(node_flops, dtype=float)
    cuts = np.asarray(cut_bytes, dtype=float)
    n = flops.size
    if not isinstance(num_layers, int) or not 1 <= num_layers <= max(n, 1):
        raise InvalidArgumentError(
            f"num_layers={num_layers!r} must be an int in [1, {n}] (the number of forward "
            f"operators). Fix: ask for fewer layers.")
    if cuts.shape != (n + 1,):
        raise InvalidArgumentError(
            f"cut_bytes has shape {cuts.shape}; it needs one entry per cut position, "
            f"({n + 1},) for {n} nodes.")
    if imbalance < 0:
        raise InvalidArgumentError(f"imbalance={imbalance!r} must be >= 0.")
    if (flops < 0).any() or np.isnan(flops).any():
        raise InvalidArgumentError(
            f"node_flops has an entry {float(np.nanmin(flops))!r} (or NaN): FLOPs must be >= 0.")
    prefix = np.concatenate([[0.0], np.cumsum(flops)])
    total = prefix[-1]
    mean = total / num_layers
    if total <= 0:
        result = _solve(prefix, cuts, num_layers, 0.0, np.inf)
    else:
        slack = imbalance
        while (result := _solve(prefix, cuts, num_layers, 0.0, (1 + slack) * mean)) is None:
            if (1 + slack) * mean > total:     # no bound left to relax: never loop on
                raise AssertionError(f"no {num_layers} layers of {n} operators without "
                                     "FLOPs bounds (a bug in the layer DP)")
            slack = _relax(slack)
        upper = (1 + slack) * mean
        smallest = float(flops[flops > 0].min())
        low_slack = imbalance
        while True:      # the highest floor that still admits a plan; 0 (no floor) last
            floor = mean / (1 + low_slack)
            floored = _solve(prefix, cuts, num_layers, floor, upper)
            if floored is not None or floor < smallest:
                break
            low_slack = _relax(low_slack)
        result = floored if floored is not None else result
    bounds = tuple(int(b) for b in result)
    layer_flops = tuple(float(prefix[b] - prefix[a]) for a, b in zip(bounds, bounds[1:]))
    return LayerClustering(
        boundaries=bounds, layer_flops=layer_flops,
        cut_bytes=float(sum(cuts[b] for b in bounds[1:-1])),
        max_imbalance=float(max(layer_flops) / mean - 1) if mean > 0 else 0.0)


def _relax(slack: float) -> float:
    return max(2 * slack, 0.05)


def _solve(prefix: np.ndarray, cuts: np.ndarray, num_layers: int, floor: float,
           limit: float):
    """DP over (layers placed, end node): min (cut bytes, max layer FLOPs) with every layer
    non-empty and its FLOPs in [floor, limit]. Returns the boundaries or None."""
    n = prefix.size - 1
    inf = np.inf
    # best[k][e]: (bytes, peak) of the best k layers covering nodes [0, e)
    best_bytes = np.full((num_layers + 1, n + 1), inf)
    best_peak = np.full((num_layers + 1, n + 1), inf)
    parent = np.full((num_layers + 1, n + 1), -1, dtype=np.int64)
    best_bytes[0, 0] = 0.0
    best_peak[0, 0] = 0.0
    # FLOPs are >= 0, so the starts whose layer fits [floor, limit] are one window of
    # `prefix`: searched with a margin, then tested exactly (each DP step reads the window,
    # not every start before it)
    lo_at = np.searchsorted(prefix, prefix - limit * (1 + 1e-9) - 1e-9 * abs(prefix), "left")
    hi_at = np.searchsorted(prefix, prefix - floor * (1 - 1e-9) + 1e-9 * abs(prefix), "right")
    for k in range(1, num_layers + 1):
        for e in range(k, n - (num_layers - k) + 1):
            starts = np.arange(max(k - 1, int(lo_at[e])), min(e, int(hi_at[e])))
            seg = prefix[e] - prefix[starts]
            ok = ((seg <= limit * (1 + 1e-12)) & (seg >= floor * (1 - 1e-12))
                  & np.isfinite(best_bytes[k - 1, starts]))
            if not ok.any():
                continue
            cost = np.where(ok, best_bytes[k - 1, starts] + (
                cuts[e] if k < num_layers else 0.0), inf)
            peak = np.maximum(best_peak[k - 1, starts], seg)
            # fewest bytes, then the lowest peak, then the first start
            s = int(np.argmin(np.where(cost == cost.min(), peak, inf)))
            if np.isfinite(cost[s]):
                best_bytes[k, e], best_peak[k, e], parent[k, e] = cost[s], peak[s], starts[s]
    if not np.isfinite(best_bytes[num_layers, n]):
        return None
    bounds = [n]
    for k in range(num_layers, 0, -1):
        bounds.append(int(parent[k, bounds[-1]]))
    return bounds[::-1]
