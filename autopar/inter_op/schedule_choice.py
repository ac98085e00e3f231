"""Which schedule a pipeline plan runs: each candidate's table timed with the stages' F, B and
W durations (`task_costs`), its stages' memory with the microbatches that table holds, and
the fastest that fits chosen (`Schedule.AUTO`), or the user's schedule priced the same way.

The step time of a table is reported on the scale of the stage DP's (Alpa's
`sum t + (M - 1) max t`, which the stages were chosen by): 1F1B's formula times the table's
simulated makespan over 1F1B's. A 1F1B plan's prediction is thus unchanged, and every other
schedule is priced by its own order.
"""
from __future__ import annotations

from dataclasses import dataclass

from autopar.core.enums import Schedule
from autopar.core.spec import num_shards
from autopar.inter_op.chunks import device_bytes
from autopar.inter_op.pipeline import LossGraph
from autopar.inter_op.schedule import PipelineSchedule, make_schedule, one_executable
from autopar.inter_op.stage_costs import span_held_bytes, static_bytes, working_bytes
from autopar.inter_op.stage_solve import stage_io
from autopar.inter_op.stage_solver import opt_ratio_of
from autopar.inter_op.task_costs import schedule_seconds, task_seconds

# The order ties go: 1F1B first (the least memory in flight), GPipe last.
CANDIDATES = (Schedule.ONE_F_ONE_B, Schedule.ZERO_BUBBLE_H1, Schedule.ZERO_BUBBLE_H2,
              Schedule.GPIPE)


def pick(priced: list[tuple]) -> tuple:
    """The fastest of `priced` ((schedule, predicted seconds, peaks, fits, ...) in candidate
    order; ties to the earlier) that fits memory; the first where none fits (its stages were
    solved for it, so an infeasible plan raised there already).

        >>> h1_too_big = (Schedule.ZERO_BUBBLE_H1, 2.0, (), False)
        >>> pick([(Schedule.ONE_F_ONE_B, 3.0, (), True), h1_too_big])[0]
        <Schedule.ONE_F_ONE_B: '1f1b'>
    """
    fitting = [c for c in priced if c[3]] or priced[:1]
    return min(fitting, key=lambda c: c[1])


def stage_peaks(stages, loss: LossGraph, table) -> list[tuple[float, int]]:
    """(peak bytes, microbatches held) per stage under the schedule `table`: its static bytes
    and what `kept_parts` keeps: a microbatch between its F and its B its whole residuals, one
    between its B and its W (where the table splits the backward) W's part
    (`StageSolution.weight_bytes`), at the table's worst mix of the two
    (`PipelineSchedule.kept_peak`), and the step's results the stage makes from every
    microbatch to the end, where they combine (an eval step's logits); held: `table.held()`."""
    opt_ratio = opt_ratio_of(loss)
    return [(static_bytes(st.solution, opt_ratio, st.zero) + q * st.solution.activation_bytes
             + d * st.solution.weight_bytes + (table.num_microbatches - 1) * r, h)
            for st, (q, d, r), h in zip(stages, kept_parts(stages, loss, table), table.held())]


def device_peaks(stages, loss: LossGraph, table, peaks) -> list[float]:
    """Per stage, the peak of its devices: its own (`peaks`, from `stage_peaks`) where it has
    its device group alone; for stage chunks sharing a group, their held bytes and kept
    results summed, the largest of their working memories (their executables run one at a
    time) and the most their microbatches keep at once (`group_kept_peak`)."""
    groups = [table.group_of(k) for k in range(len(stages))]
    if len(set(groups)) == len(groups):
        return [p for p, _ in peaks]
    sols, opt_ratio, m = [st.solution for st in stages], opt_ratio_of(loss), table.num_microbatches
    return device_bytes(table, [span_held_bytes(sol, opt_ratio, st.zero)
                                + (m - 1) * result_bytes(loss, st)
                                for st, sol in zip(stages, sols)],
                        [working_bytes(sol) for sol in sols],
                        [sol.activation_bytes for sol in sols],
                        [sol.weight_bytes for sol in sols])


