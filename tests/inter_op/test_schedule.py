"""Tests for autopar.runtime.schedule: GPipe and 1F1B clock tables (pure Python, no JAX); the
chunked and zero-bubble tables are tested in test_schedule_tables.py."""
from __future__ import annotations

import dataclasses
import itertools

import pytest

from autopar.core.errors import InvalidArgumentError
from autopar.runtime import Phase, PipelineSchedule, Schedule, Task, check_schedule, make_schedule

SIZES = list(itertools.product(range(1, 7), range(1, 11)))  # (S, M)
CLASSIC = [Schedule.GPIPE, Schedule.ONE_F_ONE_B]
F = lambda s, m: Task(Phase.FORWARD, s, m)   # noqa: E731
B = lambda s, m: Task(Phase.BACKWARD, s, m)  # noqa: E731


def _with_clocks(sched: PipelineSchedule, rows) -> PipelineSchedule:
    return dataclasses.replace(sched, clocks=tuple(tuple(r) for r in rows))


def _names(tasks) -> list[str]:
    return [str(t) for t in tasks]


@pytest.mark.parametrize("schedule", CLASSIC)
def test_valid_and_exactly_once(schedule):
    for S, M in SIZES:
        s = make_schedule(schedule, S, M)
        check_schedule(s)  # dependency order, exactly once, one task per stage per clock
        tasks = [t for row in s.clocks for t in row if t is not None]
        assert len(tasks) == len(set(tasks)) == 2 * S * M
        for st in range(S):
            assert len(s.tasks_of(st)) == 2 * M
            assert all(t.stage == st for t in s.tasks_of(st))


@pytest.mark.parametrize("schedule", CLASSIC)
def test_clocks_and_bubble_fraction(schedule):
    for S, M in SIZES:
        s = make_schedule(schedule, S, M)
        assert s.num_clocks == 2 * (M + S - 1), (S, M)
        assert s.bubble_fraction == pytest.approx((S - 1) / (M + S - 1)), (S, M)
        assert s.schedule is schedule and s.num_stages == S and s.num_microbatches == M


def test_in_flight():
    for S, M in SIZES:
        assert make_schedule(Schedule.GPIPE, S, M).in_flight() == (M,) * S
        assert make_schedule(Schedule.ONE_F_ONE_B, S, M).in_flight() == tuple(
            min(S - st, M) for st in range(S))


def test_1f1b_order():
    s = make_schedule(Schedule.ONE_F_ONE_B, 4, 8)
    assert _names(s.tasks_of(0)) == ("F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7").split()
    assert _names(s.tasks_of(3)) == ("F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7").split()
    # Few microbatches: warm-up is capped at M.
    assert _names(make_schedule(Schedule.ONE_F_ONE_B, 4, 2).tasks_of(0)) == "F0 F1 B0 B1".split()


def test_gpipe_order_and_table():
    s = make_schedule(Schedule.GPIPE, 3, 4)
    for st in range(3):
        assert _names(s.tasks_of(st)) == "F0 F1 F2 F3 B0 B1 B2 B3".split()
    s = make_schedule(Schedule.GPIPE, 2, 2)
    assert s.clocks == ((F(0, 0), None), (F(0, 1), F(1, 0)), (None, F(1, 1)),
                        (None, B(1, 0)), (B(0, 0), B(1, 1)), (B(0, 1), None))


def test_single_stage_has_no_bubble():
    for schedule in (*CLASSIC, Schedule.ZERO_BUBBLE_H1, Schedule.ZERO_BUBBLE_H2):
        s = make_schedule(schedule, 1, 5)
        assert s.bubble_fraction == 0.0
        assert s.num_clocks == (15 if s.split_backward else 10)


