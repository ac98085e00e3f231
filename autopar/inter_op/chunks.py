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
