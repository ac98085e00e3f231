"""The memory model: which tensors of a step hold a buffer of their own, and for how long.

The predicted peak per device (`solve.peak_memory`) and the ILP's memory points
(`build._Builder.memory_points`) both walk the graph's node order with this model, so the ILP
decides with the same bytes the plan reports. It follows what XLA's buffer assignment does
(`compiled.memory_analysis()`: arguments + outputs + temp - aliased), as read off the buffer
assignments of the models in `models/` (benchmarks/memory.py, benchmarks/memory_notes.md):

  - Arguments and results have buffers for the whole step (XLA reports them apart from its
    temporaries); a result carried into a donated argument shares that argument's buffer.
  - A temporary has a buffer only if XLA writes it to memory: the fusion model
    (`fusion.fusion_costs`, XLA:CPU's single-output style) decides, plus the expensive
    elementwise values (exp, tanh, ...) that several kernels read: XLA does not duplicate
    them into each kernel but writes them once (`EXPENSIVE`).
  - A buffer lives until the last kernel that reads it, directly or through the fused
    values computed from it: a forward value that only feeds a fused elementwise chain whose
    end the backward reads lives until that backward kernel (`end`).
  - Views (reshapes of a materialized value, `optimization_barrier` results) share their
    operand's buffer and keep it alive; a fused elementwise result with the bytes of a
    temporary operand that dies at that node, and a scatter / dynamic-update-slice result,
    take their operand's buffer over (in place).
  - A value computed from constants alone (zeros to scatter into) has no sharding of its
    own in the plan (XLA places it like its consumer): it counts at its consumer's result's
    sharding (`size_of`).
  - A result's buffer holds temporaries of at most its size before the result is written
    (`hosted_temporaries`): `predicted_peak_bytes`, what a plan reports, leaves them out;
    `peak_bytes`, which the ILP's memory points count, does not (it depends on the
    shardings of both, which linear memory rows cannot express), so it bounds the prediction.

The rules depend on the graph only (not on the shardings), so the model is one per graph;
sizes per device come from the specs (`tensor_bytes`).

Example (`y = exp(x) * 2; z = y @ w`): `exp(x)` is fused into the multiply, whose result is
read by the matmul and so materialized; it is counted, `exp(x)` is not:
    >>> model = memory_model(graph)                           # doctest: +SKIP
    >>> [t.id for t in graph.tensors if model.counted[t.id]]  # doctest: +SKIP
"""
from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict
from dataclasses import dataclass

from autopar.core.graph import OpGraph, TensorKind, cheap_source_tensors
from autopar.core.spec import normalize, num_shards
from autopar.cost.cluster import FusionStyle
from autopar.frontend.loops import stacks_born_early
from autopar.intra_op.dot_copies import recomputed_in_copies
from autopar.intra_op.fusion import (
    OpKind,
    fusion_costs,
    kernel_members,
    op_kind,
    single_output_kernels,
    threefry_words,
)
from autopar.intra_op.hosting import hosted_temporaries
from autopar.intra_op.phases import run_order, tail_nodes

# Elementwise primitives XLA's fusion does not duplicate into several consumers (its
# `IsExpensive`): a fused value of one of them read by two or more kernels is written once.
EXPENSIVE = frozenset({"exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic", "erf",
                       "erf_inv", "erfc", "pow", "rsqrt", "sqrt", "cbrt", "atan2", "div",
                       "rem", "lgamma", "digamma", "tan"})
# Kernels that update their first operand in place when it dies there.
IN_PLACE = frozenset({"scatter", "scatter-add", "scatter_add", "scatter-mul", "scatter_mul",
                      "scatter-min", "scatter-max", "dynamic_update_slice"})


