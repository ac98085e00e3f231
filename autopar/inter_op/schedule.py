"""Pipeline schedules: which stage runs which microbatch's forward or backward at each clock.

A schedule is a pure function ``(schedule, num_stages, num_microbatches) -> clock table``.
One clock is one forward or one backward of one microbatch on one stage (equal durations).
Both GPipe and 1F1B take ``2 * (M + S - 1)`` clocks with bubble fraction
``(S - 1) / (M + S - 1)``; 1F1B keeps only ``min(S - s, M)`` microbatches' activations alive
on stage ``s`` instead of GPipe's ``M``.

    >>> s = make_schedule(Schedule.ONE_F_ONE_B, num_stages=2, num_microbatches=3)
    >>> s.num_clocks, s.in_flight()
    (8, (2, 1))
    >>> " ".join(str(t) for t in s.tasks_of(0))
    'F0 F1 B0 F2 B1 B2'

Pure Python: no JAX import.
"""
from __future__ import annotations

import enum
import operator
from dataclasses import dataclass

from autopar.core.enums import Schedule
from autopar.core.errors import InvalidArgumentError


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
    BACKWARD = "backward"


@dataclass(frozen=True, slots=True)
class Task:
    """One forward or backward of one microbatch on one stage.

        >>> str(Task(Phase.BACKWARD, stage=1, microbatch=3))
        'B3'
    """
    phase: Phase
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{'F' if self.phase is Phase.FORWARD else 'B'}{self.microbatch}"

    def describe(self) -> str:
        """Long form for error messages, e.g. ``B(stage=1, microbatch=3)``."""
        return f"{str(self)[0]}(stage={self.stage}, microbatch={self.microbatch})"


@dataclass(frozen=True, slots=True)
class PipelineSchedule:
    """A clock table: ``clocks[c][s]`` is the task stage ``s`` runs at clock ``c`` (None: idle).

        >>> s = make_schedule(Schedule.GPIPE, 2, 2)
        >>> [[str(t) if t else "." for t in row] for row in s.clocks]
        [['F0', '.'], ['F1', 'F0'], ['.', 'F1'], ['.', 'B0'], ['B0', 'B1'], ['B1', '.']]
    """
    schedule: Schedule
    num_stages: int
    num_microbatches: int
    clocks: tuple[tuple[Task | None, ...], ...]

    @property
    def num_clocks(self) -> int:
        return len(self.clocks)

    @property
    def bubble_fraction(self) -> float:
        """Idle stage-clocks / total stage-clocks (0.0 for an empty table)."""
        total = self.num_clocks * self.num_stages
        if total == 0:
            return 0.0
        idle = sum(1 for row in self.clocks for t in row if t is None)
        return idle / total

    def in_flight(self) -> tuple[int, ...]:
        """Per stage, the most microbatches whose forward ran there and whose backward has not
        yet: the activations that stage must keep alive."""
        live: list[set[int]] = [set() for _ in range(self.num_stages)]
        peak = [0] * self.num_stages
        for row in self.clocks:
            for s, t in enumerate(row):
                if t is None:
                    continue
                if t.phase is Phase.FORWARD:
                    live[s].add(t.microbatch)
                    peak[s] = max(peak[s], len(live[s]))
                else:
                    live[s].discard(t.microbatch)
        return tuple(peak)

    def tasks_of(self, stage: int) -> tuple[Task, ...]:
        """The tasks stage ``stage`` runs, in execution order."""
        stage = _index(stage, "stage", 0)
        if stage >= self.num_stages:
            raise InvalidArgumentError(
                f"stage={stage} is out of range for a schedule with num_stages={self.num_stages}; "
                f"pass a stage in 0..{self.num_stages - 1}.")
        return tuple(row[stage] for row in self.clocks if row[stage] is not None)


def _index(value: object, name: str, minimum: int) -> int:
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


def _check_schedule_enum(schedule: object) -> Schedule:
    if not isinstance(schedule, Schedule):
        choices = ", ".join(f"Schedule.{s.name}" for s in Schedule)
        raise InvalidArgumentError(
            f"schedule={schedule!r} is not a Schedule; pass one of {choices} "
            f"(a string value converts with Schedule(value), e.g. Schedule('1f1b')).")
    return schedule


def _stage_order(schedule: Schedule, stage: int, num_stages: int,
                 num_microbatches: int) -> list[Task]:
    """The order in which one stage wants to run its tasks."""
    F = lambda m: Task(Phase.FORWARD, stage, m)   # noqa: E731
    B = lambda m: Task(Phase.BACKWARD, stage, m)  # noqa: E731
    M = num_microbatches
    if schedule is Schedule.GPIPE:
        return [F(m) for m in range(M)] + [B(m) for m in range(M)]
    warmup = min(num_stages - stage, M)
    order = [F(m) for m in range(warmup)]
    for b, f in enumerate(range(warmup, M)):      # steady state: one backward, one forward
        order += [B(b), F(f)]
    order += [B(b) for b in range(M - warmup, M)]  # cool-down
    return order


