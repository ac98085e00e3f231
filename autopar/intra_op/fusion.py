"""Fusion-aware memory traffic: which bytes each node moves once XLA has fused the graph.

A roofline per node that counts every operand and result overcharges elementwise chains: XLA
fuses them into one kernel that reads its external inputs once and writes only the values used
outside it. This pass predicts which tensors XLA *materializes* (writes to memory) and charges
each node only the materialized bytes it reads and writes, so that a chain costs what its
fused kernel does.

Primitives fall into five kinds (`OpKind`):
  - KERNEL: a kernel of its own (dot_general, conv, gather, scatter, sort, loops, ...): it
    reads every operand from memory and writes every result.
  - FUSIBLE: elementwise ops, broadcasts, converts, transposes, slices, concatenates: fused
    with their producers and consumers.
  - REDUCE: reductions: their result is written; they fuse their producers on GPU (XLA's
    input fusions) and read a materialized operand on CPU (XLA:CPU's reduction kernels).
  - ALIAS: reshapes, squeezes, sharding annotations: on a materialized operand they are a
    view (no bytes); inside a fusion they are fused like FUSIBLE.
  - BARRIER: `optimization_barrier` (a `remat` boundary): its operands are materialized, its
    results are views of them.

A tensor made by a fused node is *materialized* (written) when it is a result of the step, is
read by a node that reads memory (a KERNEL, a BARRIER, a CPU reduction), or is a reduction's
result. Kernels of fused nodes then depend on the backend's `FusionStyle` (cluster.py):
  - MULTI_OUTPUT (XLA:GPU, TPU): fused nodes joined by any tensor form one multi-output
    kernel, which reads each materialized operand once and never reads back what it wrote
    (an Adam update reads the gradient once and writes the new moments and parameter);
  - SINGLE_OUTPUT (XLA:CPU): one kernel per fused node that writes a result, made of it and
    the fused producers of its unmaterialized operands (recomputed in every kernel that needs
    them, as XLA duplicates cheap producers); a kernel reads its materialized operands.
A node is charged the materialized results it writes and the materialized operands it is the
first in its kernel to read (a node recomputed in several kernels pays in each). Flops stay
per node, so the cost stays per node and per sharding (both divided by the node's shards).
On XLA:CPU the whole-step bytes of small GPT and MLP Adam steps are 0.92x and 1.13x of
`compiled.cost_analysis()["bytes accessed"]`, where the unfused count was 2.2-2.9x
(tests/intra_op/test_fusion.py).

Pure Python on an `OpGraph`: no JAX import.

Example (`jnp.sum(jnp.exp(x) * y + x)` on 1024 floats: exp, mul, add and reduce_sum are one
kernel that reads x and y once each and writes the sum):
    >>> graph = autopar.frontend.tracer.trace(f, (x, y))           # doctest: +SKIP
    >>> fusion_costs(graph).node_bytes                   # doctest: +SKIP
    (4096.0, 4096.0, 0.0, 4.0)
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from autopar.core.errors import AutoparError
from autopar.core.graph import OpGraph
from autopar.core.primitives import ELEMENTWISE, REDUCTIONS
from autopar.cost.cluster import FusionStyle

# Views of their operand: no bytes on a materialized operand.
_ALIAS = frozenset({
    "reshape", "squeeze", "expand_dims", "sharding_constraint", "reshard", "device_put",
    "mesh_cast", "name", "stop_gradient", "copy", "copy_p",
})
# Fused with neighbours (besides ELEMENTWISE).
_FUSIBLE = frozenset({
    "broadcast_in_dim", "iota", "transpose", "slice", "pad", "concatenate", "rev", "split",
    "select_n", "clamp", "convert_element_type", "integer_pow", "bitcast_convert_type",
    "dynamic_slice",
})
_REDUCE = REDUCTIONS | frozenset({"argmax", "argmin"})


class OpKind(enum.Enum):
    KERNEL = "kernel"
    FUSIBLE = "fusible"
    REDUCE = "reduce"
    ALIAS = "alias"
    BARRIER = "barrier"


def op_kind(primitive: str) -> OpKind:
    """How XLA treats `primitive` when it fuses (see the module docstring).

    Example:
        >>> op_kind("exp").value, op_kind("dot_general").value, op_kind("reshape").value
        ('fusible', 'kernel', 'alias')
    """
    if primitive == "optimization_barrier":
        return OpKind.BARRIER
    if primitive in _ALIAS:
        return OpKind.ALIAS
    if primitive in _REDUCE:
        return OpKind.REDUCE
    if primitive in _FUSIBLE or primitive in ELEMENTWISE:
        return OpKind.FUSIBLE
    return OpKind.KERNEL


@dataclass(frozen=True, slots=True)
class FusionCosts:
    """Per node, the bytes it moves after fusion (`node_bytes`) and the kernel it runs in
    (`group`: the id of the kernel's first node (MULTI_OUTPUT) or of its writing node
    (SINGLE_OUTPUT; a recomputed node: its first kernel); a node outside fusions: its own id);
    per tensor, whether XLA writes it to memory (`materialized`)."""
    node_bytes: tuple[float, ...]
    group: tuple[int, ...]
    materialized: tuple[bool, ...]

    def group_bytes(self) -> dict[int, float]:
        """Bytes each kernel reads and writes: group id -> bytes (a node recomputed in several
        SINGLE_OUTPUT kernels counts toward its first)."""
        out: dict[int, float] = {}
        for node, g in enumerate(self.group):
            out[g] = out.get(g, 0.0) + self.node_bytes[node]
        return out


def _find(parent: list[int], i: int) -> int:
    while parent[i] != i:
        parent[i] = parent[parent[i]]
        i = parent[i]
    return i


def fusion_costs(graph: OpGraph,
                 style: FusionStyle = FusionStyle.MULTI_OUTPUT) -> FusionCosts:
    """The fused memory traffic of every node of `graph` under XLA's fusion `style` (see the
    module docstring)."""
    nodes, tensors = graph.nodes, graph.tensors
    if any(n.id != i for i, n in enumerate(nodes)):
        raise AutoparError("fusion_costs: the graph's node ids are not their positions (an "
                           "internal autopar error; please report it).")
    kinds = [op_kind(n.primitive) for n in nodes]
    if style is FusionStyle.UNFUSED:
        kinds = [OpKind.KERNEL] * len(nodes)
    multi = style is FusionStyle.MULTI_OUTPUT
    # Consumers that read their operands from memory.
    reads_memory = {OpKind.KERNEL, OpKind.BARRIER} | (set() if multi else {OpKind.REDUCE})
    consumers = graph.consumers()
    outputs = set(graph.outputs)
    # Materialized: inputs, constants and kernel results are in memory; a fused node's result
    # is written when the step returns it, a kernel reads it, or a reduction made it.
    materialized = [t.producer is None for t in tensors]
    view = [False] * len(tensors)      # an alias of a materialized tensor: costs no bytes
    for node, kind in zip(nodes, kinds):
        if kind is OpKind.BARRIER or (kind is OpKind.ALIAS
                                      and all(materialized[i] for i in node.inputs)):
            for o in node.outputs:
                materialized[o] = view[o] = True
            continue
        for o in node.outputs:
            materialized[o] = (kind in (OpKind.KERNEL, OpKind.REDUCE) or o in outputs
                               or any(kinds[c] in reads_memory for c in consumers[o]))
    # Fused nodes: the ones that run inside fusions (not kernels, not views of memory).
    fused = [k not in reads_memory and not (n.outputs and all(view[o] for o in n.outputs))
             for n, k in zip(nodes, kinds)]
    node_bytes = [0.0] * len(nodes)
    for node, kind in zip(nodes, kinds):     # kernels: every operand and result
        if kind in reads_memory and kind is not OpKind.BARRIER:
            node_bytes[node.id] = float(sum(tensors[i].nbytes for i in node.inputs) +
                                        sum(tensors[o].nbytes for o in node.outputs))
        elif fused[node.id]:                 # a fused node writes its materialized results
            node_bytes[node.id] = float(sum(tensors[o].nbytes for o in node.outputs
                                            if materialized[o]))
    kernels = _multi_output_kernels if multi else _single_output_kernels
    group = [-1] * len(nodes)
    for root, members in kernels(graph, fused, materialized, consumers):
        # Values made inside the kernel are not read back; the first reader of the others pays.
        seen = {o for n in members for o in nodes[n].outputs}
        for n in members:
            if group[n] < 0:
                group[n] = root
            for i in dict.fromkeys(nodes[n].inputs):
                if materialized[i] and i not in seen:
                    seen.add(i)
                    node_bytes[n] += tensors[i].nbytes
    group = [n if g < 0 else g for n, g in enumerate(group)]
    return FusionCosts(node_bytes=tuple(node_bytes), group=tuple(group),
                       materialized=tuple(materialized))


def _multi_output_kernels(graph: OpGraph, fused: list[bool], materialized: list[bool],
                          consumers: list[list[int]]) -> list[tuple[int, list[int]]]:
    """MULTI_OUTPUT: fused nodes joined by any tensor (materialized or not) are one kernel,
    as XLA:GPU's multi-output fusion merges siblings and producer-consumer pairs: each
    materialized operand is read once per kernel. Returns (its first node, its nodes)."""
    parent = list(range(len(graph.nodes)))
    for node in graph.nodes:
        if fused[node.id]:
            for o in node.outputs:
                for c in consumers[o]:
                    if fused[c]:
                        parent[_find(parent, c)] = _find(parent, node.id)
    members: dict[int, list[int]] = {}
    for node in graph.nodes:
        if fused[node.id]:
            members.setdefault(_find(parent, node.id), []).append(node.id)
    return [(m[0], m) for m in members.values()]


def single_output_kernels(graph: OpGraph, fused: list[bool], materialized: list[bool],
                          ) -> list[tuple[int, list[int]]]:
    """XLA:CPU's kernels given which nodes run fused and which tensors are written (see
    `_single_output_kernels`): (the writing node, its nodes) per kernel."""
    return _single_output_kernels(graph, fused, materialized, None)


def _single_output_kernels(graph: OpGraph, fused: list[bool], materialized: list[bool],
                           consumers: list[list[int]] | None) -> list[tuple[int, list[int]]]:
    """SINGLE_OUTPUT: one kernel per fused node that writes a result: it and, recursively, the
    fused producers of its unmaterialized operands (recomputed in every kernel that needs
    them, as XLA:CPU duplicates cheap producers). Returns (the writing node, its nodes)."""
    return [(node.id, kernel_members(graph, fused, materialized, node.id))
            for node in graph.nodes
            if fused[node.id] and any(materialized[o] for o in node.outputs)]


def kernel_members(graph: OpGraph, fused: list[bool], materialized: list[bool],
                   node: int) -> list[int]:
    """The nodes a SINGLE_OUTPUT kernel that computes node `node` runs: it and, recursively,
    the fused producers of its unmaterialized operands (sorted)."""
    nodes, tensors = graph.nodes, graph.tensors
    members, stack = {node}, [node]
    while stack:
        for i in nodes[stack.pop()].inputs:
            p = tensors[i].producer
            if not materialized[i] and p is not None and fused[p] and p not in members:
                members.add(p)
                stack.append(p)
    return sorted(members)


__all__ = ["FusionCosts", "OpKind", "fusion_costs", "kernel_members", "op_kind",
           "single_output_kernels"]


def threefry_words(graph: OpGraph) -> dict[int, float]:
    """Per result of a threefry `random_bits`, the bytes XLA keeps per byte of it. JAX's
    partitionable threefry computes two uint32 words per element (`threefry2x32`, a while
    loop XLA does not fuse) and combines them (a xor for 32-bit bits, a shift and or for
    64-bit) in an elementwise op that XLA fuses into every reader. So wherever the bits are
    kept, both words are: 8 bytes per element, whatever the bit width. Measured on a 4-block
    NNX MLP with dropout (2x4, memory-minimizing XLA:CPU scheduler): the two words of each
    block's bits (`while.N{1}`, `while.N{2}`, u32[4,32,64]) are live at the backward's peak,
    where the dropout's select reads them."""
    out = {}
    for node in graph.nodes:
        if node.primitive == "random_bits" and node.outputs and node.eqn is not None \
                and node.eqn.invars and "fry" in str(getattr(node.eqn.invars[0].aval, "dtype", "")):
            t = graph.tensors[node.outputs[0]]
            out[t.id] = 8.0 / np.dtype(t.dtype).itemsize
    return out