@dataclass(frozen=True, slots=True)
class MemoryModel:
    """Per tensor: `whole` (an argument or a result: live for the whole step), `counted` (a
    temporary with a buffer of its own from its producer on), `end` (the position after which
    a counted tensor's buffer is freed) and `size_of` (the tensor whose sharding sets its bytes
    per device: itself, or for a value computed from constants, its consumer's result)."""
    whole: tuple[bool, ...]
    counted: tuple[bool, ...]
    end: tuple[int, ...]
    size_of: tuple[int, ...]
    pos: tuple[int, ...]                 # per node, its position in `run_order`
    late: tuple[tuple[int, int], ...] = ()     # (tensor, node): written just before that
                                         # node, not at its producer (`dot_copies`)
    written: dict[int, float] = dataclasses.field(default_factory=dict)   # tensor -> the
                                         # bytes XLA keeps per byte of it (`threefry_words`)

    def nbytes(self, graph: OpGraph, tid: int) -> float:
        """The bytes XLA keeps for tensor `tid` (whole, unsharded)."""
        return graph.tensors[tid].nbytes * self.written.get(tid, 1.0)


def _cheap(graph: OpGraph) -> list[bool]:
    return cheap_source_tensors(graph)


def _sized_like(graph: OpGraph, consumers: list[list[int]]) -> list[int]:
    """Per tensor, the tensor whose sharding sets its bytes (see `MemoryModel.size_of`)."""
    size_of = list(range(len(graph.tensors)))
    for t, cheap in enumerate(_cheap(graph)):
        if not cheap or graph.tensors[t].kind == TensorKind.CONST:
            continue
        for c in consumers[t]:
            same = [o for o in graph.nodes[c].outputs
                    if graph.tensors[o].nbytes == graph.tensors[t].nbytes]
            if same:
                size_of[t] = same[0]
                break
    # follow chains (a broadcast of a cheap value sized like a cheap value ...)
    for t in range(len(size_of)):
        seen = 0
        while size_of[size_of[t]] != size_of[t] and seen < 64:
            size_of[t] = size_of[size_of[t]]
            seen += 1
    return size_of


def _expensive(graph: OpGraph, n: int) -> bool:
    """Whether XLA's fusion keeps node n's value out of its consumers' kernels (`EXPENSIVE`).
    Not a division by a broadcast (or a smaller tensor): XLA's algebraic simplifier makes it a
    multiplication by the broadcast reciprocal, a cheap op it duplicates into consumers (a
    softmax's `exp / sum[..., None]`: GPT's and Gemma's compiled steps compute the sums'
    reciprocals, `broadcast_divide_fusion`, and multiply)."""
    node = graph.nodes[n]
    if node.primitive not in EXPENSIVE:
        return False
    if node.primitive != "div" or len(node.inputs) != 2 or not node.outputs:
        return True
    divisor = graph.tensors[node.inputs[1]]
    size = math.prod(graph.tensors[node.outputs[0]].shape)
    if math.prod(divisor.shape) < size:
        return False
    src = divisor.producer
    if src is None or src < 0 or graph.nodes[src].primitive != "broadcast_in_dim":
        return True
    return bool(graph.nodes[src].inputs) and math.prod(
        graph.tensors[graph.nodes[src].inputs[0]].shape) >= size


def _materialized(graph: OpGraph, consumers, keep) -> tuple[list[bool], list[bool], list,
                                                            dict]:
    """(materialized, fused, kernels, copies) with the expensive shared values written once;
    `copies`: the cheap values matmuls' operand copies compute (`dot_copies`), and of those,
    the ones in `keep` are written only for their other readers (never, if none)."""
    fc = fusion_costs(graph, FusionStyle.SINGLE_OUTPUT)
    materialized = list(fc.materialized)
    kinds = [op_kind(n.primitive) for n in graph.nodes]
    reads_memory = (OpKind.KERNEL, OpKind.BARRIER, OpKind.REDUCE)
    view = [False] * len(graph.tensors)
    for node, kind in zip(graph.nodes, kinds):
        if kind is OpKind.BARRIER or (kind is OpKind.ALIAS
                                      and all(materialized[i] for i in node.inputs)):
            for o in node.outputs:
                view[o] = True
    fused = [k not in reads_memory and not (n.outputs and all(view[o] for o in n.outputs))
             for n, k in zip(graph.nodes, kinds)]
    copies = recomputed_in_copies(graph, fused, materialized, lambda n: _expensive(graph, n))
    for t in keep:
        materialized[t] = bool(copies[t][1])
    for _ in range(4):                 # writing one value changes the kernels: a few rounds
        kernels = single_output_kernels(graph, fused, materialized)
        in_kernels: dict[int, int] = {}
        for _, members in kernels:
            for n in members:
                in_kernels[n] = in_kernels.get(n, 0) + 1
        shared = [n for n, k in in_kernels.items() if k > 1 and _expensive(graph, n)]
        changed = False
        for n in shared:
            for o in graph.nodes[n].outputs:
                if not materialized[o]:
                    materialized[o] = changed = True
        if not changed:
            break
    return materialized, fused, kernels, copies


