"""Checking and timing pipeline schedule tables (`inter_op.schedule`).

`check_schedule` verifies any table, built or hand-written, and names the first rule it
breaks; `simulate` times a table with per-task durations (the clock order kept per device
group, each task starting when its group is free and its dependencies have finished), which
is what the cost model compares schedules by.

    >>> from autopar.core.enums import Schedule
    >>> from autopar.inter_op.schedule import make_schedule
    >>> s = make_schedule(Schedule.ONE_F_ONE_B, 4, 8)
    >>> check_schedule(s)                  # valid: returns None
    >>> t = simulate(s, lambda task: 1.0)
    >>> t.makespan, round(t.bubble_fraction, 4)
    (22.0, 0.2727)

Pure Python: no JAX import.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from autopar.core.errors import InvalidArgumentError
from autopar.inter_op.schedule import (
    Phase,
    PipelineSchedule,
    Task,
    check_schedule_enum,
    deps,
    index_arg,
)

_RULES = {(Phase.FORWARD, Phase.FORWARD): "F(s, m) after F(s-1, m)",
          (Phase.BACKWARD, Phase.FORWARD): "B(s, m) after F(s, m)",
          (Phase.BACKWARD, Phase.BACKWARD): "B(s, m) after B(s+1, m)",
          (Phase.WEIGHT, Phase.BACKWARD): "W(s, m) after B(s, m)"}


def check_schedule(s: PipelineSchedule) -> None:
    """Raise InvalidArgumentError naming the first rule ``s`` breaks; return None if valid.

    Rules, in the order checked: table shape (one entry per device group per clock), task
    range, task in its group's column, every task exactly once (F and B of every stage and
    microbatch, W too where the schedule splits the backward, no W where it does not), the
    dependencies (F(s, m) after F(s-1, m); B(s, m) after F(s, m) and B(s+1, m); W(s, m)
    after B(s, m); each at a strictly earlier clock), and the in-flight promise (per group,
    at most `promise[g]` stage-microbatches between their F and their B).
    """
    if not isinstance(s, PipelineSchedule):
        raise InvalidArgumentError(
            f"check_schedule got {type(s).__name__}; pass a PipelineSchedule.")
    check_schedule_enum(s.schedule)
    K = index_arg(s.num_stages, "num_stages", 1)
    M = index_arg(s.num_microbatches, "num_microbatches", 1)
    if s.placement and (len(s.placement) != K or sorted(set(s.placement))
                        != list(range(s.num_groups))):
        raise InvalidArgumentError(
            f"rule 'placement': placement={s.placement} must give each of the {K} stages a "
            f"device group, using groups 0..n-1 with none left empty.")
    G = s.num_groups
    when = _when(s, K, M, G)
    phases = s.phases
    for t in when:
        if t.phase not in phases:
            raise InvalidArgumentError(
                f"rule 'exactly once': {t.describe()} is a "
                f"{'weight-gradient' if t.phase is Phase.WEIGHT else t.phase.value} task, but "
                f"Schedule.{s.schedule.name} runs "
                + ("forwards only (a step without a gradient)" if len(phases) == 1 else
                   "the weight gradient inside B") + ". Fix: drop it"
                + ("." if len(phases) == 1 else ", or build the table for a zero-bubble "
                   "schedule."))
    for k in range(K):
        for m in range(M):
            for phase in phases:
                t = Task(phase, k, m)
                if t not in when:
                    raise InvalidArgumentError(
                        f"rule 'exactly once': {t.describe()} is missing from the schedule; "
                        f"add it at a clock after its dependencies.")
    for t in sorted(when, key=when.__getitem__):
        for d in deps(t, K):
            if when[d] >= when[t]:
                raise InvalidArgumentError(
                    f"rule '{_RULES[(t.phase, d.phase)]}': {t.describe()} runs at clock "
                    f"{when[t]} but its dependency {d.describe()} runs at clock {when[d]}; "
                    f"run {t.describe()} at a clock after {when[d]}.")
    if s.promise:
        for g, (got, most) in enumerate(zip(s.group_in_flight(), s.promise)):
            if got > most:
                raise InvalidArgumentError(
                    f"rule 'in-flight promise': device group {g} holds {got} "
                    f"stage-microbatches between their F and their B at once, but "
                    f"Schedule.{s.schedule.name} promises at most {most} (the activations "
                    f"its memory is planned for). Fix: run a B before the next F there.")


def _when(s: PipelineSchedule, K: int, M: int, G: int) -> dict[Task, int]:
    """Each task's clock, checking shape, range, column and duplicates on the way."""
    when: dict[Task, int] = {}
    for c, row in enumerate(s.clocks):
        if len(row) != G:
            raise InvalidArgumentError(
                f"rule 'table shape': clock {c} has {len(row)} entries but the schedule has "
                f"{G} device group(s); give every clock one entry (a Task or None) per group.")
        for col, t in enumerate(row):
            if t is None:
                continue
            if (not isinstance(t, Task) or not isinstance(t.phase, Phase)
                    or not 0 <= t.stage < K or not 0 <= t.microbatch < M):
                raise InvalidArgumentError(
                    f"rule 'task range': clock {c}, group {col} holds {t!r}; a task needs a "
                    f"Phase, a stage in 0..{K - 1} and a microbatch in 0..{M - 1}.")
            if s.group_of(t.stage) != col:
                raise InvalidArgumentError(
                    f"rule 'task in its group's column': {t.describe()} is in column {col} at "
                    f"clock {c}, but stage {t.stage} lives on group {s.group_of(t.stage)}; "
                    f"put it at clocks[{c}][{s.group_of(t.stage)}].")
            if t in when:
                raise InvalidArgumentError(
                    f"rule 'exactly once': {t.describe()} runs at clocks {when[t]} and {c}; "
                    f"keep one of them.")
            when[t] = c
    return when


