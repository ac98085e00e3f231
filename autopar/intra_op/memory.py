"""The memory model: which tensors of a step hold a buffer of their own, and for how long.

The predicted peak per device (`solve.peak_memory`) and the ILP's memory points
(`build._Builder.memory_points`) both walk the graph's node order with this model, so the ILP
decides with the same bytes the plan reports. It follows what XLA's buffer assignment does
(`compiled.memory_analysis()`: arguments + outputs + temp - aliased), measured on every model
of `models/` by benchmarks/memory.py:

  - Arguments and results have buffers for the whole step (XLA reports them apart from its
    temporaries: a result's buffer is not reused before it is written), so both count from
    the start; a result that is an argument counts once.
  - A temporary counts from its producer to its last use only if XLA writes it to memory:
    the fusion model (`fusion.fusion_costs`, XLA:CPU's single-output style, which materializes
    more than GPU/TPU fusions) decides; fused elementwise chains, views (reshapes of a
    materialized value) and `optimization_barrier` results hold no buffer of their own.
  - In place: a fused elementwise result that has the bytes of a materialized temporary
    operand dying at that node reuses the operand's buffer (XLA's buffer sharing of
    elementwise fusions): it adds nothing, and the operand's buffer lives on until the
    result's last use (`end`).

The rules depend on the graph only (not on the shardings), so the counted set is one per
graph; sizes per device come from the specs.

Example (`y = exp(x) * 2; z = y @ w`): `exp(x)` is fused into the multiply, whose result is
read by the matmul and so materialized; it is counted, `exp(x)` is not:
    >>> model = memory_model(graph)                           # doctest: +SKIP
    >>> [t.id for t in graph.tensors if model.counted[t.id]]  # doctest: +SKIP
"""
from __future__ import annotations

from dataclasses import dataclass

from ..cluster import FusionStyle
from ..frontend.loops import stacks_born_early
from ..graph import OpGraph, TensorKind
from .fusion import OpKind, fusion_costs, op_kind


@dataclass(frozen=True, slots=True)
class MemoryModel:
    """Per tensor: `whole` (an argument or a result: live for the whole step), `counted` (a
    temporary with a buffer of its own from its producer on) and `end` (the node after which
    a counted tensor's buffer is freed: its last use, or a later one when an in-place result
    took the buffer over)."""
    whole: tuple[bool, ...]
    counted: tuple[bool, ...]
    end: tuple[int, ...]


def memory_model(graph: OpGraph) -> MemoryModel:
    """The buffers of `graph` (see the module docstring)."""
    tensors, last = graph.tensors, graph.last_use()
    inputs = {t for t in graph.inputs if last[t] >= 0}
    whole = [t.kind != TensorKind.CONST and (t.id in inputs or t.id in graph.outputs)
             for t in tensors]
    fc = fusion_costs(graph, FusionStyle.SINGLE_OUTPUT)
    counted = [fc.materialized[t.id] and not whole[t.id] and t.kind != TensorKind.CONST
               and last[t.id] >= 0 for t in tensors]
    end = list(last)
    owner = list(range(len(tensors)))        # the counted tensor whose buffer a tensor uses
    for node in graph.nodes:
        kind = op_kind(node.primitive)
        if kind is OpKind.BARRIER or (kind is OpKind.ALIAS
                                      and all(fc.materialized[i] for i in node.inputs)):
            for o in node.outputs:           # views of their operands
                counted[o] = False
        elif kind is OpKind.FUSIBLE:
            free = [i for i in dict.fromkeys(node.inputs)
                    if counted[i] and last[i] == node.id]
            for o in node.outputs:
                donor = next((i for i in free if tensors[i].nbytes == tensors[o].nbytes), None)
                if counted[o] and donor is not None:
                    counted[o] = False
                    free.remove(donor)
                    owner[o] = owner[donor]
                    end[owner[o]] = max(end[owner[o]], last[o])
    return MemoryModel(whole=tuple(whole), counted=tuple(counted), end=tuple(end))


@dataclass(frozen=True, slots=True)
class Schedule:
    """The buffer events over the node order: `start` (tensor ids live from the start: the
    arguments and results), `born[node]` (counted tensors allocated at that node: its results,
    or a loop's stacked ys at the loop's first node) and `freed[node]` (freed after it)."""
    start: tuple[int, ...]
    born: dict[int, tuple[int, ...]]
    freed: dict[int, tuple[int, ...]]


def schedule(graph: OpGraph) -> Schedule:
    """`memory_model(graph)` as allocation events along the node order (see `Schedule`).

    Example: the bytes live at every node, given bytes per tensor `per`:
        >>> s = schedule(graph)                                 # doctest: +SKIP
        >>> live = sum(per[t] for t in s.start)                 # doctest: +SKIP
    """
    model = memory_model(graph)
    early = stacks_born_early(graph)      # a loop's stacked ys exist from its first node
    born: dict[int, list[int]] = {}
    freed: dict[int, list[int]] = {}
    for t in graph.tensors:
        if model.counted[t.id]:
            born.setdefault(early.get(t.id, t.producer), []).append(t.id)
            freed.setdefault(model.end[t.id], []).append(t.id)
    return Schedule(start=tuple(t for t, w in enumerate(model.whole) if w),
                    born={k: tuple(v) for k, v in born.items()},
                    freed={k: tuple(v) for k, v in freed.items()})
