"""The stage DP's exhaustive reference (`brute_force_stages`): every cut of the layers and
every submesh per stage, for tests that check `stage_dp.solve_stage_dp` against it."""
from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Sequence

import numpy as np

from autopar.core.errors import InvalidArgumentError
from autopar.inter_op.dp_memory import states_of
from autopar.inter_op.stage_dp import (
    StageAssignment,
    StageCosts,
    SubmeshShape,
    _assignment,
    _check_bubble,
    _one_f_one_b,
    _raise_infeasible,
    _validate,
    pipeline_time,
)

__all__ = ["brute_force_stages"]

_BRUTE_FORCE_LIMIT = 200_000     # stage assignments brute_force_stages agrees to enumerate


def brute_force_stages(costs: StageCosts, submeshes: Sequence[SubmeshShape], num_devices: int,
                       num_microbatches: int, *, max_stages: int | None = None,
                       kept: Callable[[int], Sequence] | None = None,
                       bubble: float | Callable[[int], float] = 1.0) -> StageAssignment:
    """Exhaustive reference for solve_stage_dp (same arguments, errors and result); refuses
    inputs with more than 200,000 candidate assignments."""
    start = time.perf_counter()
    sizes, num_devices, num_microbatches, max_q = _validate(
        costs, submeshes, num_devices, num_microbatches, max_stages)
    num_layers, k = costs.num_layers, len(sizes)
    count = sum(math.comb(num_layers - 1, s - 1) * k ** s for s in range(1, max_q + 1))
    if count > _BRUTE_FORCE_LIMIT:
        raise InvalidArgumentError(
            f"brute_force_stages would enumerate {count} assignments (limit "
            f"{_BRUTE_FORCE_LIMIT}): use solve_stage_dp, or fewer layers / submeshes / stages.")
    latency, budget = costs.latency_s, costs.memory_budget_bytes
    best_total, best_stages, best_b, needed = np.inf, None, 1.0, np.inf
    for num_stages in range(1, max_q + 1):
        states = states_of(kept or _one_f_one_b, num_stages)
        b = _check_bubble(bubble(num_stages) if callable(bubble) else bubble)
        for cuts in itertools.combinations(range(1, num_layers), num_stages - 1):
            bounds = (0, *cuts, num_layers)
            spans = [(bounds[p], bounds[p + 1] - 1) for p in range(num_stages)]
            for subs in itertools.product(range(k), repeat=num_stages):
                if sum(int(sizes[s]) for s in subs) != num_devices:
                    continue
                times = [latency[i, j, s] for (i, j), s in zip(spans, subs)]
                if not np.isfinite(times).all():
                    continue
                peak = max(costs.static_bytes[i, j, s] + a * costs.activation_bytes[i, j, s]
                           + d * costs.weight_bytes[i, j, s]
                           for p, ((i, j), s) in enumerate(zip(spans, subs))
                           for a, d in states[p])
                needed = min(needed, peak)
                if peak > budget:
                    continue
                total = pipeline_time(times, num_microbatches, b)
                if total < best_total:
                    best_total, best_b = total, b
                    best_stages = [(i, j, s) for (i, j), s in zip(spans, subs)]
    if best_stages is None:
        _raise_infeasible(needed, costs, sizes, num_devices, max_q)
    return _assignment(best_stages, latency, num_microbatches, best_b, 0, 0, start)
