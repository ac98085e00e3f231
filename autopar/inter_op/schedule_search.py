"""`Schedule.AUTO` searched with the stages: each schedule's own stage DP, every layout solved
whole priced under every schedule by its simulated table.

The 1F1B search (the stage DP, its alternatives with fewer stages, each solved whole) runs
first. Then each zero-bubble schedule (`SEARCHED`) gets its own DP (`stage_dp.solve_stage_dp`):
each stage must fit the worst (in flight, deferred) state its S-stage table passes through
(`kept_of`), and the objective leaves the fraction of 1F1B's bubble that schedule leaves
(`bubble_of`: the tables simulated for S equal stages with the F, B and W shares of the 1F1B
layout's stages, `task_share`). A layout the DP finds that was not solved yet is solved whole
for that schedule's in-flight microbatches. Every layout solved is then priced under every
candidate schedule (`schedule_choice.choose_schedule`: its table simulated with its stages'
own F, B and W durations, its memory checked per stage), and the fastest (layout, schedule)
that fits wins: ZB-H2 can take a layout with more activations in flight, ZB-H1 one with
fewer W's deferred, and a schedule with a smaller bubble one with more stages.

The chunked schedules (interleaved 1F1B, ZB-V: 2 stage chunks per device group) are
searched over equal groups (`_chunk_layouts`): for each group count G, the same DP restricted
to submeshes of n / G devices places 2G chunks, each within half the budget; the layout is
solved whole on its groups' devices and priced under its own table, each group's memory
that of its chunks together (`schedule_choice.device_peaks`). Interleaved 1F1B and ZB-V
place the same chunks on different devices: each prices its own. A user's fixed chunked
schedule with `AutoStageOption` searches these alone.
"""
from __future__ import annotations

import logging

import numpy as np

from autopar.core.enums import Schedule
from autopar.core.errors import InfeasiblePlanError, InvalidArgumentError
from autopar.inter_op.pipeline import LossGraph
from autopar.inter_op.schedule import CHUNKED, make_schedule
from autopar.inter_op.schedule_choice import choose_schedule
from autopar.inter_op.stage_costs import try_dp
from autopar.inter_op.task_costs import TaskSeconds, schedule_seconds, task_seconds

log = logging.getLogger(__name__)

# The schedules with a stage DP of their own beyond 1F1B's (GPipe is priced, not searched:
# it keeps every microbatch in flight and is never faster than 1F1B).
SEARCHED = (Schedule.ZERO_BUBBLE_H1, Schedule.ZERO_BUBBLE_H2)
# Schedules of 2 stage chunks per device group, searched over equal groups (`_chunk_layouts`)
CHUNKED_SEARCHED = (Schedule.INTERLEAVED_1F1B, Schedule.ZERO_BUBBLE_V)
SLOWER = 1.25     # a stage solved whole this much slower than the DP's price: ask it again
# A layout is solved whole for a schedule only where, with no bubble at all, it could beat the
# best layout priced so far by more than this (GPT-6.7B / 39B at M = 1024: 1F1B's bubble is
# under 1%, and solving their zero-bubble and chunk layouts doubled the planning time).
MIN_GAIN = 0.02
REDO = 1          # times a schedule's DP is asked again (each answer is solved whole)


class Tables:
    """`make_schedule` of each (schedule, stage count, microbatches) asked, built once."""

    def __init__(self):
        self._built: dict[tuple, object] = {}

    def __call__(self, schedule: Schedule, num_stages: int, num_microbatches: int):
        key = (schedule, num_stages, num_microbatches)
        if key not in self._built:
            self._built[key] = make_schedule(schedule, num_stages, num_microbatches)
        return self._built[key]


