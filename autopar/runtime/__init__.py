"""Pipeline runtime: the executor runs a schedule (which stage runs which microbatch when; the
schedules are planning data in `inter_op.schedule`, re-exported here).

    >>> from autopar.runtime import Schedule, make_schedule
    >>> make_schedule(Schedule.ONE_F_ONE_B, num_stages=4, num_microbatches=8).num_clocks
    22
"""
from __future__ import annotations

from autopar.core.enums import Schedule
from autopar.inter_op.schedule import Phase, PipelineSchedule, Task, make_schedule
from autopar.inter_op.schedule_check import Timeline, check_schedule, simulate

__all__ = ["Schedule", "Phase", "Task", "PipelineSchedule", "make_schedule", "check_schedule",
           "simulate", "Timeline"]
