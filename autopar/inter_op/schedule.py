"""Pipeline schedules as data: which device group runs which task at each clock.

A task is the forward (F), backward (B) or weight gradient (W) of one microbatch on one
pipeline stage. Tables that split the backward (the zero-bubble ones) run B as the input
gradient alone, which the previous stage waits for, and W as the weight gradient, which may
wait to fill a bubble; the others run B as the whole backward. A stage lives on one device
group (a submesh): one stage per group, or `virtual_stages` = v stage chunks per group
(interleaved: stage k on group k mod G; ZB-V: stages k and 2G-1-k on group k).

One function builds every table (`make_schedule`): clock by clock, each group runs the task
its schedule's policy prefers among those whose dependencies finished at an earlier clock,
within the schedule's in-flight promise. `schedule_check.check_schedule` verifies any table,
`schedule_check.simulate` times it with per-task durations, and the runtime executes any
valid table in clock order.

    >>> s = make_schedule(Schedule.ONE_F_ONE_B, num_stages=2, num_microbatches=3)
    >>> s.num_clocks, s.in_flight()
    (8, (2, 1))
    >>> " ".join(str(t) for t in s.tasks_of(0))
    'F0 F1 B0 F2 B1 B2'
    >>> " ".join(str(t) for t in make_schedule(Schedule.ZERO_BUBBLE_H1, 2, 3).tasks_of(1))
    'F0 B0 F1 B1 W0 F2 B2 W1 W2'

Pure Python: no JAX import.
"""
from __future__ import annotations

import enum
import operator
from collections.abc import Callable
from dataclasses import dataclass

from autopar.core.enums import Schedule
from autopar.core.errors import InvalidArgumentError

SPLIT = frozenset({Schedule.ZERO_BUBBLE_H1, Schedule.ZERO_BUBBLE_H2, Schedule.ZERO_BUBBLE_V})
CHUNKED = frozenset({Schedule.INTERLEAVED_1F1B, Schedule.ZERO_BUBBLE_V})


def one_executable(num_stages: int, num_microbatches: int) -> bool:
    """Whether a pipeline runs as one executable instead of task by task: one stage with
    several microbatches (gradient accumulation on one mesh) is a loop over the microbatches
    inside one program (`lowering.accumulate`), with no schedule to keep.

        >>> one_executable(1, 4), one_executable(2, 4), one_executable(1, 1)
        (True, False, False)
    """
    return num_stages == 1 and num_microbatches > 1