def steady_microbatches(schedule: Schedule, num_stages: int, num_microbatches: int) -> int:
    """The fewest microbatches whose `num_stages`-stage table passes through the same (in
    flight, deferred) states per stage as `num_microbatches`' and takes the same time beyond
    its microbatches' work: past 2S microbatches a table repeats its steady pattern (and
    interleaving its rounds of G), so the DP, which asks every stage count, need not build
    tables of M = 1024 (checked against the full tables for 2 to 32 stages, unequal F, B and
    W times included: tests/inter_op/test_schedule_search.py).

        >>> steady_microbatches(Schedule.ZERO_BUBBLE_H1, 4, 1024), steady_microbatches(
        ...     Schedule.INTERLEAVED_1F1B, 8, 1027)
        (8, 19)
    """
    s, m = num_stages, num_microbatches
    groups = s // 2 if schedule in CHUNKED else s
    return m if m <= 2 * s else m - groups * ((m - 2 * s) // groups)


def kept_of(schedule: Schedule, num_microbatches: int, tables: Tables):
    """`kept(S)` for the stage DP: each stage's (in flight, deferred) states in the S-stage
    table.

        >>> [sorted(states) for states in kept_of(Schedule.ONE_F_ONE_B, 4, Tables())(2)]
        [[(0, 0), (1, 0), (2, 0)], [(0, 0), (1, 0)]]
    """
    states: dict[int, tuple] = {}      # the DP asks for every S on each run: walk each once

    def kept(s: int) -> tuple:
        if s not in states:
            states[s] = tables(schedule, s, steady_microbatches(
                schedule, s, num_microbatches)).kept_states()
        return states[s]
    return kept


def bubble_of(schedule: Schedule, num_microbatches: int, share: TaskSeconds, tables: Tables,
              chunks: int = 1):
    """`bubble(S)` for the stage DP: of S equal stages whose microbatch takes 1 (F, B and W
    in `share`'s proportions), the time the schedule's table takes beyond M over 1F1B's
    (S - 1), clipped to [0, 1]. With `chunks` stage chunks per device group, the table's
    time over `chunks`: the DP's M t_max is one chunk's share of a group's work.

        >>> even = TaskSeconds(1 / 3, 1 / 3, 1 / 3, 0.0)
        >>> round(bubble_of(Schedule.ZERO_BUBBLE_H1, 8, even, Tables())(4), 3)
        0.333
    """
    m, found = num_microbatches, {}

    def bubble(s: int) -> float:
        if s == 1 or s % chunks:
            return 1.0
        if s not in found:         # each table simulated once, however often the DP runs
            few = steady_microbatches(schedule, s, m)
            t = schedule_seconds(tables(schedule, s, few), [share] * s) / chunks
            found[s] = min(max((t - few) / (s - 1), 0.0), 1.0)
        return found[s]
    return bubble


def task_share(loss: LossGraph, stages) -> TaskSeconds:
    """The F, B and W shares of a microbatch's time over `stages` (summed, then scaled to a
    microbatch time of 1 for a split backward)."""
    parts = [task_seconds(loss, st.slice, st.graph, st.solution.latency_s,
                          st.solution.overhead_s) for st in stages]
    f, b, w, c = (sum(getattr(p, name) for p in parts)
                  for name in ("forward", "backward", "weight", "call_s"))
    total = max(f + b + w, 1e-30)
    return TaskSeconds(f / total, b / total, w / total, c / total)


def joint(loss: LossGraph, chosen, seen: list, dp, options, budget: float, solved,
          num_microbatches: int, ks, sizes, only: Schedule | None = None):
    """(stages, schedule, seen): the fastest fitting pair over the layouts solved for 1F1B
    (`chosen`, and `seen`'s: (stages or None, latency, error) per layout) and those each
    `SEARCHED` schedule's DP finds (`_schedule_layouts`; `solved(choice, schedule)` solves one
    whole; `ks`: the submesh of each of the DP's options per kind of layer plan, `sizes` each
    submesh's devices) and the chunk layouts of `CHUNKED_SEARCHED` (`_chunk_layouts`), with
    `seen` repriced: each layout's latency is `choose_schedule`'s (its best schedule's
    simulated step on the scale of the DP's 1F1B formula). `only` (a chunked schedule the
    user fixed): its chunk layouts alone; none fitting raises the first one's error."""
    m, tables = num_microbatches, Tables()
    share = task_share(loss, chosen)
    errors = [(None, None, e) for st, _, e in seen if st is None]
    priced: list[tuple] = []

    def price(stages, chunked: Schedule | None = None) -> None:
        """Price `stages` under every schedule (once per layout); a chunk layout under its
        own (its stages share device groups)."""
        if all(_key(stages) != _key(other) for other, *_ in priced):
            got = choose_schedule(loss, stages, chunked or Schedule.AUTO, m, budget,
                                  tables=tables)
            fits = not got.candidates or any(
                c["fits"] and c["schedule"] == got.schedule.value for c in got.candidates)
            if chunked is not None:
                fits = all(p <= budget * (1 + 1e-9) for p in got.devices)
            priced.append((stages, got.latency_s, got.schedule, fits))

    def best_t() -> float:
        return min((t for _, t, _, ok in priced if ok), default=np.inf)

    if only is not None:
        for stages in _chunk_layouts(only, dp, options, budget, solved, ks, sizes, m, tables,
                                     share, errors, best_t):
            price(stages, only)
        if not priced and not errors:
            raise InvalidArgumentError(
                f"{only.value} places 2 stage chunks on each of at least 2 equal device "
                f"groups: the stage search found no such layout of the "
                f"{options[0][0].shape[0]} layers on {max(sizes)} devices (it needs at least 4 "
                "layers and a group size among the candidate submeshes). Fix: more layers "
                "(AutoLayerOption(num_layers=...)), or another schedule.")
        if not any(ok for *_, ok in priced):
            raise next((e for _, _, e in errors), None) or InfeasiblePlanError(
                f"memory: no layout of 2 stage chunks per device group fits "
                f"memory_budget_bytes={budget:,.0f} per device under {only.value} (each "
                "chunk within half of it). Fix: another schedule, more microbatches, "
                "recomputation, or a larger budget.", needed_bytes=0, budget_bytes=int(budget))
        return _best(priced, errors)
    for stages in [chosen] + [st for st, _, _ in seen if st is not None and st is not chosen]:
        price(stages)
    for schedule in SEARCHED:
        for stages in _schedule_layouts(schedule, dp, options, budget, solved, ks,
                                        kept_of(schedule, m, tables),
                                        bubble_of(schedule, m, share, tables), errors, best_t,
                                        m):
            price(stages)
    for schedule in CHUNKED_SEARCHED:
        for stages in _chunk_layouts(schedule, dp, options, budget, solved, ks, sizes, m,
                                     tables, share, errors, best_t):
            price(stages, schedule)
    return _best(priced, errors)


def _best(priced: list, errors: list):
    """(stages, schedule, seen) of the fastest fitting of `priced` ((stages, latency,
    schedule, fits) per layout): `joint`'s answer."""
    best = min((p for p in priced if p[3]), key=lambda p: p[1], default=priced[0])
    if len(priced) > 1:
        log.info("autopar: %d stage layouts priced under every schedule; %d stage(s) with %s "
                 "chosen (%.4g s per step predicted)", len(priced), len(best[0]),
                 best[2].value, best[1])
    return best[0], best[2], [(st, t, None, sched) for st, t, sched, _ in priced] + errors


def _schedule_layouts(schedule, dp, options, budget, solved, ks, kept, bubble,
                      errors: list, best_t, m: int):
    """The layouts `schedule`'s own stage DP finds over the layer plans solved so far (it
    refines no bound), each solved whole for its in-flight microbatches, yielded one by one.
    The DP searches only the layouts whose DP price (the schedule's bubble counted, the
    layers' plans summed) is below `best_t()` (the best layout priced so far) and that with
    no bubble at all (M t_max, `m` microbatches) could beat it by `MIN_GAIN` (8-layer GPT,
    M = 8, budget 1.1x 1F1B's peak: ZB-H2's DP layout, priced 2.5% slower than the best, took
    14 s to solve whole, more than the whole 1F1B search); where none is, nothing is solved.
    Where a stage solved whole is over `SLOWER` x what the DP priced it at (its layers' plans
    summed fit the schedule's memory, the stage whole needs a leaner, slower plan), the DP is
    asked again without that span on that submesh, in any view (`run_dp`'s `banned`), at
    most `REDO` times. Errors of layouts that did not fit go to `errors`."""
    banned = list(getattr(dp, "keywords", {}).get("banned", ()))
    for _ in range(REDO + 1):
        best = best_t()
        choice = try_dp(dp, options, budget, kept=kept, bubble=bubble, banned=tuple(banned),
                        solved_only=True, incumbent=best,
                        t_max_below=best * (1 - MIN_GAIN) / m)
        if choice is None or choice.num_stages == 1:
            return
        try:
            stages = solved(choice, schedule)
        except InfeasiblePlanError as e:
            errors.append((None, None, e))
            slow = [getattr(e, "stage", None)]
            if slow[0] is None:
                return
        else:
            yield stages
            slow = [p for p, st in enumerate(stages)
                    if st.solution.latency_s > SLOWER * choice.stage_latency_s[p]]
        if not slow:
            return
        for p in slow:
            k = ks[int(choice.submeshes[p]) % len(ks)]
            banned += [(*choice.layer_spans[p], q) for q in range(len(ks)) if ks[q] == k]


def _chunk_layouts(schedule, dp, options, budget, solved, ks, sizes, m, tables, share,
                   errors: list, best_t):
    """Chunk layouts for `schedule` (2 stage chunks per device group), one per group count G
    (G >= 2 groups of n / G devices, 2G <= the layers): the stage DP over options on
    submeshes of n / G devices alone, exactly 2G stages (the devices counted twice), each
    chunk within half the budget (its group holds two), the table's states per chunk; its
    objective leaves b of the bubble so that for equal chunks it is half the table's time.
    A layout is solved whole (on its group's devices) where its chunks' M sum t / G (its
    groups' work perfectly balanced, with no bubble) is `MIN_GAIN` below `best_t()`. Like
    `_schedule_layouts`, the DP runs over the layer plans solved so far."""
    num_layers, n = options[0][0].shape[0], max(sizes)     # the largest: the whole mesh
    base = list(getattr(dp, "keywords", {}).get("banned", ()))
    stages_kept = kept_of(schedule, m, tables)
    bubble = bubble_of(schedule, m, share, tables, chunks=2)
    for groups in range(2, n + 1):
        if n % groups or 2 * groups > num_layers:
            continue
        other = [q for q in range(len(ks)) if sizes[ks[q]] != n // groups]
        if len(other) == len(ks):
            continue
        choice = try_dp(dp, options, budget / 2, max_stages=2 * groups,
                        device_ids=tuple(range(2 * n)),
                        banned=tuple(base + [(l, l, q) for l in range(num_layers)
                                             for q in other]),
                        kept=lambda s: stages_kept(s) if s % 2 == 0 else [((s, 0),)] * s,
                        bubble=bubble,
                        solved_only=True)
        # no table runs it faster than its groups' work perfectly balanced, bubble-free
        if choice is None or m * sum(choice.stage_latency_s) / groups >= best_t() * (
                1 - MIN_GAIN):
            continue
        try:
            yield solved(choice, schedule)
        except InfeasiblePlanError as e:
            errors.append((None, None, e))


def _key(stages) -> tuple:
    """What makes two solved layouts one: each stage's layers, submesh, devices, view, remat,
    ZeRO and plan (its latency and activations). The devices tell an interleaved layout
    (chunk k on group k mod G) from a ZB-V one with the same chunks (k and 2G - 1 - k on
    group k), each priced under its own table."""
    return tuple((st.layers, st.submesh, tuple(st.device_ids), tuple(st.solution.logical_shape),
                  st.remat, st.zero, st.solution.latency_s, st.solution.activation_bytes)
                 for st in stages)
