"""Placement of everything outside the pipelined loss: which stage holds each state leaf,
which stage runs each apply-gradient operator, and in what order the per-stage pieces run.

Parameters live on the stage that uses them (their gradients arrive there); an operator runs
on the stage of its largest placed operand (Adam's update of a stage's parameters runs on that
stage); operators with no placed operand run where their first consumer runs. The operators
are then grouped into segments: one segment is a run of operators of one stage whose operands
are all ready, so a global value such as the gradient norm of `clip_by_global_norm` costs one
extra segment per stage (each stage's partial sums, then the norm, then the updates) and stays
exact. Optimizer-state leaves take the sharding of the parameter they are updated with (they
are joined through elementwise operators of equal shape), split over the data axis as well on
a stage with ZeRO (`ChosenStage.zero`; XLA then gathers the updated parameters).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from autopar.core.graph import InputRole, OpGraph, TensorKind
from autopar.core.primitives import ELEMENTWISE
from autopar.core.spec import Spec, replicated
from autopar.inter_op.pipeline import LossGraph
from autopar.inter_op.stage_solve import zero_spec
from autopar.inter_op.stages import ChosenStage

PIPELINE = -1     # Segment.stage of the pipelined loss


@dataclass(frozen=True, slots=True, kw_only=True)
class Segment:
    stage: int                   # PIPELINE for the loss's forward/backward over microbatches
    nodes: tuple[int, ...]       # step node ids, in order
    inputs: tuple[int, ...]      # step tensor ids read (made elsewhere; constants excluded)
    outputs: tuple[int, ...]     # step tensor ids made here and read later or returned


@dataclass(frozen=True, slots=True, kw_only=True)
class Placement:
    input_stage: tuple[int, ...]         # per step input: the stage holding it
    input_spec: tuple[Spec, ...]         # per step input: its sharding on that stage
    output_stage: tuple[int, ...]        # per step output
    output_spec: tuple[Spec | None, ...]  # per step output: pinned sharding (None: as made)
    loss_input_stages: tuple[tuple[int, ...], ...]  # per loss input: stages that read it
    segments: tuple[Segment, ...]


class _UnionFind:
    def __init__(self, n: int):
        self.parent = list(range(n))

    def find(self, x: int) -> int:
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def union(self, a: int, b: int) -> None:
        self.parent[self.find(a)] = self.find(b)


def _known(loss: LossGraph, stages: tuple[ChosenStage, ...]):
    """Stage and spec of the tensors around the gradient node."""
    step = loss.step
    gnode = step.nodes[loss.grad_node]
    readers: list[list[int]] = [[] for _ in gnode.inputs]
    home: dict[int, tuple[int, Spec]] = {}        # loss input -> first reader, its spec there
    grad_spec: dict[int, Spec] = {}               # parameter -> its gradient's spec at home
    producer: dict[int, int] = {}                 # forward tensor -> stage making it
    for st in stages:
        sl, sol = st.slice, st.solution
        for p, g in zip(sl.param_inputs, sol.grad_specs):
            if p not in home:
                grad_spec[p] = g
        for p, spec in (*zip(sl.param_inputs, sol.param_specs),
                        *zip(sl.data_inputs, sol.data_specs)):
            readers[p].append(sl.index)
            home.setdefault(p, (sl.index, spec))
        producer.update((t, sl.index) for t in sl.outputs)
    stage: dict[int, int] = {}
    spec: dict[int, Spec] = {}
    for p, tid in enumerate(gnode.inputs):
        s, sp = home.get(p, (0, replicated(step.tensors[tid].rank)))
        stage.setdefault(tid, s)
        spec.setdefault(tid, sp)
    outputs = loss.forward.outputs
    for pos, tid in enumerate(gnode.outputs):
        if pos < len(outputs):                     # loss and aux: where they are made
            stage[tid] = producer[outputs[pos]]
        else:                                      # a gradient: at its parameter's home
            p = pos - len(outputs)
            stage[tid] = home.get(p, (0, None))[0]
            spec[tid] = grad_spec.get(p) or replicated(step.tensors[tid].rank)
    return stage, spec, tuple(tuple(dict.fromkeys(r)) for r in readers)


def _color(step: OpGraph, grad_node: int, stage: dict[int, int], num_stages: int) -> list[int]:
    """Stage per node (see the module docstring)."""
    color: list[int | None] = [None] * len(step.nodes)
    color[grad_node] = PIPELINE
    placed = dict(stage)
    for node in step.nodes:
        if node.id == grad_node:
            continue
        ins = [t for t in node.inputs if t in placed]
        if ins:
            heaviest = max(ins, key=lambda t: step.tensors[t].nbytes)
            color[node.id] = placed[heaviest]
            for t in node.outputs:
                placed.setdefault(t, color[node.id])
    consumers = step.consumers()
    for node in reversed(step.nodes):
        if color[node.id] is not None:
            continue
        wanted = [stage[t] for t in node.outputs if t in stage]
        later = [color[c] for t in node.outputs for c in consumers[t]
                 if color[c] is not None and color[c] >= 0]
        color[node.id] = (wanted or later or [num_stages - 1])[0]
    return color


def _segments(step: OpGraph, color: list[int], num_stages: int) -> tuple[Segment, ...]:
    done: set[int] = set(step.inputs) | {t.id for t in step.tensors if t.kind == TensorKind.CONST}
    pending = [n.id for n in step.nodes]
    groups: list[tuple[int, list[int]]] = []
    while pending:
        progressed = False
        order = [PIPELINE] + list(range(num_stages))
        for s in order:
            taken = []
            for nid in pending:
                node = step.nodes[nid]
                if color[nid] == s and all(t in done for t in node.inputs):
                    taken.append(nid)
                    done.update(node.outputs)
                    if s == PIPELINE:
                        break
            if taken:
                progressed = True
                groups.append((s, taken))
                taken_set = set(taken)
                pending = [n for n in pending if n not in taken_set]
        assert progressed, "apply-gradient placement found a cycle"
    used_after: list[set[int]] = [set() for _ in groups]
    reads_later: set[int] = set(step.outputs)
    for g in range(len(groups) - 1, -1, -1):
        used_after[g] = set(reads_later)
        for nid in groups[g][1]:
            reads_later.update(step.nodes[nid].inputs)
    out = []
    for g, (s, nids) in enumerate(groups):
        made = {t for n in nids for t in step.nodes[n].outputs}
        reads = {t for n in nids for t in step.nodes[n].inputs
                 if t not in made and step.tensors[t].kind != TensorKind.CONST}
        out.append(Segment(stage=s, nodes=tuple(nids), inputs=tuple(sorted(reads)),
                           outputs=tuple(sorted(made & used_after[g]))))
    return tuple(out)


def place(loss: LossGraph, stages: tuple[ChosenStage, ...],
          pinned: Callable[[int, int], Spec | None] | None = None) -> Placement:
    """Where every state leaf and apply-gradient operator goes. `pinned(tid, stage)`: the
    sharding the method fixes for step input `tid` on that stage's logical mesh (ZeRO's
    sharded optimizer state, a `sharding_rules` entry), or None; it overrides the sharding a
    leaf would take from its parameter."""
    step = loss.step
    num_stages = len(stages)
    stage, spec, readers = _known(loss, stages)
    color = _color(step, loss.grad_node, stage, num_stages)
    consumers = step.consumers()
    # Equal-shape elementwise chains share a sharding (optimizer state follows its parameter).
    uf = _UnionFind(len(step.tensors))
    for node in step.nodes:
        if node.primitive in ELEMENTWISE and node.outputs:
            shape = step.tensors[node.outputs[0]].shape
            for t in (*node.inputs, *node.outputs):
                if step.tensors[t].shape == shape and step.tensors[t].kind != TensorKind.CONST:
                    uf.union(t, node.outputs[0])
    class_spec: dict[int, Spec] = {}
    for t, sp in spec.items():
        class_spec.setdefault(uf.find(t), sp)
    in_stage, in_spec = [], []
    for _pos, tid in enumerate(step.inputs):
        t = step.tensors[tid]
        if tid in stage:
            s = stage[tid]
        else:
            users = [color[c] for c in consumers[tid] if color[c] >= 0]
            s = users[0] if users else 0
        in_stage.append(s)
        sp = spec.get(tid) or (pinned and pinned(tid, s)) or class_spec.get(
            uf.find(tid)) or replicated(t.rank)
        if t.role == InputRole.OPT_STATE and stages[s].zero:   # ZeRO on this stage
            sp = zero_spec(sp, t.shape, stages[s].solution.logical_shape) or sp
        in_spec.append(sp)
    out_stage, out_spec = [], []
    for pos, tid in enumerate(step.outputs):
        src = step.carried_outputs.get(pos)
        if src is not None:
            out_stage.append(in_stage[src])
            out_spec.append(in_spec[src])
        else:
            t = step.tensors[tid]
            made = (color[t.producer] if t.kind == TensorKind.INTERMEDIATE
                    else in_stage[step.inputs.index(tid)] if tid in step.inputs else 0)
            out_stage.append(stage.get(tid, made if made >= 0 else 0))
            out_spec.append(None)
    return Placement(input_stage=tuple(in_stage), input_spec=tuple(in_spec),
                     output_stage=tuple(out_stage), output_spec=tuple(out_spec),
                     loss_input_stages=readers, segments=_segments(step, color, num_stages))