def dead_nodes(graph: OpGraph, consumers=None) -> frozenset[int]:
    """Nodes none of whose results reach a result of the step (XLA removes them)."""
    consumers = graph.consumers() if consumers is None else consumers
    needed = [False] * len(graph.tensors)
    for t in graph.outputs:
        needed[t] = True
    dead = set()
    for node in reversed(graph.nodes):
        if any(needed[o] for o in node.outputs) or not node.outputs:
            for i in node.inputs:
                needed[i] = True
        else:
            dead.add(node.id)
    return frozenset(dead)


def memory_model(graph: OpGraph) -> MemoryModel:
    """The buffers of `graph` (see the module docstring); times are positions in
    `run_order(graph)`.

    A cheap value that a matmul reads through an operand copy (`dot_copies`) is computed in
    that copy and, for its other readers, just before the first of them (XLA:CPU keeps no
    buffer of it between); applied where its inputs live that long anyway (a softmax's
    exponentials and sums, which the backward reads), so that recomputing it extends no
    buffer: Gemma's grouped-query attention reads its probabilities so. Or where it reads
    random bits (a dropout mask applied to a cotangent): XLA draws the mask from the bits in
    every copy and keeps the bits, and what the mask is applied to, until the last copy (a
    4-block NNX LM whose blocks the user wrapped in `nnx.remat`, on 2x4: each block's
    threefry words and cotangent live from its recomputation to its weight gradient after
    the backward; predicted 0.83 of compiled without this, 0.94 with it)."""
    model, read_at, copies, recompute = _memory_model(graph, ())
    keep = [t for t, (dots, direct) in copies.items() if dots and (
        any(i in model.written for i in recompute[t]) or all(
            not model.counted[i] or read_at[i] >= max([*dots, *direct[:1]])
            for i in recompute[t]))]
    return _memory_model(graph, keep)[0] if keep else model


