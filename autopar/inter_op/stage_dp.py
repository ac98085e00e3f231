"""Alpa's stage / submesh DP (§5.2) as a pure function over cost arrays.

Given L layers, K candidate submesh shapes and, for every contiguous layer span i..j and submesh k,
the microbatch latency and per-device memory of that stage, choose contiguous spans covering the
layers in order and one submesh per span so that the submeshes' device counts sum exactly to the
cluster's, every stage fits memory under 1F1B (the stage at position p of S keeps S - p
microbatches in flight), and the pipeline latency

    T = sum_i t_i + (B - 1) * max_i t_i

is minimal. The DP enumerates t_max over the distinct latencies in increasing order, minimizes
sum_i t_i subject to t_i <= t_max, and stops once (B - 1) * t_max plus a lower bound on the sum
(max(t_max, the uncapped least sum)) reaches the best T found: every plan not yet seen has its
slowest stage at >= t_max, so none can do better. This bound is at least as tight as Alpa's
(B - 1) * t_max >= T*.

Other schedules (`kept`, `bubble`): T = B * t_max + b * (sum_i t_i - t_max) prices a schedule
whose warm-up and cool-down leave b of 1F1B's bubble (1F1B: b = 1, the formula above; the
zero-bubble ones fill it with weight gradients: b < 1), and each stage's memory is its static
bytes plus the worst of the (in flight, deferred) states the schedule's table passes through
at its position (a deferred microbatch keeps `weight_bytes`: what W reads). Such counts may
depend on the stage count S and on a stage's position from the start (ZB-H1 defers p + 1
weight gradients at stage p), so the DP then runs once per S.

The DP sees an option only through its device count, latency and memory, so its tables run
over device counts with the least latency per count (the search's options per submesh, view,
rematerialization and ZeRO mostly share device counts), and the t_max values that admit no
plan at all (a prefix of them) are skipped by bisection; the chosen options and ties are the
same as over every option in order.

Run once per stage count, the DP first bounds every count from below (the least sum and
slowest stage of S stages, memory aside or under 1F1B's memory) and skips the counts that
cannot beat the best so far before building their memory tables; a caller with a price in
hand (`incumbent`, `t_max_below`) gets only what beats it, or None (Wide-ResNet 13B, 32
layers on 64 GPUs: ZB-H1's and ZB-H2's DPs, 3.6 s, now skip every count).
"""
from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from autopar.core.errors import InfeasiblePlanError, InvalidArgumentError
from autopar.inter_op.dp_memory import keeps_more, memory_tables, states_of

__all__ = ["SubmeshShape", "candidate_submeshes", "StageCosts", "StageAssignment",
           "solve_stage_dp", "pipeline_time"]


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise InvalidArgumentError(f"{name}={value!r} is invalid: pass an int >= {minimum}.")
    return int(value)


@dataclass(frozen=True, slots=True, kw_only=True)
class SubmeshShape:
    """A submesh of `num_hosts` hosts x `devices_per_host` devices on each."""
    num_hosts: int
    devices_per_host: int

    def __post_init__(self):
        _check_int("SubmeshShape.num_hosts", self.num_hosts, 1)
        _check_int("SubmeshShape.devices_per_host", self.devices_per_host, 1)

    @property
    def num_devices(self) -> int:
        """Devices in the submesh."""
        return self.num_hosts * self.devices_per_host


def candidate_submeshes(num_hosts: int, devices_per_host: int) -> tuple[SubmeshShape, ...]:
    """Alpa's submesh set: (1, 2^k) for 2^k <= devices_per_host, then (n, devices_per_host) for
    n = 1..num_hosts ((1, devices_per_host) appears once; it is only new when devices_per_host is
    not a power of two). Sorted by device count."""
    num_hosts = _check_int("num_hosts", num_hosts, 1)
    devices_per_host = _check_int("devices_per_host", devices_per_host, 1)
    shapes = []
    size = 1
    while size <= devices_per_host:
        shapes.append(SubmeshShape(num_hosts=1, devices_per_host=size))
        size *= 2
    for n in range(1, num_hosts + 1):
        shape = SubmeshShape(num_hosts=n, devices_per_host=devices_per_host)
        if shape not in shapes:
            shapes.append(shape)
    return tuple(shapes)


