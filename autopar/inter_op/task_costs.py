"""What a pipeline task costs, and what a schedule's table makes of it.

A stage's backward is cut into B (what the activation gradients need: the previous stage
waits for it) and W (the rest of what the parameter gradients need), as the zero-bubble
tables run it (`split_backward`; `lowering.pipeline` lowers each part as an executable). A
stage's time per microbatch (`StageSolution.latency_s`: its forward and backward, with a
call's overhead each) is shared out over F, B and W by their FLOPs (`task_seconds`), and a
schedule is timed by simulating its table with those durations (`schedule_seconds`), so
every schedule is priced by its own order, not by a formula that holds for 1F1B alone.

    >>> from autopar.core.enums import Schedule
    >>> from autopar.inter_op.schedule import make_schedule
    >>> tasks = [TaskSeconds(1.0, 1.0, 1.0, 0.0)] * 4           # 4 stages, unit F, B, W
    >>> schedule_seconds(make_schedule(Schedule.ONE_F_ONE_B, 4, 8), tasks), schedule_seconds(
    ...     make_schedule(Schedule.ZERO_BUBBLE_H1, 4, 8), tasks)
    (33.0, 27.0)
"""
from __future__ import annotations

from dataclasses import dataclass

from autopar.core.graph import OpGraph
from autopar.inter_op.pipeline import LossGraph, StageSlice
from autopar.inter_op.schedule import Phase, PipelineSchedule
from autopar.inter_op.schedule_check import simulate
from autopar.inter_op.stage_solve import stage_backward_split, stage_io


@dataclass(frozen=True, slots=True)
class TaskSeconds:
    """One microbatch's F, B and W on a stage, each with its call's overhead; `call_s` is
    that overhead (a backward run whole is one call: B + W - call_s)."""
    forward: float
    backward: float
    weight: float
    call_s: float

    def of(self, phase: Phase, split: bool) -> float:
        if phase is Phase.FORWARD:
            return self.forward
        if phase is Phase.WEIGHT:
            return self.weight
        return self.backward if split else self.backward + self.weight - self.call_s


def task_seconds(loss: LossGraph, sl: StageSlice, graph: OpGraph, latency_s: float,
                 overhead_s: float) -> TaskSeconds:
    """The stage's `latency_s` (forward + backward of one microbatch, `overhead_s` of it two
    calls' overhead) shared out by the FLOPs of its forward, B and W nodes."""
    parts = stage_backward_split(graph, sl)
    backward = set(parts.input_nodes) | set(parts.weight_nodes)
    flops = lambda ids: sum(graph.nodes[n].flops for n in ids)             # noqa: E731
    f = flops(n for n in range(len(graph.nodes)) if n not in backward)
    b, w = flops(parts.input_nodes), flops(parts.weight_nodes)
    call = overhead_s / 2
    work = max(latency_s - overhead_s, 0.0)
    total = f + b + w
    if total <= 0:
        return TaskSeconds(work / 2 + call, work / 4 + call, work / 4 + call, call)
    sends = bool(stage_io(loss, sl).float_acts)    # a B sending nothing is not dispatched
    return TaskSeconds(work * f / total + call,
                       work * b / total + (call if sends else 0.0),
                       work * w / total + call, call)


def schedule_seconds(table: PipelineSchedule, tasks) -> float:
    """The makespan of `table` for stages with these `TaskSeconds`."""
    split = table.split_backward
    return simulate(table, lambda t: tasks[t.stage].of(t.phase, split)).makespan