def _memory_model(graph: OpGraph, keep) -> tuple[MemoryModel, list[int], dict, dict]:
    """(the model with the rule of `memory_model` applied to the values `keep`; the
    position of each tensor's last read; the rule's candidates: value -> (positions of the
    copies that compute it, positions of its other readers in run order); per candidate, the
    written tensors its kernel reads (only where `keep` is empty: the first pass))."""
    tensors, nodes, last = graph.tensors, graph.nodes, graph.last_use()
    consumers = graph.consumers()
    n_nodes = len(nodes)
    pos = [0] * n_nodes
    for i, n in enumerate(run_order(graph)):
        pos[n] = i
    whole = [t.kind != TensorKind.CONST and last[t.id] >= 0
             and (t.id in graph.inputs or t.id in graph.outputs) for t in tensors]
    donated = {graph.inputs[p] for p in graph.donated_inputs}
    for out_pos, in_pos in graph.carried_outputs.items():
        out, arg = graph.outputs[out_pos], graph.inputs[in_pos]
        if arg in donated and tensors[out].nbytes == tensors[arg].nbytes and out != arg:
            whole[out] = False        # written into the donated argument's buffer
    materialized, fused, kernels, copies = _materialized(graph, consumers, keep)
    dead = dead_nodes(graph, consumers)     # XLA removes them: they read and write nothing
    # A matmul reading a value of `keep` through an operand copy that computes it reads the
    # value's own inputs there (the copy's kernel); the value's other readers read it from a
    # buffer written just before the first of them.
    live = {t: ([d for d in dots if d not in dead],
                sorted((n for n in direct if n not in dead), key=pos.__getitem__))
            for t, (dots, direct) in copies.items()}
    recompute = {} if keep else {   # what the first pass decides `keep` by
        t: [i for n in kernel_members(graph, fused, materialized, tensors[t].producer)
            for i in nodes[n].inputs if materialized[i]] for t in copies}
    late = tuple((t, live[t][1][0]) for t in keep if live[t][1])
    kernels = kernels + [(n, kernel_members(graph, fused, materialized, tensors[t].producer))
                         for t in keep for n in live[t][0] + live[t][1][:1]]
    skip = {(d, t) for t in keep for d in live[t][0]}
    counted = [materialized[t.id] and not whole[t.id] and t.kind != TensorKind.CONST
               and last[t.id] >= 0 and t.id not in graph.outputs and t.producer not in dead
               for t in tensors]
    # When each tensor is read: by a node that reads memory at that node; by a fused node
    # when the kernel it is part of runs (its writing node).
    read_at = [-1] * len(tensors)
    for node in nodes:
        if not fused[node.id] and node.id not in dead:
            for i in node.inputs:
                if (node.id, i) not in skip:
                    read_at[i] = max(read_at[i], pos[node.id])
    in_kernel = [False] * n_nodes
    for root, members in kernels:
        for n in members:
            if n in dead:
                continue
            in_kernel[n] = True
            for i in nodes[n].inputs:
                read_at[i] = max(read_at[i], pos[root], pos[n])
    for node in nodes:                  # fused nodes whose results no kernel writes
        if fused[node.id] and not in_kernel[node.id] and node.id not in dead:
            for i in node.inputs:
                read_at[i] = max(read_at[i], pos[node.id])
    for t in graph.outputs:
        read_at[t] = n_nodes
    owner = list(range(len(tensors)))   # the tensor whose buffer a tensor uses
    for node in nodes:
        kind = op_kind(node.primitive)
        if kind is OpKind.BARRIER:
            for i, o in zip(node.inputs, node.outputs):
                if not counted[o]:
                    continue
                counted[o] = False
                owner[o] = owner[i]
        elif kind is OpKind.ALIAS and all(materialized[i] for i in node.inputs):
            for o in node.outputs:
                if counted[o] and node.inputs:
                    counted[o] = False
                    owner[o] = owner[node.inputs[0]]
        elif kind is OpKind.FUSIBLE or node.primitive in IN_PLACE:
            operands = node.inputs[:1] if node.primitive in IN_PLACE else node.inputs
            free = [i for i in dict.fromkeys(operands)
                    if counted[owner[i]] and owner[i] == i and read_at[i] == pos[node.id]]
            for o in node.outputs:
                donor = next((i for i in free if tensors[i].nbytes == tensors[o].nbytes), None)
                if counted[o] and donor is not None:
                    counted[o] = False
                    free.remove(donor)
                    owner[o] = owner[donor]
    end = [-1] * len(tensors)
    for t in range(len(tensors)):
        if read_at[t] >= 0:
            o = owner[t]
            end[o] = max(end[o], read_at[t])
    for t in range(len(tensors)):      # a counted buffer lives at least at its producer
        if counted[t]:
            made = tensors[t].producer
            end[t] = max(end[t], pos[made] if made is not None else 0)
    return MemoryModel(whole=tuple(whole), counted=tuple(counted), end=tuple(end),
                       size_of=tuple(_sized_like(graph, consumers)), pos=tuple(pos),
                       late=late, written=threefry_words(graph)), read_at, {
        t: ([pos[d] for d in dots], [pos[n] for n in direct]) for t, (dots, direct) in
        live.items()}, recompute


def tensor_bytes(graph: OpGraph, model: MemoryModel, specs, mesh_shape) -> list[float]:
    """Per tensor, its bytes per device under `specs` (0 for constants)."""
    return [0.0 if t.kind == TensorKind.CONST else
            model.nbytes(graph, t.id) / num_shards(specs[model.size_of[t.id]], mesh_shape)
            for t in graph.tensors]


@dataclass(frozen=True, slots=True)
class Schedule:
    """The buffer events over the node order: `start` (tensor ids live from the start: the
    arguments and results), `born[p]` (counted tensors allocated at the node at position p
    of `run_order`: its results, or a loop's stacked ys at the loop's first node) and
    `freed[p]` (freed after it)."""
    model: MemoryModel
    start: tuple[int, ...]
    born: dict[int, tuple[int, ...]]
    freed: dict[int, tuple[int, ...]]


_CACHE: OrderedDict[int, tuple[OpGraph, Schedule]] = OrderedDict()   # the last graphs'