def _as_cost_array(name: str, value) -> np.ndarray:
    arr = np.array(value, dtype=np.float64)
    arr.setflags(write=False)
    if arr.ndim != 3 or arr.shape[0] != arr.shape[1] or arr.shape[0] < 1 or arr.shape[2] < 1:
        raise InvalidArgumentError(
            f"StageCosts.{name} has shape {arr.shape}: pass an array of shape [L, L, K] "
            "(first layer, last layer, submesh) with L >= 1 and K >= 1.")
    if np.isnan(arr).any():
        raise InvalidArgumentError(f"StageCosts.{name} contains NaN: use np.inf for impossible "
                                   "stages and finite values otherwise.")
    if (arr < 0).any():
        raise InvalidArgumentError(f"StageCosts.{name} has negative entries (min {arr.min()}): "
                                   "costs must be >= 0.")
    return arr


@dataclass(frozen=True, slots=True, kw_only=True)
class StageCosts:
    """Per-stage costs, indexed [first layer i, last layer j (i <= j), submesh k].

    Entries with i > j are ignored. `latency_s` is the latency of one microbatch (forward +
    backward) of the stage, np.inf where the stage cannot run on that submesh; the byte arrays are
    per device and must be finite wherever the latency is.
    """
    latency_s: np.ndarray         # [L, L, K]
    static_bytes: np.ndarray      # [L, L, K]: params, optimizer state, grads
    activation_bytes: np.ndarray  # [L, L, K]: bytes kept per in-flight microbatch
    memory_budget_bytes: float    # per device
    # [L, L, K]: bytes kept per microbatch between its B and its W (a split backward), or None
    weight_bytes: np.ndarray | None = None

    def __post_init__(self):
        arrays = {}
        if self.weight_bytes is None:
            object.__setattr__(self, "weight_bytes", np.zeros_like(
                np.asarray(self.activation_bytes, dtype=np.float64)))
        for name in ("latency_s", "static_bytes", "activation_bytes", "weight_bytes"):
            arrays[name] = _as_cost_array(name, getattr(self, name))
            object.__setattr__(self, name, arrays[name])
        shapes = {name: arr.shape for name, arr in arrays.items()}
        if len(set(shapes.values())) != 1:
            raise InvalidArgumentError(f"StageCosts arrays disagree in shape {shapes}: all of "
                                       "them must be [L, L, K] for the same L and K.")
        usable = np.isfinite(self.latency_s)
        for name in ("static_bytes", "activation_bytes", "weight_bytes"):
            if not np.isfinite(arrays[name][usable]).all():
                raise InvalidArgumentError(f"StageCosts.{name} is infinite where latency_s is "
                                           "finite: give finite bytes, or latency np.inf.")
        budget = self.memory_budget_bytes
        if isinstance(budget, bool) or not isinstance(budget, (int, float, np.number)) \
                or not budget > 0:
            raise InvalidArgumentError(f"StageCosts.memory_budget_bytes={budget!r} is invalid: "
                                       "pass a number > 0 (np.inf for no limit).")

    @property
    def num_layers(self) -> int:
        """L."""
        return self.latency_s.shape[0]


@dataclass(frozen=True, slots=True, kw_only=True)
class StageAssignment:
    """The chosen pipeline: stages in order, their submeshes and predicted latencies."""
    layer_spans: tuple[tuple[int, int], ...]  # (first, last) layer per stage, covering 0..L-1
    submeshes: tuple[int, ...]                # index into the submesh list, per stage
    stage_latency_s: tuple[float, ...]
    total_latency_s: float                    # sum(t_i) + (B - 1) * max(t_i) (`pipeline_time`)
    num_candidates: int                       # t_max values tried
    num_pruned: int                           # t_max values skipped by the bound
    search_time_s: float

    @property
    def num_stages(self) -> int:
        """S."""
        return len(self.layer_spans)


def _validate(costs, submeshes, num_devices, num_microbatches, max_stages):
    if not isinstance(costs, StageCosts):
        raise InvalidArgumentError(f"costs is a {type(costs).__name__}: pass a StageCosts.")
    submeshes = tuple(submeshes)
    if not submeshes or not all(isinstance(s, SubmeshShape) for s in submeshes):
        raise InvalidArgumentError(f"submeshes={submeshes!r} is invalid: pass a non-empty "
                                   "sequence of SubmeshShape (see candidate_submeshes).")
    k = costs.latency_s.shape[2]
    if k != len(submeshes):
        raise InvalidArgumentError(f"the cost arrays have K={k} submesh columns but "
                                   f"{len(submeshes)} submeshes were given: they must match.")
    num_devices = _check_int("num_devices", num_devices, 1)
    num_microbatches = _check_int("num_microbatches", num_microbatches, 1)
    limit = min(costs.num_layers, num_devices)
    if max_stages is not None:
        limit = min(limit, _check_int("max_stages", max_stages, 1))
    sizes = np.array([s.num_devices for s in submeshes], dtype=np.int64)
    return sizes, num_devices, num_microbatches, limit


