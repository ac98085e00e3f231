"""The stage DP's memory tables (`stage_dp`): per stage position, a span's per-device bytes on
each submesh under the states a schedule's table passes through.

    >>> pareto({(0, 0), (2, 0), (1, 1), (1, 0), (0, 2)})
    ((0, 2), (1, 1), (2, 0))
"""
from __future__ import annotations

import functools

import numpy as np

from autopar.core.errors import InvalidArgumentError


class _KeptMemory:
    """[L, L, K] per-device bytes of a stage passing through `states` ((in flight, deferred)
    microbatch counts): its static bytes and the worst state's; np.inf where impossible. Each
    set is cut to its Pareto frontier (a state with no more of either count than another
    never keeps more) and each frontier computed once: a schedule's DP asks every stage of
    every stage count, and their states repeat (GPT-39B, 16 layers: 704 sets, 100 s)."""

    def __init__(self, costs):      # a stage_dp.StageCosts
        num_layers = costs.num_layers
        self.ok = np.isfinite(costs.latency_s) & np.triu(
            np.ones((num_layers, num_layers), bool))[..., None]
        self.act, self.weight = (np.where(self.ok, arr, 0.0)
                                 for arr in (costs.activation_bytes, costs.weight_bytes))
        self.static = np.where(self.ok, costs.static_bytes, np.inf)
        self._done: dict[tuple, np.ndarray] = {}

    def __call__(self, states) -> np.ndarray:
        key = pareto(states)
        if key not in self._done:
            kept = np.max([a * self.act + d * self.weight for a, d in key], axis=0)
            self._done[key] = self.static + kept
        return self._done[key]


def pareto(states) -> tuple[tuple[int, int], ...]:
    """The (in flight, deferred) pairs no other pair has at least as many of both.

        >>> pareto({(0, 0), (2, 0), (1, 1), (1, 0), (0, 2)})
        ((0, 2), (1, 1), (2, 0))
    """
    return tuple(s for s in sorted(set(states)) if not any(
        o != s and o[0] >= s[0] and o[1] >= s[1] for o in states))


def _stage_memory(kept: _KeptMemory, max_q: int) -> list[np.ndarray]:
    """max_q x [L, L, K]: per-device bytes of a stage that is q + 1-th from the end (q + 1
    microbatches in flight, 1F1B); np.inf where the stage is impossible."""
    return [kept(((q, 0),)) for q in range(1, max_q + 1)]


def _schedule_memory(kept: _KeptMemory, states_per_stage) -> list[np.ndarray]:
    """S x [L, L, K]: the bytes of the stage q + 1-th from the end of S, whose states are
    `states_per_stage[S - 1 - q]` (indexed from the first stage); positions with the same
    states share one array."""
    return [kept(states) for states in reversed(states_per_stage)]


def memory_tables(costs, max_q, kept):
    """[(stage count or None, () -> Q x [L, L, K] memory per stage from the end)]: one table
    for every count under 1F1B (`kept` None), else one per stage count S (`kept(S)`), each
    built when first asked (the DP skips the counts it can bound)."""
    memory = _KeptMemory(costs)
    if kept is None:
        return [(None, functools.cache(lambda: _stage_memory(memory, max_q)))]
    return [(s, functools.cache(functools.partial(_count_memory, memory, kept, s)))
            for s in range(1, max_q + 1)]


def _count_memory(memory: _KeptMemory, kept, num_stages: int) -> list[np.ndarray]:
    return _schedule_memory(memory, states_of(kept, num_stages))


def states_of(kept, num_stages: int) -> list:
    """`kept(num_stages)`: one non-empty set of states per stage, or an error naming it."""
    states = list(kept(num_stages))
    if len(states) != num_stages or not all(states):
        raise InvalidArgumentError(
            f"kept({num_stages}) gave {len(states)} state set(s): it must give one non-empty "
            f"set of (in flight, deferred) counts per stage, {num_stages} in all.")
    return states


def keeps_more(states_per_stage) -> bool:
    """Whether every stage p of S keeps at least 1F1B's S - p microbatches in flight at its
    worst state (its memory is then at least 1F1B's: W's bytes only add).

        >>> keeps_more([((2, 0),), ((1, 1),)]), keeps_more([((1, 0),), ((1, 0),)])
        (True, False)
    """
    s = len(states_per_stage)
    return all(max(a for a, _ in states) >= s - p for p, states in enumerate(states_per_stage))