def kept_parts(stages, loss: LossGraph, table) -> list[tuple[int, int, float]]:
    """Per stage, what its peak keeps beyond its static bytes: (microbatches in flight,
    deferred W's) at the table's worst mix, and one microbatch's `result_bytes` (the other
    M - 1 microbatches' are kept too)."""
    sols = [st.solution for st in stages]
    kept = table.kept_peak([s.activation_bytes for s in sols], [s.weight_bytes for s in sols])
    return [(q, d, result_bytes(loss, st)) for st, (q, d) in zip(stages, kept)]


def result_bytes(loss: LossGraph, stage) -> float:
    """Per device, one microbatch's share of the step's results (the loss's outputs) that
    `stage` (a `stages.ChosenStage`) makes, in its plan's output shardings."""
    io, finals = stage_io(loss, stage.slice), set(loss.forward.outputs)
    shape, fwd = stage.solution.logical_shape, loss.forward
    return sum(fwd.tensors[t].nbytes / num_shards(spec, shape) for t, spec in zip(
        (*io.float_outputs, *io.int_outputs), stage.solution.out_specs) if t in finals)


@dataclass(frozen=True, slots=True)
class ScheduleChoice:
    schedule: Schedule
    table: PipelineSchedule | None            # its table (None: one executable, no table)
    latency_s: float                          # the chosen table's predicted step
    peaks: tuple[tuple[float, int], ...]      # per stage: (peak bytes, microbatches held)
    candidates: tuple[dict, ...]              # each priced schedule (AUTO: all of them)
    devices: tuple[float, ...] = ()           # per stage: its devices' peak (`device_peaks`)


def choose_schedule(loss: LossGraph, stages, schedule: Schedule, num_microbatches: int,
                    budget: float, compare: tuple[Schedule, ...] = (),
                    tables=make_schedule) -> ScheduleChoice:
    """Price `schedule` (every candidate for `Schedule.AUTO`) for these chosen stages;
    `compare`: other schedules priced on them for the records only (`schedule` is kept: a
    chunk layout's stages sit on the devices its own table places them on). `tables`:
    `make_schedule` or a cache of its tables (layouts of one stage count share them)."""
    m, n = num_microbatches, len(stages)
    lat = [st.solution.latency_s for st in stages]
    formula = sum(lat) + (m - 1) * max(lat)
    if schedule is Schedule.FORWARD:            # forward-only: nothing held, no choice
        table = make_schedule(schedule, n, m)
        peaks = tuple(stage_peaks(stages, loss, table))
        return ScheduleChoice(schedule, table, formula, peaks, (), tuple(p for p, _ in peaks))
    if one_executable(n, m):                    # one loop in one executable: no table
        fixed = Schedule.ONE_F_ONE_B if schedule is Schedule.AUTO else schedule
        peaks = tuple(stage_peaks(stages, loss, make_schedule(fixed, n, m)))
        return ScheduleChoice(fixed, None, formula, peaks, (), tuple(p for p, _ in peaks))
    tasks = [task_seconds(loss, st.slice, st.graph, st.solution.latency_s,
                          st.solution.overhead_s) for st in stages]
    names = CANDIDATES if schedule is Schedule.AUTO else (
        schedule, *(c for c in compare if c is not schedule))
    built = {s: tables(s, n, m) for s in {*names, Schedule.ONE_F_ONE_B}}
    times = {s: schedule_seconds(table, tasks) for s, table in built.items()}
    priced = []
    for s in names:
        peaks = tuple(stage_peaks(stages, loss, built[s]))
        t = formula * times[s] / max(times[Schedule.ONE_F_ONE_B], 1e-30)
        shared = tuple(device_peaks(stages, loss, built[s], peaks))
        priced.append((s, t, peaks, all(p <= budget * (1 + 1e-9) for p in shared), shared))
    best = pick(priced) if schedule is Schedule.AUTO else priced[0]
    records = tuple({"schedule": s.value, "predicted_latency_s": t,
                     "peak_memory_bytes": max(shared), "fits": fits}
                    for s, t, _, fits, shared in priced) if len(priced) > 1 or (
                        schedule is Schedule.AUTO) else ()
    return ScheduleChoice(best[0], built[best[0]], best[1], best[2], records, best[4])