def _by_size(values: np.ndarray, sizes: np.ndarray):
    """(values [..., G], counts [G]): per distinct device count, the least of `values` [..., K]
    over the options of that many devices. The DP sees an option only through its device count
    and its value, so an option with a larger value than another of the same count never wins
    (a dominated option: slower, or not leaner); and capping commutes with the least (the
    least of the values <= t is the least if it is <= t, else none)."""
    counts = np.unique(sizes)
    if len(counts) == len(sizes):
        order = np.argsort(sizes, kind="stable")
        return values[..., order], sizes[order]
    return np.stack([values[..., sizes == c].min(axis=-1) for c in counts], axis=-1), counts


def _shift(table: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """[L, K, D + 1]: shifted[j, k, d] = table[j + 1, d - sizes[k]] (np.inf where d < size)."""
    width = table.shape[1]
    shifted = np.full((table.shape[0] - 1, len(sizes), width), np.inf)
    for idx, size in enumerate(sizes):
        if size < width:
            shifted[:, idx, size:] = table[1:, :width - size]
    return shifted


def _capped(values: np.ndarray, cap: float) -> np.ndarray:
    return values if cap == np.inf else np.where(values <= cap, values, np.inf)


def _run_dp(values_per_q, sizes: np.ndarray, num_devices: int,
            combine: Callable[[np.ndarray, np.ndarray], np.ndarray], cap: float = np.inf,
            grouped=None, exact: bool = False, per_count: list | None = None):
    """DP over stages counted from the end: table_q[l, d] = best value of q stages covering layers
    l..L-1 on exactly d devices = min over (j, k) of combine(values_per_q[q - 1][l, j, k],
    table_{q-1}[j + 1, d - sizes[k]]), counting only values <= `cap`. Returns (best over q of
    table_q[0, D], the chosen (first, last, submesh) per stage in order), or (inf, None).

    The tables are built over device counts (`_by_size`; `grouped` is its result for
    `values_per_q`, when the caller has it): the same minima, as `combine` is monotone. The
    walk back re-derives each choice over all K options, so ties break as over the options.
    `exact`: only assignments of exactly len(values_per_q) stages. `per_count` (a list): gets
    table_q[0, D] of every q, the best value of exactly q stages."""
    num_layers, k = values_per_q[0].shape[0], values_per_q[0].shape[2]
    gvalues, gsizes = grouped if grouped is not None else _by_size(np.stack(values_per_q),
                                                                   sizes)
    table = np.full((num_layers + 1, num_devices + 1), np.inf)
    table[num_layers, 0] = 0.0
    tables, best, best_q = [], np.inf, 0
    for q in range(len(values_per_q)):
        tables.append(table)
        shifted = _shift(table, gsizes)
        n = num_layers - q        # the q stages behind this one need >= q layers: l <= j < n
        vals = _capped(gvalues[q][:n, :n], cap)
        cand = combine(vals[..., None], shifted[None, :n])  # [n, n, G, D + 1]
        table = np.full_like(table, np.inf)
        table[:n] = cand.reshape(n, n * len(gsizes), -1).min(axis=1)
        if per_count is not None:
            per_count.append(table[0, num_devices])
        if table[0, num_devices] < best and (not exact or q + 1 == len(values_per_q)):
            best, best_q = table[0, num_devices], q + 1
    if not np.isfinite(best):
        return np.inf, None
    stages, layer, devices = [], 0, num_devices      # walk back, re-deriving each choice
    for q in range(best_q, 0, -1):
        prev = tables[q - 1]
        after = np.full((num_layers, k), np.inf)     # table_{q-1}[j + 1, devices - sizes[k]]
        fits = sizes <= devices
        after[:, fits] = prev[1:, devices - sizes[fits]]
        row = combine(_capped(values_per_q[q - 1][layer], cap), after)
        last, sub = divmod(int(np.argmin(row)), k)
        stages.append((layer, last, sub))
        devices -= int(sizes[sub])
        layer = last + 1
    assert layer == num_layers and devices == 0, (layer, devices)
    return best, stages


def _min_memory(memories, sizes, num_devices, free=None) -> float:
    """Smallest max-over-stages per-device memory of any covering assignment with finite
    latencies (np.inf if none exists); `free` (`_count_bounds` memory aside): the counts with
    no covering at all are not searched."""
    return float(min((_run_dp(mem(), sizes, num_devices, np.maximum, exact=s is not None)[0]
                      for s, mem in memories
                      if free is None or s is None or np.isfinite(free[s - 1][0])),
                     default=np.inf))


def _count_bounds(values, sizes: np.ndarray, num_devices: int, grouped=None) -> list:
    """Per stage count S = 1..len(values): (the least sum, the least slowest stage) of S
    stages over `values` (per position from the end: each span's latency where it may run),
    np.inf where no S stages cover the layers on exactly `num_devices` devices. Two DPs bound
    every count from below before its memory table is built."""
    sums: list = []
    maxes: list = []
    _run_dp(values, sizes, num_devices, np.add, grouped=grouped, per_count=sums)
    _run_dp(values, sizes, num_devices, np.maximum, grouped=grouped, per_count=maxes)
    return list(zip(sums, maxes))


def _one_f_one_b_bounds(costs, sizes, num_devices: int, max_q: int, usable: dict) -> list:
    """`_count_bounds` over the assignments whose every stage fits 1F1B's in-flight
    microbatches: bounds for a schedule that keeps at least as many at every stage
    (`dp_memory.keeps_more`), which rule out the stage counts 1F1B's memory already does
    (Wide-ResNet 13B: 12 of ZB-H1's 32)."""
    fit, grouped = _fitting(costs, memory_tables(costs, max_q, None)[0][1](), sizes, usable)
    return _count_bounds(fit, sizes, num_devices, grouped)


def _raise_infeasible(needed: float, costs, sizes, num_devices, max_q):
    """Raise the error for `needed` = the smallest per-device peak of any assignment."""
    if not np.isfinite(needed):
        raise InvalidArgumentError(
            f"no stage assignment covers num_devices={num_devices} with the submesh sizes "
            f"{sizes.tolist()} using at most {max_q} stage(s) of finite latency: change "
            "num_devices, the submeshes, max_stages or the latencies.")
    budget = costs.memory_budget_bytes
    raise InfeasiblePlanError(
        f"no stage assignment fits memory_budget_bytes={budget:.6g} per device: the best needs "
        f"{needed:.6g} bytes (static + the microbatches the schedule keeps x their activations)"
        "; raise the budget, reduce memory (ZeRO, rematerialization) or allow more stages.",
        needed_bytes=math.ceil(needed), budget_bytes=budget)


def pipeline_time(times, num_microbatches: int, bubble: float = 1.0) -> float:
    """B * t_max + b * (sum t - t_max): Alpa's sum t + (B - 1) * t_max where b = 1.

        >>> pipeline_time([1.0, 2.0, 1.0], 4), pipeline_time([1.0, 2.0, 1.0], 4, bubble=0.5)
        (10.0, 9.0)
    """
    t_max = max(times)
    return num_microbatches * t_max + bubble * (sum(times) - t_max)


def _assignment(stages, latency, num_microbatches, bubble, num_candidates, num_pruned, start):
    times = tuple(float(latency[i, j, k]) for i, j, k in stages)
    return StageAssignment(
        layer_spans=tuple((i, j) for i, j, _ in stages),
        submeshes=tuple(k for _, _, k in stages),
        stage_latency_s=times,
        total_latency_s=pipeline_time(times, num_microbatches, bubble),
        num_candidates=num_candidates, num_pruned=num_pruned,
        search_time_s=time.perf_counter() - start)


def _check_bubble(bubble) -> float:
    if isinstance(bubble, bool) or not isinstance(bubble, (int, float, np.number)) \
            or not 0.0 <= bubble <= 1.0:
        raise InvalidArgumentError(f"bubble={bubble!r} is invalid: pass the fraction of "
                                   "1F1B's bubble the schedule leaves, a number in [0, 1].")
    return float(bubble)


def solve_stage_dp(costs: StageCosts, submeshes: Sequence[SubmeshShape], num_devices: int,
                   num_microbatches: int, *, max_stages: int | None = None,
                   kept: Callable[[int], Sequence] | None = None,
                   bubble: float | Callable[[int], float] = 1.0,
                   incumbent: float = np.inf,
                   t_max_below: float = np.inf) -> StageAssignment | None:
    """Alpa's inter-op DP: the stage assignment minimizing sum t_i + (B - 1) * max t_i, or
    with `bubble` = b, B * max t_i + b * (sum t_i - max t_i).

    Args:
      costs: stage latencies and memory, [L, L, K] with K == len(submeshes).
      submeshes: the candidate submesh shapes (see candidate_submeshes).
      num_devices: the device counts of the stages' submeshes must sum exactly to this.
      num_microbatches: B.
      max_stages: optional cap on the number of stages.
      kept: `kept(S)` gives, per stage of S (from the first), the (in flight, deferred)
        microbatch counts its schedule passes through (`PipelineSchedule.kept_states`); a
        stage must fit at the worst. Default: 1F1B's (S - p in flight at stage p).
      bubble: the fraction of 1F1B's bubble the schedule leaves, in [0, 1], or a function of
        the stage count giving it (the DP then runs once per stage count).
      incumbent: only an assignment faster than this is wanted (a price the caller already
        has): the stage counts and t_max caps that cannot beat it are not searched, and where
        none does (or none fits), None is returned instead of the error below.
      t_max_below: only an assignment whose slowest stage takes less than this is wanted
        (the best of those is returned; None where there is none, as for `incumbent`).

    Raises:
      InfeasiblePlanError: no assignment fits the memory budget (needed_bytes is the smallest
        per-device peak any assignment needs).
      InvalidArgumentError: bad shapes or arguments, or no assignment covers num_devices at all.
    """
    start = time.perf_counter()
    sizes, num_devices, num_microbatches, max_q = _validate(
        costs, submeshes, num_devices, num_microbatches, max_stages)
    if callable(bubble) and kept is None:      # a bubble per stage count: one DP per count
        kept = _one_f_one_b
    bubble_of = bubble if callable(bubble) else (lambda _: bubble)
    memories = memory_tables(costs, max_q, kept)        # each count's built when asked
    best = (float(incumbent), None, 0, 0, 1.0)
    usable: dict = {}          # a position's fitting latencies, per memory table: counts share
    # Per count, memory aside: its least sum and least slowest stage bound its T from below,
    # (B - b) max(t_max, sum / S) + b sum; a count that cannot beat the best so far, or has
    # no covering (a chunk search of 2G stages on 2G equal groups), or no stage layout under
    # `t_max_below`, is skipped before its memory table is built. Where the count's states
    # keep at least 1F1B's in flight, the bounds over the layouts fitting 1F1B's memory hold.
    free = _count_bounds(np.broadcast_to(costs.latency_s, (max_q, *costs.latency_s.shape)),
                         sizes, num_devices) if memories[0][0] is not None else None
    fitting_one = functools.cache(
        lambda: _one_f_one_b_bounds(costs, sizes, num_devices, max_q, usable))
    for count, memory in memories:
        if free is not None:
            low, slowest = free[count - 1]
            if np.isfinite(low) and keeps_more(states_of(kept, count)):
                low, slowest = fitting_one()[count - 1]
            if not np.isfinite(low) or slowest >= t_max_below:
                continue
        b = _check_bubble(bubble_of(count or 1))
        if free is not None and (num_microbatches - b) * max(slowest, low / count) + \
                b * low >= best[0]:
            continue
        found = _search(costs, memory(), sizes, num_devices, num_microbatches, b,
                        exact=count is not None, incumbent=best[0], usable=usable,
                        t_max_below=t_max_below)
        if found[1] is not None and found[0] < best[0]:
            best = (*found, b)
    if best[1] is None:
        if np.isfinite(incumbent) or np.isfinite(t_max_below):
            return None
        _raise_infeasible(_min_memory(memories, sizes, num_devices, free),
                          costs, sizes, num_devices, max_q)
    return _assignment(best[1], costs.latency_s, num_microbatches, best[4], best[2], best[3],
                       start)


def _one_f_one_b(num_stages: int) -> list:
    """1F1B's states: stage p of S keeps S - p microbatches in flight, defers none."""
    return [((num_stages - p, 0),) for p in range(num_stages)]


def _fitting(costs, memory, sizes, cache: dict):
    """(per position: the latencies whose memory fits the budget, np.inf elsewhere; the same
    per device count, `_by_size`'s), each memory table's computed once in `cache` (the stage
    counts of a schedule's DP share most of their positions' tables)."""
    for mem in memory:
        if id(mem) not in cache:        # the table is kept in the entry: its id stays its own
            fit = np.where(mem <= costs.memory_budget_bytes, costs.latency_s, np.inf)
            cache[id(mem)] = (mem, fit, *_by_size(fit, sizes))
    entries = [cache[id(mem)] for mem in memory]
    return [e[1] for e in entries], ([e[2] for e in entries], entries[0][3])


def _search(costs, memory, sizes, num_devices, b, bubble, exact, incumbent=np.inf,
            usable=None, t_max_below=np.inf):
    """(least T, its stages, caps tried, caps pruned) over the assignments `memory` admits
    (`exact`: of exactly len(memory) stages); (inf, None, 0, 0) where none, or where none can
    beat `incumbent` (the best T of the stage counts searched before). `usable`: a cache
    (`_fitting`) shared by the calls of one DP; `t_max_below`: only the assignments whose
    slowest stage is faster."""
    latency = costs.latency_s
    usable, grouped = _fitting(costs, memory, sizes, {} if usable is None else usable)

    def evaluate(cap=np.inf):
        total_sum, stages = _run_dp(usable, sizes, num_devices, np.add, cap, grouped, exact)
        if stages is None:
            return np.inf, np.inf, None
        times = [latency[i, j, k] for i, j, k in stages]
        return float(total_sum), pipeline_time(times, b, bubble), stages

    # Without a t_max cap (but `t_max_below`'s): the least possible sum (a lower bound for
    # every candidate) and a first incumbent; no plan at all means memory (or the covering)
    # rules everything out.
    min_sum, best_total, best_stages = evaluate(
        np.nextafter(t_max_below, 0.0) if np.isfinite(t_max_below) else np.inf)
    if best_stages is None:
        return np.inf, None, 0, 0
    # S stages have t_max >= sum / S >= min_sum / S, so T = (B - b) t_max + b sum is at least
    # this: a stage count that cannot beat the incumbent is not searched (a Wide-ResNet of 32
    # layers on 64 GPUs: each of its 32 counts was searched in full, per schedule)
    if exact and (b - bubble) * min_sum / len(memory) + bubble * min_sum >= incumbent:
        return np.inf, None, 1, 0
    # Candidate t_max: the latencies the DP can pick (the least per device count; a dominated
    # option's latency gives the same plans as the next smaller candidate). A plan admitted
    # under a cap is admitted under every larger one, so the caps that admit none are a prefix:
    # bisect to its end (the uncapped plan is admitted at the largest cap). The probes only
    # find the prefix: the scan below takes its plans in order, so ties break as before.
    t_values = np.unique(np.concatenate([g[g < t_max_below] for g in {
        id(g): g for g in grouped[0]}.values()]))
    # The caps whose bound (below) reaches the best T known are never tried: the bisection
    # runs below them, and where the largest left admits no plan, none is searched.
    limit = int(np.searchsorted(b * t_values + bubble * (np.maximum(t_values, min_sum)
                                                           - t_values),
                                min(best_total, incumbent), side="left"))
    if limit == 0 or evaluate(t_values[limit - 1])[2] is None:
        return best_total, best_stages, 1, len(t_values)
    low, high = 0, limit - 1
    while low < high:
        mid = (low + high) // 2
        if evaluate(t_values[mid])[2] is None:
            low = mid + 1
        else:
            high = mid
    tried, pruned = low, 0     # tried: the caps settled (below `low`: no plan) or evaluated
    for index in range(low, len(t_values)):
        t_max = t_values[index]
        # A plan first found at this t_max has max t_i == t_max, so T >= B * t_max + b *
        # (sum - t_max) with sum >= max(t_max, min_sum); the bound grows with t_max (b <= 1
        # <= B), so stop at the first hit. Under a cap the least sum gives the least T of the
        # plans it admits, as T = (B - b) t_max + b sum grows with both.
        if b * t_max + bubble * (max(t_max, min_sum) - t_max) >= min(best_total, incumbent):
            pruned = len(t_values) - index
            break
        tried += 1
        _, total, stages = evaluate(t_max)
        if total < best_total:
            best_total, best_stages = total, stages
    return best_total, best_stages, tried, pruned

