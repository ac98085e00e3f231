"""The operator graph: the value the trace pass produces and every later pass reads.

Nodes are jaxpr equations with call-like primitives (`jit`, `custom_jvp_call`,
`custom_vjp_call`, `remat`) inlined; a differentiated `remat` keeps its optimization barrier
(one `optimization_barrier` node per operand, the nodes sharing a `barrier` group, lowered as
one barrier as `jax.checkpoint` lowers it). Tensors are the values between them. The graph
keeps the original equation of every node so that the lowering can re-emit it.
"""
from __future__ import annotations

import enum
import functools
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from autopar.core.errors import AutoparError
from autopar.core.primitives import NOT_FOLDABLE

# Three kinds of integer index a graph's maps use; the aliases name which one a map holds.
TensorId = int       # index into `OpGraph.tensors`
InputPos = int       # flat argument leaf position: index into `OpGraph.inputs`
OutputPos = int      # flat result leaf position: index into `OpGraph.outputs`


@functools.cache
def _itemsize(dtype: str) -> int:
    return np.dtype(dtype).itemsize if dtype not in ("key", "token") else 8


class TensorKind(enum.Enum):
    INPUT = "input"          # a leaf of the function's (non-static) arguments
    CONST = "const"          # a literal or a closed-over array
    INTERMEDIATE = "value"   # produced by a node


class InputRole(enum.Enum):
    PARAM = "param"          # model parameters (float leaves of non-batch arguments)
    OPT_STATE = "opt_state"  # optimizer state (float leaves under an optimizer-like path)
    BATCH = "batch"          # leaves of the arguments named in `batch_argnums`
    OTHER = "other"          # integer / boolean state such as a step counter


@dataclass(frozen=True, slots=True, kw_only=True)
class Tensor:
    id: int
    shape: tuple[int, ...]
    dtype: str
    kind: TensorKind
    producer: int | None = None        # node id for INTERMEDIATE
    input_index: int | None = None     # flat argument index for INPUT
    path: str = ""                     # for INPUT: e.g. "state.params['Dense_0']['kernel']"
    role: InputRole | None = None      # for INPUT
    key_dtype: Any = field(default=None, compare=False)   # dtype "key": the typed key's own
                                                          # dtype (its PRNG implementation)

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return _itemsize(self.dtype)

    @property
    def nbytes(self) -> int:
        return self.size * self.itemsize


@dataclass(frozen=True, slots=True, kw_only=True)
class StageMarker:
    """A `mark_stage_boundary` call: it sat just before node `position`."""
    position: int
    name: str
    backward: bool       # the transposed marker, in the backward pass


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class RematRegion:
    """The nodes of one `jax.checkpoint` in a graph that is differentiated later (a pipeline's
    loss): re-emitted under `jax.checkpoint` with the user's policy, so the gradient taken
    of them recomputes as the user asked."""
    id: int
    policy: Any
    prevent_cse: bool


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Node:
    id: int
    primitive: str
    inputs: tuple[int, ...]            # tensor ids
    outputs: tuple[int, ...]           # tensor ids
    flops: float
    source: str                        # "file:line:col (function)"
    name_stack: str                    # e.g. "transpose(jvp(GPT))/block_0/attn"
    eqn: Any = field(repr=False)       # the jaxpr equation, for params and re-emission
    barrier: int | None = None         # the `remat` whose barrier this node is a part of
    remat: RematRegion | None = None   # the undifferentiated `remat` this node was inlined from