def schedule(graph: OpGraph) -> Schedule:
    """`memory_model(graph)` as allocation events along the node order (see `Schedule`).

    Example: the bytes live at every node, given bytes per tensor `per`:
        >>> s = schedule(graph)                                 # doctest: +SKIP
        >>> live = sum(per[t] for t in s.start)                 # doctest: +SKIP
    """
    hit = _CACHE.get(id(graph))
    if hit is not None and hit[0] is graph:      # peak_memory runs once per plan drawn
        _CACHE.move_to_end(id(graph))
        return hit[1]
    model = memory_model(graph)
    # a loop's stacked ys exist from its first node; values written late (`MemoryModel.late`)
    early = {**stacks_born_early(graph), **dict(model.late)}
    born: dict[int, list[int]] = {}
    freed: dict[int, list[int]] = {}
    for t in graph.tensors:
        if model.counted[t.id]:
            at = early.get(t.id, t.producer)
            born.setdefault(model.pos[at], []).append(t.id)
            freed.setdefault(model.end[t.id], []).append(t.id)
    out = Schedule(model=model, start=tuple(t for t, w in enumerate(model.whole) if w),
                   born={k: tuple(v) for k, v in born.items()},
                   freed={k: tuple(v) for k, v in freed.items()})
    _CACHE[id(graph)] = (graph, out)
    while len(_CACHE) > 8:
        _CACHE.popitem(last=False)
    return out


def collective_buffers(graph: OpGraph, events: Schedule) -> dict[int, tuple[int, int]]:
    """Per node whose gradient collective XLA combines at the end of the backward (a node of
    the tail, `phases.tail_nodes`), the positions in `run_order` (born, freed after) of the
    buffer of partial sums its collective reads: from the node to the combined collective,
    which runs after the last weight-gradient matmul (the tail's last matmul); a tail node
    after that one reduces at its own position. A node's strategy says how many bytes (its
    `partial_bytes`, and its `collective_out_bytes` written at the collective); a node
    outside the tail reduces at once and is not counted (its partial sums are its result).

    XLA:CPU combines every gradient all-reduce into one at the end of the backward (the ZeRO-3
    GPT's `all-reduce.30`: a tuple of all gradients, whole, its operands and results live
    together) and has no reduce-scatter (a reduce-scatter is an all-reduce and a slice).
    XLA:GPU combines them too (its all-reduce / reduce-scatter combiners, by size thresholds)
    and turns an all-reduce feeding a dynamic-slice into a reduce-scatter
    (`ReduceScatterCreator`), whose result is the shard: there only the partial sums count."""
    from autopar.core.primitives import MATMUL_LIKE
    pos = events.model.pos
    tail = tail_nodes(graph)
    dots = [pos[n] for n in tail if graph.nodes[n].primitive in MATMUL_LIKE]
    combined = max(dots, default=-1)
    return {n: (pos[n], max(pos[n], combined)) for n in sorted(tail)}


def _walk(events: Schedule, per, n_nodes: int, extra=()) -> float:
    """The peak of the live bytes along the node order; `extra` (`collective_extra`): buffers
    (born, freed after, bytes) besides the tensors'."""
    born_x: dict[int, float] = {}
    freed_x: dict[int, float] = {}
    for a, b, size in extra:
        born_x[a] = born_x.get(a, 0.0) + size
        freed_x[b] = freed_x.get(b, 0.0) + size
    live = peak = sum(per[t] for t in events.start)
    for p in range(n_nodes):
        live += sum(per[t] for t in events.born.get(p, ())) + born_x.get(p, 0.0)
        peak = max(peak, live)
        live -= sum(per[t] for t in events.freed.get(p, ())) + freed_x.get(p, 0.0)
    return peak


def collective_extra(graph: OpGraph, events: Schedule, collective) -> list[tuple[int, int, float]]:
    """The collectives' buffers (`collective_buffers`) as (born, freed after, bytes) under
    `collective`: per node, (partial_bytes, collective_out_bytes) of its strategy."""
    if collective is None:
        return []
    out = []
    for n, (a, b) in collective_buffers(graph, events).items():
        partial, written = collective[n]
        out += [(at, b, size) for at, size in ((a, partial), (b, written)) if size > 0]
    return out