def _deps(task: Task, num_stages: int) -> list[Task]:
    s, m = task.stage, task.microbatch
    if task.phase is Phase.FORWARD:
        return [Task(Phase.FORWARD, s - 1, m)] if s > 0 else []
    deps = [Task(Phase.FORWARD, s, m)]
    if s < num_stages - 1:
        deps.append(Task(Phase.BACKWARD, s + 1, m))
    return deps


def make_schedule(schedule: Schedule, num_stages: int, num_microbatches: int) -> PipelineSchedule:
    """Simulate ``schedule`` clock by clock: each stage runs the next task its policy wants if
    every dependency finished at an earlier clock, else idles.

        >>> make_schedule(Schedule.GPIPE, num_stages=4, num_microbatches=8).bubble_fraction
        0.2727272727272727
    """
    schedule = _check_schedule_enum(schedule)
    S = _index(num_stages, "num_stages", 1)
    M = _index(num_microbatches, "num_microbatches", 1)
    orders = [_stage_order(schedule, s, S, M) for s in range(S)]
    cursor = [0] * S
    done: set[Task] = set()
    clocks: list[tuple[Task | None, ...]] = []
    while any(cursor[s] < len(orders[s]) for s in range(S)):
        row: list[Task | None] = [None] * S
        for s in range(S):
            if cursor[s] < len(orders[s]):
                task = orders[s][cursor[s]]
                if all(d in done for d in _deps(task, S)):
                    row[s] = task
                    cursor[s] += 1
        if all(t is None for t in row):  # cannot happen for the built-in policies
            raise AssertionError(f"{schedule} deadlocked at clock {len(clocks)} (S={S}, M={M})")
        done.update(t for t in row if t is not None)  # visible from the next clock on
        clocks.append(tuple(row))
    return PipelineSchedule(schedule, S, M, tuple(clocks))


def check_schedule(s: PipelineSchedule) -> None:
    """Raise InvalidArgumentError naming the first rule ``s`` breaks; return None if it is valid.

    Rules, in the order checked: table shape, task range, one task per stage per clock, task in
    its stage's column, every task exactly once, and the dependencies (F(s, m) after F(s-1, m);
    B(s, m) after F(s, m); B(s, m) after B(s+1, m); each at a strictly earlier clock).

        >>> check_schedule(make_schedule(Schedule.ONE_F_ONE_B, 3, 5))  # valid: returns None
    """
    if not isinstance(s, PipelineSchedule):
        raise InvalidArgumentError(
            f"check_schedule got {type(s).__name__}; pass a PipelineSchedule.")
    _check_schedule_enum(s.schedule)
    S = _index(s.num_stages, "num_stages", 1)
    M = _index(s.num_microbatches, "num_microbatches", 1)
    when: dict[Task, int] = {}
    for c, row in enumerate(s.clocks):
        if len(row) != S:
            raise InvalidArgumentError(
                f"rule 'table shape': clock {c} has {len(row)} entries but num_stages={S}; "
                f"give every clock one entry (a Task or None) per stage.")
        seen: dict[int, Task] = {}
        for col, t in enumerate(row):
            if t is None:
                continue
            if (not isinstance(t, Task) or not isinstance(t.phase, Phase)
                    or not 0 <= t.stage < S or not 0 <= t.microbatch < M):
                raise InvalidArgumentError(
                    f"rule 'task range': clock {c}, stage {col} holds {t!r}; a task needs a Phase, "
                    f"a stage in 0..{S - 1} and a microbatch in 0..{M - 1}.")
            if t.stage in seen:
                raise InvalidArgumentError(
                    f"rule 'one task per stage per clock': stage {t.stage} runs both "
                    f"{seen[t.stage].describe()} and {t.describe()} at clock {c}; "
                    f"move one of them to another clock.")
            seen[t.stage] = t
            if t.stage != col:
                raise InvalidArgumentError(
                    f"rule 'task in its stage's column': {t.describe()} is in column {col} at "
                    f"clock {c}; put it at clocks[{c}][{t.stage}].")
            if t in when:
                raise InvalidArgumentError(
                    f"rule 'exactly once': {t.describe()} runs at clocks {when[t]} and {c}; "
                    f"keep one of them.")
            when[t] = c
    for st in range(S):
        for m in range(M):
            for phase in Phase:
                t = Task(phase, st, m)
                if t not in when:
                    raise InvalidArgumentError(
                        f"rule 'exactly once': {t.describe()} is missing from the schedule; "
                        f"add it at a clock after its dependencies.")
    for t in sorted(when, key=when.__getitem__):
        for d in _deps(t, S):
            if when[d] >= when[t]:
                rule = ("F(s, m) after F(s-1, m)" if t.phase is Phase.FORWARD else
                        "B(s, m) after F(s, m)" if d.phase is Phase.FORWARD else
                        "B(s, m) after B(s+1, m)")
                raise InvalidArgumentError(
                    f"rule '{rule}': {t.describe()} runs at clock {when[t]} but its dependency "
                    f"{d.describe()} runs at clock {when[d]}; run {t.describe()} at a clock "
                    f"after {when[d]}.")