def test_values_are_immutable():
    s = make_schedule(Schedule.GPIPE, 2, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.num_stages = 3  # type: ignore[misc]
    assert make_schedule(Schedule.GPIPE, 2, 2) == s
    assert Schedule("1f1b") is Schedule.ONE_F_ONE_B


# ---- check_schedule on hand-built bad schedules -----------------------------------------------

def test_check_backward_before_forward():
    s = make_schedule(Schedule.GPIPE, 1, 1)
    bad = _with_clocks(s, [(B(0, 0),), (F(0, 0),)])
    with pytest.raises(InvalidArgumentError, match=r"B\(s, m\) after F\(s, m\)"):
        check_schedule(bad)


def test_check_missing_task():
    s = make_schedule(Schedule.ONE_F_ONE_B, 2, 2)
    rows = [list(r) for r in s.clocks]
    rows[-1][0] = None  # drop the last backward of stage 0
    with pytest.raises(InvalidArgumentError, match=r"exactly once.*missing"):
        check_schedule(_with_clocks(s, rows))


def test_check_duplicate_task():
    s = make_schedule(Schedule.GPIPE, 1, 1)
    bad = _with_clocks(s, [(F(0, 0),), (F(0, 0),), (B(0, 0),)])
    with pytest.raises(InvalidArgumentError, match="exactly once"):
        check_schedule(bad)


def test_check_two_tasks_on_one_stage_in_one_clock():
    """A group's column holds one task per clock: a second task of stage 0 in the same clock
    must sit in another group's column, which the column rule rejects."""
    s = make_schedule(Schedule.GPIPE, 2, 1)
    assert s.clocks == ((F(0, 0), None), (None, F(1, 0)), (None, B(1, 0)), (B(0, 0), None))
    bad = _with_clocks(s, [(F(0, 0), B(0, 0)), (None, F(1, 0)), (None, B(1, 0))])
    with pytest.raises(InvalidArgumentError, match="task in its group's column"):
        check_schedule(bad)


def test_check_forward_not_after_previous_stage():
    s = make_schedule(Schedule.GPIPE, 2, 1)
    same_clock = _with_clocks(s, [(F(0, 0), F(1, 0)), (None, B(1, 0)), (B(0, 0), None)])
    with pytest.raises(InvalidArgumentError, match=r"F\(s, m\) after F\(s-1, m\)"):
        check_schedule(same_clock)
    earlier = _with_clocks(s, [(None, F(1, 0)), (F(0, 0), None), (None, B(1, 0)), (B(0, 0), None)])
    with pytest.raises(InvalidArgumentError, match=r"F\(s, m\) after F\(s-1, m\)"):
        check_schedule(earlier)


def test_check_backward_not_after_next_stage():
    s = make_schedule(Schedule.GPIPE, 2, 1)
    bad = _with_clocks(s, [(F(0, 0), None), (None, F(1, 0)), (B(0, 0), B(1, 0))])
    with pytest.raises(InvalidArgumentError, match=r"B\(s, m\) after B\(s\+1, m\)"):
        check_schedule(bad)


def test_check_shape_column_and_range():
    s = make_schedule(Schedule.GPIPE, 2, 1)
    with pytest.raises(InvalidArgumentError, match="table shape"):
        check_schedule(_with_clocks(s, [(F(0, 0),)]))
    with pytest.raises(InvalidArgumentError, match="column"):
        check_schedule(_with_clocks(s, [(None, F(0, 0))]))
    with pytest.raises(InvalidArgumentError, match="task range"):
        check_schedule(_with_clocks(s, [(F(0, 5), None)]))
    with pytest.raises(InvalidArgumentError, match="task range"):
        check_schedule(_with_clocks(s, [("F0", None)]))
    with pytest.raises(InvalidArgumentError, match="PipelineSchedule"):
        check_schedule(s.clocks)  # type: ignore[arg-type]


# ---- argument validation ----------------------------------------------------------------------

@pytest.mark.parametrize("num_stages", [0, -1, 1.5, True, "2", None])
def test_invalid_num_stages(num_stages):
    with pytest.raises(InvalidArgumentError, match="num_stages"):
        make_schedule(Schedule.GPIPE, num_stages, 4)


@pytest.mark.parametrize("num_microbatches", [0, -3, 2.0, False])
def test_invalid_num_microbatches(num_microbatches):
    with pytest.raises(InvalidArgumentError, match="num_microbatches"):
        make_schedule(Schedule.ONE_F_ONE_B, 2, num_microbatches)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", None, 0])
def test_invalid_schedule(schedule):
    with pytest.raises(InvalidArgumentError, match=r"Schedule\.ONE_F_ONE_B"):
        make_schedule(schedule, 2, 4)


def test_invalid_tasks_of_stage():
    s = make_schedule(Schedule.GPIPE, 2, 2)
    with pytest.raises(InvalidArgumentError, match="stage=2"):
        s.tasks_of(2)
    with pytest.raises(InvalidArgumentError, match="stage"):
        s.tasks_of(-1)
    assert issubclass(InvalidArgumentError, ValueError)
