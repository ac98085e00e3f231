"""The temporaries XLA's buffer assignment places in result buffers before the results are
written (`hosted_temporaries`), which the plan's predicted peak leaves out
(`memory.predicted_peak_bytes`). Times are positions in `memory.run_order`; `model` is a
`memory.MemoryModel` and `events` a `memory.Schedule` (not imported: `memory` imports this)."""
from __future__ import annotations

import bisect

from autopar.core.graph import OpGraph


def written_results(graph: OpGraph, model) -> frozenset[int]:
    """The results with a buffer of their own that a node of the step writes (not an argument
    passed through, not a result carried into a donated argument)."""
    inputs = set(graph.inputs)
    return frozenset(t for t in graph.outputs if model.whole[t] and t not in inputs
                     and graph.tensors[t].producer is not None)


def hosted_temporaries(graph: OpGraph, events, per, extra=()) -> frozenset:
    """The temporaries XLA places in a result's buffer before the result is written.

    XLA's buffer assignment gives every result (a live-out value) an allocation for the whole
    step, and then, taking temporaries largest first, puts each into the smallest allocation
    already made that is at least its size and holds no value live at the same time; only the
    rest go to the temporaries' heap (`temp_size_in_bytes`). A result's own value occupies its
    allocation from the node that writes it to the end, so the allocations of the results the
    optimizer writes last hold the activations of the forward and backward. This does the
    same greedy assignment with the bytes per device `per` (live ranges: positions in
    `run_order`); the result buffers are `written_results`. `extra`: more temporaries
    (born, freed after, bytes), e.g. the collectives' buffers (`collective_extra`), hosted
    ones named by their index ("x", i).

    Example (`per` from `tensor_bytes`): the peak without the hosted temporaries:
        >>> hosted = hosted_temporaries(graph, schedule(graph), per)     # doctest: +SKIP
    """
    model = events.model
    results = sorted(written_results(graph, model), key=lambda r: (per[r], r))
    sizes = [per[r] for r in results]
    busy = {r: [(model.pos[graph.tensors[r].producer], len(graph.nodes))] for r in results}
    temps = [(per[t], p, model.end[t], t) for p, ts in events.born.items() for t in ts]
    temps += [(size, a, b, ("x", i)) for i, (a, b, size) in enumerate(extra)]
    hosted = []
    for size, a, b, t in sorted(temps, key=lambda x: (-x[0], x[1], isinstance(x[3], tuple),
                                                      x[3][1] if isinstance(x[3], tuple)
                                                      else x[3])):
        if size <= 0:
            continue
        for r in results[bisect.bisect_left(sizes, size):]:
            if all(b < s or a > e for s, e in busy[r]):
                busy[r].append((a, b))
                hosted.append(t)
                break
    return frozenset(hosted)


__all__ = ["hosted_temporaries", "written_results"]