def peak_bytes(graph: OpGraph, specs, mesh_shape, collective=None) -> float:
    """Max over the node order of the bytes per device of the live buffers (see the module
    docstring), every temporary in a buffer of its own: what `solve.peak_memory` and the ILP's
    memory points count (an upper bound of `predicted_peak_bytes`). `collective`: per node,
    (partial_bytes, collective_out_bytes) of its strategy (`collective_buffers`; None: not
    counted)."""
    events = schedule(graph)
    return _walk(events, tensor_bytes(graph, events.model, specs, mesh_shape), len(graph.nodes),
                 collective_extra(graph, events, collective))


def moves(graph: OpGraph, tid: int, spec, want, mesh_shape, constant=frozenset()) -> bool:
    """Whether reading tensor `tid` (laid out as `spec`) in layout `want` moves data: not for
    a scalar, a constant or a value computed from constants alone (`constant`: XLA
    materializes it in whatever layout a consumer wants), nor between spellings of one
    layout (mesh axes of size 1)."""
    t = graph.tensors[tid]
    return (want is not None and t.rank > 0 and tid not in constant
            and t.kind != TensorKind.CONST
            and normalize(spec, mesh_shape) != normalize(want, mesh_shape))


def moved_operands(graph: OpGraph, specs, node_in_specs, mesh_shape, constant=frozenset()):
    """(tensor, node, operand position, wanted spec) for every operand a plan reads in another
    layout than its own (`moves`), where node `node_in_specs[node]` gives the operand specs
    the node's strategy wants; dead nodes (`dead_nodes`: XLA removes them) are left out."""
    dead = dead_nodes(graph)
    for node in graph.nodes:
        if node.id in dead:
            continue
        wanted = node_in_specs[node.id] if node_in_specs else ()
        for pos, tid in enumerate(node.inputs[:len(wanted)]):
            if moves(graph, tid, specs[tid], wanted[pos], mesh_shape, constant):
                yield tid, node.id, pos, wanted[pos]


def copy_buffers(graph: OpGraph, events: Schedule, reshards, mesh_shape,
                 ) -> list[tuple[int, int, float]]:
    """The buffers of resharded copies as (born, freed after, bytes per device): `reshards`
    gives (tensor, consuming node, wanted spec) for every operand a plan moves to another
    layout (`predict.implied_reshards`). XLA makes one copy per (tensor, layout) (its CSE
    merges the same collective on the same value) and keeps it from its first consumer to its
    last: a forward activation gathered for a matmul and for that matmul's gradient in the
    backward is one buffer live across the whole forward-to-backward span."""
    pos = events.model.pos
    spans: dict[tuple, list[int]] = {}
    for tid, node, want in reshards:
        spans.setdefault((tid, want), []).append(pos[node])
    return [(min(at), max(at), graph.tensors[tid].nbytes / num_shards(want, mesh_shape))
            for (tid, want), at in spans.items()]


def predicted_peak_bytes(graph: OpGraph, specs, mesh_shape, collective=None,
                         reshards=()) -> float:
    """The peak per device XLA's buffer assignment reaches (`memory_analysis()`: arguments +
    outputs + temp - aliased): `peak_bytes` without the temporaries that live in result
    buffers before the results are written (`hosted_temporaries`), plus the resharded copies
    `reshards` (tensor, consuming node, wanted spec) hold (`copy_buffers`). What a plan
    reports (`Plan.peak_memory_bytes`). The ILP's memory points (`peak_bytes`) count no
    copies: a copy's bytes depend on the shardings of two groups (an edge's), which the
    per-group memory rows cannot express.

    Example:
        >>> bound = peak_bytes(graph, specs, (2, 4))                    # doctest: +SKIP
        >>> predicted_peak_bytes(graph, specs, (2, 4)) <= bound         # doctest: +SKIP
        True
    """
    events = schedule(graph)
    per = tensor_bytes(graph, events.model, specs, mesh_shape)
    extra = collective_extra(graph, events, collective) + copy_buffers(
        graph, events, reshards, mesh_shape)
    hosted = hosted_temporaries(graph, events, per, extra)
    for t in hosted:
        if not isinstance(t, tuple):
            per[t] = 0.0
    return _walk(events, per, len(graph.nodes),
                 [x for i, x in enumerate(extra) if ("x", i) not in hosted])
