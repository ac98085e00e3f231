"""Stage chunks sharing device groups: the interleaved 1F1B and ZB-V schedules place
`virtual_stages` pipeline stages on each device group (interleaved: stage k on group k mod G;
ZB-V: stage k and 2G-1-k on group k), so a group holds its stages' parameters, optimizer
state and in-flight activations together (`schedule_choice.device_peaks`).

    >>> chunk_devices(Schedule.INTERLEAVED_1F1B, 4, tuple(range(8)))
    [(0, 1, 2, 3), (4, 5, 6, 7), (0, 1, 2, 3), (4, 5, 6, 7)]
"""
from __future__ import annotations

from autopar.core.enums import Schedule
from autopar.inter_op.schedule import placement_of


def chunk_devices(schedule: Schedule, num_stages: int,
                  device_ids: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Each stage's devices: the mesh's devices split evenly over the groups, every stage on
    its group's."""
    groups = placement_of(schedule, num_stages)
    per = len(device_ids) // (max(groups) + 1)
    return [tuple(device_ids[g * per:(g + 1) * per]) for g in groups]


def device_bytes(table, held, work, whole, part) -> list[float]:
    """Per stage, its devices' bytes under `table` when stage k holds `held[k]` for the whole
    step, needs `work[k]` while one of its executables runs, and keeps `whole[k]` per
    microbatch in flight and `part[k]` per deferred W: a group's stages' held bytes summed,
    the largest of their working memories (one executable runs at a time on a group) and
    the most their microbatches keep at once (`PipelineSchedule.group_kept_peak`). The
    predicted (`schedule_choice.device_peaks`) and the compiled
    (`verify.pipeline_memory_check.compiled_per_device`) peaks of stage chunks alike."""
    kept = table.group_kept_peak(whole, part)
    total, most = [0.0] * table.num_groups, [0.0] * table.num_groups
    groups = [table.group_of(k) for k in range(len(held))]
    for g, h, w in zip(groups, held, work):
        total[g] += h
        most[g] = max(most[g], w)
    return [total[g] + most[g] + kept[g] for g in groups]