class LoopKind(enum.Enum):
    SCAN = "scan"
    WHILE = "while"
    COND = "cond"


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class LoopRegion:
    """A `scan` / `while` / `cond` whose body operators are nodes of the graph (nodes
    `start` .. `stop - 1`, entry and exit pseudo-nodes included; see `frontend.loops`).
    `body_inputs` / `body_outputs` are the body's tensors in the body jaxpr's order (one
    tuple per branch of a `cond`); `trips` is the trip count the body's costs are multiplied
    by (1 where it is unknown, as for most `while` loops)."""
    id: int
    kind: LoopKind
    eqn: Any = field(repr=False)               # the original equation (params, cond_jaxpr)
    start: int
    stop: int
    trips: int
    outer_inputs: tuple[int, ...]              # tensor ids of the equation's operands
    outer_outputs: tuple[int, ...]             # tensor ids of its results
    entry_nodes: tuple[int, ...]               # per body input: its pseudo-node, -1 if aliased
    exit_nodes: tuple[int, ...]                # per result: its pseudo-node
    body_inputs: tuple[tuple[int, ...], ...]
    body_outputs: tuple[tuple[int, ...], ...]
    body_nodes: tuple[tuple[int, int], ...]    # per body: its (first, stop) node ids


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class OpGraph:
    nodes: tuple[Node, ...]
    tensors: tuple[Tensor, ...]
    inputs: tuple[int, ...]                    # tensor id of each flat argument leaf
    outputs: tuple[int, ...]                   # tensor id of each flat result leaf
    const_values: dict[int, Any] = field(repr=False)   # CONST tensor id -> value
    in_tree: Any = field(repr=False)           # treedef of the (non-static) argument tuple
    out_tree: Any = field(repr=False)
    arg_of_input: tuple[int, ...]              # positional argument index of each flat input
    donated_inputs: frozenset[int]             # flat input positions donated by the user
    carried_outputs: dict[OutputPos, InputPos]  # flat output position -> flat input position
                                               # of the argument leaf it replaces (new state);
                                               # positions, not tensor ids: see carried_tensors
    stage_markers: tuple[StageMarker, ...] = ()  # manual layer boundaries, in order
    trace_time_s: float = 0.0
    regions: tuple[LoopRegion, ...] = ()       # loops and conds, outer before inner

    def carried_tensors(self, carried: dict[OutputPos, InputPos] | None = None,
                        ) -> dict[OutputPos, TensorId]:
        """`carried` (default: `carried_outputs`) with each input position replaced by the
        input's tensor id. Constants are numbered before the inputs, so the two differ as soon
        as the step closes over an array."""
        carried = self.carried_outputs if carried is None else carried
        out = {}
        for pos, src in carried.items():
            tid = self.inputs[src]
            if self.tensors[tid].shape != self.tensors[self.outputs[pos]].shape:
                raise AutoparError(
                    f"carried output {pos} (shape {self.tensors[self.outputs[pos]].shape}) is "
                    f"paired with input {src} of shape {self.tensors[tid].shape}: a carried "
                    f"output must have its input's shape (an internal autopar error; please "
                    f"report it).")
            out[pos] = tid
        return out

    def consumers(self) -> list[list[int]]:
        """For every tensor, the ids of nodes that read it (in order, without repeats)."""
        out: list[list[int]] = [[] for _ in self.tensors]
        for node in self.nodes:
            for t in dict.fromkeys(node.inputs):
                out[t].append(node.id)
        return out

    def last_use(self) -> list[int]:
        """For every tensor, the index of the last node reading it; len(nodes) if it is a
        result or an undonated input (it outlives the step), -1 if never read."""
        end = len(self.nodes)
        last = [-1] * len(self.tensors)
        for node in self.nodes:
            for t in node.inputs:
                last[t] = node.id
        for t in self.outputs:
            last[t] = end
        for pos, t in enumerate(self.inputs):
            if pos not in self.donated_inputs:
                last[t] = end
        for r in self.regions:       # a value read in a loop lives until the loop ends
            for node in self.nodes[r.start:r.stop]:
                for t in node.inputs:
                    produced = self.tensors[t].producer
                    if (produced is None or produced < r.start) and 0 <= last[t] < r.stop - 1:
                        last[t] = r.stop - 1
        return last

    def node_trips(self) -> list[int]:
        """Per node, how many times it runs per step: the product of the trip counts of the
        loops around it (a loop's exit pseudo-nodes count as inside: the carry moves back
        into its sharding every iteration)."""
        trips = [1] * len(self.nodes)
        for r in self.regions:
            if r.trips != 1:
                inside = [n for first, stop in r.body_nodes for n in range(first, stop)]
                for n in inside + list(r.exit_nodes):
                    trips[n] *= r.trips
        return trips

    @property
    def total_flops(self) -> float:
        """FLOPs per step (a loop body's operators once per iteration)."""
        return float(sum(n.flops * k for n, k in zip(self.nodes, self.node_trips())))


def cheap_source_tensors(graph: OpGraph) -> list[bool]:
    """Tensors computed from constants alone (iota, broadcast zeros, a scaled literal...)."""
    cheap = [t.kind == TensorKind.CONST for t in graph.tensors]
    for node in graph.nodes:
        if node.primitive not in NOT_FOLDABLE and all(cheap[i] for i in node.inputs):
            for o in node.outputs:
                cheap[o] = True
    return cheap