@dataclass(frozen=True, slots=True)
class Timeline:
    """A table timed with per-task durations: each task's (start, end) and the group it ran
    on."""
    schedule: PipelineSchedule
    start: dict[Task, float]
    end: dict[Task, float]

    @property
    def makespan(self) -> float:
        return max(self.end.values(), default=0.0)

    def busy(self, group: int) -> float:
        return sum(self.end[t] - self.start[t] for t in self.end
                   if self.schedule.group_of(t.stage) == group)

    @property
    def bubble_fraction(self) -> float:
        """Idle time over all groups / (groups x makespan)."""
        total = self.makespan * self.schedule.num_groups
        if total <= 0:
            return 0.0
        return 1.0 - sum(self.busy(g) for g in range(self.schedule.num_groups)) / total


def simulate(s: PipelineSchedule, duration: Callable[[Task], float],
             transfer: Callable[[Task, Task], float] | None = None) -> Timeline:
    """Time the table: each group runs its tasks in clock order; a task starts when its group
    is free and each dependency has ended (plus `transfer(dep, task)` where given, e.g. the
    activation's send time between groups).

        >>> from autopar.core.enums import Schedule
        >>> from autopar.inter_op.schedule import make_schedule
        >>> one = lambda t: 2.0 if t.phase is Phase.BACKWARD else 1.0
        >>> simulate(make_schedule(Schedule.ONE_F_ONE_B, 2, 2), one).makespan
        9.0
    """
    free = [0.0] * s.num_groups
    start: dict[Task, float] = {}
    end: dict[Task, float] = {}
    for row in s.clocks:
        for g, t in enumerate(row):
            if t is None:
                continue
            ready = free[g]
            for d in deps(t, s.num_stages):
                ready = max(ready, end[d] + (transfer(d, t) if transfer else 0.0))
            start[t] = ready
            end[t] = free[g] = ready + float(duration(t))
    return Timeline(s, start, end)