class Phase(enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"   # the input gradient; with it the weight gradient, unless split
    WEIGHT = "weight"       # the weight gradient, split from the backward


LETTER = {Phase.FORWARD: "F", Phase.BACKWARD: "B", Phase.WEIGHT: "W"}


@dataclass(frozen=True, slots=True)
class Task:
    """One forward, backward or weight gradient of one microbatch on one stage.

        >>> str(Task(Phase.BACKWARD, stage=1, microbatch=3))
        'B3'
    """
    phase: Phase
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{LETTER.get(self.phase, '?')}{self.microbatch}"

    def describe(self) -> str:
        """Long form for error messages, e.g. ``B(stage=1, microbatch=3)``."""
        return f"{str(self)[0]}(stage={self.stage}, microbatch={self.microbatch})"


@dataclass(frozen=True, slots=True)
class PipelineSchedule:
    """A clock table: ``clocks[c][g]`` is the task device group ``g`` runs at clock ``c``
    (None: idle). ``placement[k]`` is the group of stage ``k`` (empty: stage k on group k);
    ``promise[g]``, where given, the most stage-microbatches whose forward ran on group g and
    whose backward has not (the activations the schedule promises to keep at most).

        >>> s = make_schedule(Schedule.GPIPE, 2, 2)
        >>> [[str(t) if t else "." for t in row] for row in s.clocks]
        [['F0', '.'], ['F1', 'F0'], ['.', 'F1'], ['.', 'B0'], ['B0', 'B1'], ['B1', '.']]
    """
    schedule: Schedule
    num_stages: int
    num_microbatches: int
    clocks: tuple[tuple[Task | None, ...], ...]
    placement: tuple[int, ...] = ()
    promise: tuple[int, ...] = ()

    @property
    def num_groups(self) -> int:
        return max(self.placement) + 1 if self.placement else self.num_stages

    def group_of(self, stage: int) -> int:
        return self.placement[stage] if self.placement else stage

    @property
    def split_backward(self) -> bool:
        """Whether the table runs W (the weight gradient) apart from B."""
        return self.schedule in SPLIT

    @property
    def phases(self) -> tuple[Phase, ...]:
        """The kinds of task the table runs for every stage and microbatch."""
        if self.schedule is Schedule.FORWARD:
            return (Phase.FORWARD,)
        return tuple(Phase) if self.split_backward else (Phase.FORWARD, Phase.BACKWARD)

    @property
    def num_clocks(self) -> int:
        return len(self.clocks)

    @property
    def bubble_fraction(self) -> float:
        """Idle group-clocks / total group-clocks, every task one clock (0.0 for an empty
        table); `schedule_check.simulate` weighs tasks by their durations."""
        total = self.num_clocks * self.num_groups
        if total == 0:
            return 0.0
        idle = sum(1 for row in self.clocks for t in row if t is None)
        return idle / total

    def in_flight(self) -> tuple[int, ...]:
        """Per stage, the most microbatches whose forward ran there and whose backward has not
        yet: the activations that stage must keep alive."""
        return self._most(lambda a, d: a)

    def held(self) -> tuple[int, ...]:
        """Per stage, the most microbatches whose forward ran and whose backward has not
        finished (its W, where the table splits it): whose residuals the stage holds, since
        the runtime keeps them until W. 1F1B's in-flight counts for the other tables."""
        return self._most(lambda a, d: a + d)

    def group_in_flight(self) -> tuple[int, ...]:
        """Per device group, the most stage-microbatches in flight over its stages."""
        return _peaks(self, Phase.FORWARD, Phase.BACKWARD, self.num_groups,
                      lambda t: self.group_of(t.stage))

    def deferred_weights(self) -> tuple[int, ...]:
        """Per stage, the most microbatches whose B ran and whose W has not (what W's saved
        tensors keep alive); zeros for a table that does not split the backward."""
        return self._most(lambda a, d: d)

    def _most(self, count) -> tuple[int, ...]:
        """Per stage, the most of `count(in flight, deferred)` over its `kept_states`."""
        return tuple(max(count(a, d) for a, d in states) for states in self.kept_states())

    def kept_states(self) -> tuple[frozenset[tuple[int, int]], ...]:
        """Per stage, every (in flight, deferred) pair it passes through, clock by clock:
        microbatches between their F and their B, and between their B and their W (where
        the table splits the backward). A stage's memory peaks at one of them, which is
        less than both counts' own peaks at once (`kept_peak`)."""
        seen: list[set[tuple[int, int]]] = [{(0, 0)} for _ in range(self.num_stages)]
        for now in self._states():
            for k, state in enumerate(now):
                seen[k].add(state)
        return tuple(frozenset(x) for x in seen)

    def group_kept_peak(self, whole, part) -> tuple[float, ...]:
        """Per device group, the most bytes its stages keep at once, clock by clock, when a
        microbatch in flight on stage k keeps `whole[k]` and a deferred one `part[k]`: for
        stage chunks sharing a group, less than their own peaks summed (they peak at
        different clocks); for a stage alone on its group, its `kept_peak`'s bytes.

            >>> s = make_schedule(Schedule.INTERLEAVED_1F1B, 4, 8)   # stages 0, 2 on group 0
            >>> s.group_kept_peak([1.0] * 4, [0.0] * 4), s.in_flight()
            ((5.0, 3.0), (4, 3, 2, 1))
        """
        most = [0.0] * self.num_groups
        for now in self._states():
            got = [0.0] * self.num_groups
            for k, (a, d) in enumerate(now):
                got[self.group_of(k)] += a * whole[k] + d * part[k]
            most = [max(x, y) for x, y in zip(most, got)]
        return tuple(most)

    def _states(self):
        """Every stage's (in flight, deferred) pair after each clock (none kept for a
        forward-only table)."""
        if self.schedule is Schedule.FORWARD:
            return
        split = self.split_backward
        now = [(0, 0)] * self.num_stages
        for row in self.clocks:
            for t in row:
                if t is None:
                    continue
                a, d = now[t.stage]
                if t.phase is Phase.FORWARD:
                    a += 1
                elif t.phase is Phase.BACKWARD:
                    a, d = a - 1, d + 1 if split else d
                else:
                    d -= 1
                now[t.stage] = (a, d)
            yield tuple(now)

    def kept_peak(self, whole, part) -> tuple[tuple[int, int], ...]:
        """Per stage k, the (in flight, deferred) pair of `kept_states` that keeps the most
        bytes when a microbatch in flight keeps `whole[k]` and a deferred one `part[k]`.

            >>> s = make_schedule(Schedule.ZERO_BUBBLE_H1, 2, 4)
            >>> s.kept_peak([10.0, 10.0], [4.0, 4.0]), s.in_flight(), s.deferred_weights()
            (((2, 0), (1, 1)), (2, 1), (1, 2))
        """
        return tuple(worst_mix(states, w, p)
                     for states, w, p in zip(self.kept_states(), whole, part))

    def tasks_of(self, group: int) -> tuple[Task, ...]:
        """The tasks device group ``group`` (stage ``group`` in a table of one stage per
        group) runs, in execution order."""
        group = index_arg(group, "stage", 0)
        if group >= self.num_groups:
            raise InvalidArgumentError(
                f"stage={group} is out of range for a schedule with {self.num_groups} device "
                f"group(s); pass a stage in 0..{self.num_groups - 1}.")
        return tuple(row[group] for row in self.clocks if row[group] is not None)

    def order(self) -> tuple[Task, ...]:
        """Every task in clock order (within a clock, by group): the order the runtime
        dispatches them in."""
        return tuple(t for row in self.clocks for t in row if t is not None)


def worst_mix(states, whole: float, part: float) -> tuple[int, int]:
    """Of (in flight, deferred) pairs, the one keeping the most bytes when a microbatch in
    flight keeps `whole` and a deferred one `part` (ties: the smallest pair)."""
    return max(sorted(states), key=lambda qd: qd[0] * whole + qd[1] * part)


def _peaks(s: PipelineSchedule, opens: Phase, closes: Phase, n: int, where) -> tuple[int, ...]:
    live, peak = [0] * n, [0] * n
    if s.schedule is Schedule.FORWARD:      # nothing is kept for a backward
        return tuple(peak)
    for row in s.clocks:
        for t in row:
            if t is None:
                continue
            if t.phase is opens:
                live[where(t)] += 1
                peak[where(t)] = max(peak[where(t)], live[where(t)])
            elif t.phase is closes:
                live[where(t)] -= 1
    return tuple(peak)


def index_arg(value: object, name: str, minimum: int) -> int:
    """`value` as an int >= `minimum`, or an InvalidArgumentError naming `name`."""
    if isinstance(value, bool):
        raise InvalidArgumentError(f"{name}={value!r} is a bool; pass an int >= {minimum}.")
    try:
        value = operator.index(value)
    except TypeError:
        raise InvalidArgumentError(
            f"{name}={value!r} has type {type(value).__name__}; "
            f"pass an int >= {minimum}.") from None
    if value < minimum:
        raise InvalidArgumentError(
            f"{name}={value} is less than {minimum}; pass an int >= {minimum}.")
    return value


def check_schedule_enum(schedule: object) -> Schedule:
    if not isinstance(schedule, Schedule):
        choices = ", ".join(f"Schedule.{s.name}" for s in Schedule)
        raise InvalidArgumentError(
            f"schedule={schedule!r} is not a Schedule; pass one of {choices} "
            f"(a string value converts with Schedule(value), e.g. Schedule('1f1b')).")
    return schedule


def deps(task: Task, num_stages: int) -> list[Task]:
    """The tasks `task` waits for: F(k, m) on F(k-1, m); B(k, m) on F(k, m) and B(k+1, m);
    W(k, m) on B(k, m)."""
    k, m = task.stage, task.microbatch
    if task.phase is Phase.FORWARD:
        return [Task(Phase.FORWARD, k - 1, m)] if k > 0 else []
    if task.phase is Phase.WEIGHT:
        return [Task(Phase.BACKWARD, k, m)]
    out = [Task(Phase.FORWARD, k, m)]
    if k < num_stages - 1:
        out.append(Task(Phase.BACKWARD, k + 1, m))
    return out


@dataclass(frozen=True, slots=True)
class _Policy:
    """How a schedule's groups choose their next task (see `make_schedule`)."""
    placement: tuple[int, ...]     # stage -> group
    live: tuple[int, ...]          # per group: in-flight stage-microbatches at most
    deferred: tuple[int, ...]      # per group: Ws left waiting beyond which W runs first
    f_key: Callable[[int, int], tuple]   # (stage, microbatch) -> rank among ready Fs
    b_key: Callable[[int, int], tuple]
    backward: bool = True                # False: a forward-only table (no B, no W)


def placement_of(schedule: Schedule, num_stages: int,
                 virtual_stages: int | None = None) -> tuple[int, ...]:
    """Each stage's device group: stage k on group k mod G (interleaved), stages k and
    2G-1-k on group k (ZB-V), else stage k on group k.

        >>> placement_of(Schedule.ZERO_BUBBLE_V, 4), placement_of(Schedule.INTERLEAVED_1F1B, 4)
        ((0, 1, 1, 0), (0, 1, 0, 1))
    """
    G = num_stages // virtual_stages_of(schedule, virtual_stages)
    if schedule is Schedule.INTERLEAVED_1F1B:
        return tuple(k % G for k in range(num_stages))
    if schedule is Schedule.ZERO_BUBBLE_V:
        return tuple(k if k < G else 2 * G - 1 - k for k in range(num_stages))
    return tuple(range(num_stages))


def _policy(schedule: Schedule, K: int, M: int, v: int) -> _Policy:
    G = K // v
    place = placement_of(schedule, K, v)
    chunk = lambda k: k // G                                           # noqa: E731
    plain = lambda k, m: (m, -k)                                       # noqa: E731
    huge = (K * M,) * G
    if schedule is Schedule.GPIPE:
        return _Policy(place, huge, huge, plain, plain)
    if schedule is Schedule.FORWARD:
        return _Policy(place, huge, huge, plain, plain, backward=False)
    if schedule is Schedule.INTERLEAVED_1F1B:
        # Megatron's order: microbatches in rounds of G, each round through chunk 0, 1, ...
        # forward and ..., 1, 0 backward; group g warms up with 2(G-g-1) + (v-1)G forwards
        live = tuple(min(2 * (G - g - 1) + (v - 1) * G + 1, v * M) for g in range(G))
        return _Policy(place, live, huge, lambda k, m: (m // G, chunk(k), m),
                       lambda k, m: (m // G, v - 1 - chunk(k), m))
    if schedule is Schedule.ZERO_BUBBLE_V:
        # 1F1B's activation memory: G whole-stage microbatches, 2G chunk-microbatches
        return _Policy(place, (min(2 * G, 2 * M),) * G, (2 * G,) * G,
                       lambda k, m: (m, -k), lambda k, m: (m, k))
    live = [min(K - g, M) for g in range(K)]
    if schedule is Schedule.ONE_F_ONE_B:
        return _Policy(place, tuple(live), huge, plain, plain)
    if schedule is Schedule.ZERO_BUBBLE_H1:     # 1F1B's in-flight; stage g defers g Ws
        return _Policy(place, tuple(live), tuple(range(K)), plain, plain)
    if schedule is Schedule.ZERO_BUBBLE_H2:     # about twice the in-flight; W fills gaps
        # stage g defers up to 2g + 1 Ws: at most 2K microbatches kept, twice 1F1B's most
        # (with no bound every W waited for the cooldown: M kept, the same step)
        return _Policy(place, tuple(min(2 * (K - g) - 1, M) for g in range(K)),
                       tuple(2 * g + 1 for g in range(K)), plain, plain)
    raise AssertionError(schedule)


def planned(schedule: Schedule) -> Schedule:
    """The schedule the stages are solved for: 1F1B's for `Schedule.AUTO` (the least
    activations in flight among the candidates; `schedule_choice` then prices them all)."""
    return Schedule.ONE_F_ONE_B if schedule is Schedule.AUTO else schedule


def virtual_stages_of(schedule: Schedule, virtual_stages: int | None) -> int:
    """Stage chunks per device group: `virtual_stages` for interleaved 1F1B (default 2), 2
    for ZB-V, 1 for the rest."""
    if schedule is Schedule.ZERO_BUBBLE_V:
        if virtual_stages not in (None, 2):
            raise InvalidArgumentError(
                f"virtual_stages={virtual_stages!r} with Schedule.ZERO_BUBBLE_V: ZB-V places "
                f"exactly 2 stage chunks per device group. Fix: leave virtual_stages unset.")
        return 2
    if schedule is Schedule.INTERLEAVED_1F1B:
        return 2 if virtual_stages is None else index_arg(virtual_stages, "virtual_stages", 1)
    if virtual_stages not in (None, 1):
        raise InvalidArgumentError(
            f"virtual_stages={virtual_stages!r} with Schedule.{schedule.name}: it places one "
            f"stage per device group. Fix: use Schedule.INTERLEAVED_1F1B for several chunks.")
    return 1


def make_schedule(schedule: Schedule, num_stages: int, num_microbatches: int, *,
                  virtual_stages: int | None = None) -> PipelineSchedule:
    """The clock table of `schedule` for `num_stages` pipeline stages (chunks, for the
    chunked schedules: `num_stages / virtual_stages` device groups) and `num_microbatches`.

    Each clock, each group runs the task its policy ranks first among those ready (every
    dependency finished at an earlier clock): a ready B first (all but GPipe), then where
    within the schedule's in-flight promise an F, then a waiting W (one stage's Ws beyond
    its allowance first).

        >>> make_schedule(Schedule.GPIPE, num_stages=4, num_microbatches=8).bubble_fraction
        0.2727272727272727
        >>> make_schedule(Schedule.INTERLEAVED_1F1B, 4, 4, virtual_stages=2).num_groups
        2
    """
    schedule = check_schedule_enum(schedule)
    if schedule is Schedule.AUTO:
        raise InvalidArgumentError(
            "make_schedule(Schedule.AUTO): AUTO is a choice the stage search makes among the "
            "schedules (the plan's pipeline['schedule'] names the one it chose), not a table. "
            "Fix: pass a concrete schedule, e.g. Schedule.ONE_F_ONE_B.")
    K = index_arg(num_stages, "num_stages", 1)
    M = index_arg(num_microbatches, "num_microbatches", 1)
    v = virtual_stages_of(schedule, virtual_stages)
    if K % v:
        raise InvalidArgumentError(
            f"num_stages={K} with Schedule.{schedule.name} and {v} stage chunks per device "
            f"group: the stages must split evenly over the groups. Fix: a multiple of {v}.")
    pol = _policy(schedule, K, M, v)
    return _simulate_clocks(schedule, K, M, pol, schedule in SPLIT)


def _simulate_clocks(schedule: Schedule, K: int, M: int, pol: _Policy,
                     split: bool) -> PipelineSchedule:
    G = max(pol.placement) + 1
    stages_of = [[k for k in range(K) if pol.placement[k] == g] for g in range(G)]
    next_f, next_b = [0] * K, [0] * K        # per stage: the next microbatch to run
    f_done, b_done = [0] * K, [0] * K         # per stage: microbatches finished (in order)
    waiting_w: list[list[Task]] = [[] for _ in range(G)]
    live = [0] * G
    clocks: list[tuple[Task | None, ...]] = []
    total = (3 if split else 2 if pol.backward else 1) * K * M
    ran = 0
    while ran < total:
        row: list[Task | None] = [None] * G
        for g in range(G):
            row[g] = _choose(g, stages_of[g], pol, K, M, next_f, next_b, f_done, b_done,
                             waiting_w[g], live[g])
        if all(t is None for t in row):   # cannot happen for the built-in policies
            raise AssertionError(f"{schedule} deadlocked at clock {len(clocks)} (K={K}, M={M})")
        for g, t in enumerate(row):       # visible from the next clock on
            if t is None:
                continue
            ran += 1
            if t.phase is Phase.FORWARD:
                next_f[t.stage] += 1
                f_done[t.stage] += 1
                live[g] += 1
            elif t.phase is Phase.BACKWARD:
                next_b[t.stage] += 1
                b_done[t.stage] += 1
                live[g] -= 1
                if split:
                    waiting_w[g].append(Task(Phase.WEIGHT, t.stage, t.microbatch))
            else:
                waiting_w[g].remove(t)
        clocks.append(tuple(row))
    return PipelineSchedule(schedule, K, M, tuple(clocks), placement=pol.placement,
                            promise=pol.live)


def _choose(g, stages, pol: _Policy, K, M, next_f, next_b, f_done, b_done, waiting_w,
            live) -> Task | None:
    """The task group g runs this clock: Ws waiting beyond the group's allowance first, then a
    ready F within the in-flight promise, then a ready B, then a waiting W (microbatches run
    in order on each stage, so only each stage's next F and next B can be ready)."""
    if len(waiting_w) > pol.deferred[g]:
        return waiting_w[0]
    if live < pol.live[g]:
        f_ready = [k for k in stages
                   if next_f[k] < M and (k == 0 or f_done[k - 1] > next_f[k])]
        if f_ready:
            k = min(f_ready, key=lambda k: pol.f_key(k, next_f[k]))
            return Task(Phase.FORWARD, k, next_f[k])
    b_ready = [k for k in stages if pol.backward and next_b[k] < M and f_done[k] > next_b[k]
               and (k == K - 1 or b_done[k + 1] > next_b[k])]
    if b_ready:
        k = min(b_ready, key=lambda k: pol.b_key(k, next_b[k]))
        return Task(Phase.BACKWARD, k, next_b[k])
    return waiting_w[0] if waiting_w else None
