"""Assemble the intra-op ILP from an OpGraph: variable groups, follow relations, resharding
edges and liveness memory points.

Every tensor belongs to one *group* (an ILP variable) and has one spec per option of that
group. Leaders (inputs, dot_general, conv, gather, scatter, fallbacks) open a group; cheap nodes
follow an operand's group and add their outputs to it.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from autopar.core.graph import (
    InputRole,
    OpGraph,
    OutputPos,
    TensorId,
    TensorKind,
    cheap_source_tensors,
)
from autopar.core.primitives import CONTROL_FLOW, LOOP_EXIT
from autopar.core.spec import Spec, enumerate_specs, num_shards, replicated
from autopar.frontend.loops import stacked_tensors
from autopar.intra_op.copies import Mover, Read
from autopar.intra_op.fallbacks import Fallback, warn_fallback
from autopar.intra_op.follow import FOLLOW_RULES, main_operand
from autopar.intra_op.ilp import IlpEdge, IlpProblem, MemoryPoint
from autopar.intra_op.loops import LOOP_LEADER_RULES, exit_strategies, scaled
from autopar.intra_op.memory import collective_buffers, schedule
from autopar.intra_op.rules import LEADER_RULES, RuleContext, Strategy, replicated_rule


@dataclass(slots=True)
class Built:
    """The ILP and everything needed to read its solution back."""
    problem: IlpProblem
    tensor_group: list[int]
    tensor_specs: list[list[Spec]]          # tensor -> spec per option of its group
    node_group: list[int]
    node_strategies: list[list[Strategy]]   # node -> strategy per option of its group
    group_size: list[int]
    reshard_diag: list[np.ndarray]          # group -> reshard cost charged inside the group
    edges: list[IlpEdge]
    owners: list[tuple[str, int]]           # group -> ("input" | "node" | "const", id)
    constant_tensors: frozenset[int]        # tensors computed from constants alone
    fallbacks: list[Fallback] = field(default_factory=list)
    unmet_pins: tuple[int, ...] = ()        # tensors no option could give the method's sharding
    reads: tuple[Read, ...] = ()            # operand reads a shared copy may serve (`copies`)

    def signatures(self) -> list[tuple]:
        """Per group, what its options are (tied groups must agree option by option)."""
        out = []
        for kind, ident in self.owners:
            if kind == "node":
                out.append(tuple((s.name, s.in_specs, s.out_specs)
                                 for s in self.node_strategies[ident]))
            else:
                out.append(tuple(self.tensor_specs[ident]))
        return out


def option_bytes(graph: OpGraph, tensor_specs, tid: int, mesh_shape) -> np.ndarray:
    """Tensor `tid`'s bytes per device under each option of its group (`tensor_specs[tid]`)."""
    t = graph.tensors[tid]
    return np.array([t.nbytes / num_shards(s, mesh_shape) for s in tensor_specs[tid]])


def expanded_tensors(graph: OpGraph) -> list[bool]:
    """Results of a `broadcast_in_dim` that adds elements (a per-channel vector broadcast
    over the batch): their new dims are whole in every layout of their group, so an
    elementwise node reading one and a full-size tensor follows the full-size tensor."""
    out = [False] * len(graph.tensors)
    for node in graph.nodes:
        if node.primitive == "broadcast_in_dim" and node.inputs:
            if graph.tensors[node.inputs[0]].size < graph.tensors[node.outputs[0]].size:
                out[node.outputs[0]] = True
    return out


class _Builder:
    def __init__(self, graph: OpGraph, ctx: RuleContext,
                 input_options: Callable[[int], list[Spec]],
                 unpinned: frozenset[int] = frozenset()):
        self.g, self.ctx = graph, ctx
        self.unpinned = unpinned
        self.input_options = input_options
        n_t = len(graph.tensors)
        self.tensor_group = [-1] * n_t
        self.tensor_specs: list[list[Spec]] = [[] for _ in range(n_t)]
        self.node_group = [-1] * len(graph.nodes)
        self.node_strategies: list[list[Strategy]] = [[] for _ in graph.nodes]
        self.costs: list[np.ndarray] = []
        self.diag: list[np.ndarray] = []
        self.edges: dict[tuple[int, int], np.ndarray] = {}
        self.fallbacks: list[Fallback] = []
        self.owners: list[tuple[str, int]] = []
        self.reshard = Mover(graph, ctx.cost)   # (tid, src, dst) -> seconds, cached
        self.expanded = expanded_tensors(graph)
        self.trips = graph.node_trips()     # runs per step: body operators x trip count
        self._scale = 1                    # the trips of the node being connected
        self._reader: int | None = None    # the node being connected
        self.reads: list[Read] = []        # operand reads a copy may serve (`copies`)
        self.kept: dict[int, np.ndarray] = {}   # group -> the options `restrict` kept

    def new_group(self, k: int, owner: tuple[str, int]) -> int:
        self.owners.append(owner)
        self.costs.append(np.zeros(k))
        self.diag.append(np.zeros(k))
        return len(self.costs) - 1

    def connect(self, tid: int, group: int, wanted: list[Spec | None]) -> None:
        """Charge moving tensor `tid` into the spec `wanted[a]` for option a of `group`."""
        if all(w is None for w in wanted):
            return
        gu = self.tensor_group[tid]
        specs = self.tensor_specs[tid]
        if gu == group:
            self.diag[group] += self._scale * np.array([self.reshard(tid, specs[a], w)
                                                        for a, w in enumerate(wanted)])
            return
        mat = self._scale * self.reshard.matrix(tid, specs, wanted)
        if not mat.any():
            return
        key = (gu, group)
        self.edges[key] = self.edges.get(key, 0) + mat
        if self._reader is not None and self._scale == 1:
            self.reads.append(Read(tensor=tid, group=group, node=self._reader,
                                   wanted=tuple(wanted)))

    # ------------------------------------------------------------------------- tensors
    def add_sources(self) -> None:
        for tid, t in enumerate(self.g.tensors):
            if t.kind == TensorKind.CONST:
                g = self.new_group(1, ("const", tid))
                self.tensor_group[tid], self.tensor_specs[tid] = g, [replicated(t.rank)]
        for tid in self.g.inputs:
            opts = self.input_options(tid)
            g = self.new_group(len(opts), ("input", tid))
            self.tensor_group[tid], self.tensor_specs[tid] = g, list(opts)
            t = self.g.tensors[tid]
            if t.role == InputRole.BATCH:
                # A new batch is written to every device each step: its bytes per device.
                bw = self.ctx.cost.mesh.hbm_bandwidth_bytes_per_s
                self.costs[g] += [t.nbytes / num_shards(s, self.ctx.mesh_shape) / bw
                                  for s in opts]

    # --------------------------------------------------------------------------- nodes
    def add_node(self, node, cheap: list[bool]) -> None:
        name = node.primitive
        if name == LOOP_EXIT:        # joins its carry-in's group (frontend/loops.py)
            carry_in = node.eqn.params["carry_in"]
            return self._finish(node, self.tensor_group[carry_in],
                                exit_strategies(self.tensor_specs[carry_in]))
        follow = FOLLOW_RULES.get(name)
        if follow is not None and node.inputs and node.outputs:
            biggest = max(self.g.tensors[t].size for t in node.inputs)
            pos = main_operand(self.ctx, node, lambda t: (
                self._pinned_split(t) and self.g.tensors[t].size == biggest,
                len(self.tensor_specs[t]) > 1, not cheap[t], not self.expanded[t]))
            if pos is not None:
                return self._add_follower(node, follow, pos)
        rule = LEADER_RULES.get(name) or LOOP_LEADER_RULES.get(name)
        strategies = rule(self.ctx, node) if rule is not None else []
        if not strategies:
            strategies = replicated_rule(self.ctx, node)
            if node.inputs and name not in ("iota",):
                if name in CONTROL_FLOW:
                    reason = ("control flow treated conservatively: operands gathered, "
                              "results replicated")
                elif "callback" in name or name == "debug_print":
                    reason = "host callback sees whole values: operands gathered"
                else:
                    reason = (f"no sharding rule for primitive '{name}': operands gathered, "
                              f"results replicated")
                whole = sum(self.g.tensors[t].nbytes for t in (*node.inputs, *node.outputs)
                            if self.g.tensors[t].size > 1)
                self.fallbacks.append(Fallback(node=node.id, primitive=name,
                                               source=node.source, reason=reason,
                                               replicated_bytes=whole,
                                               largest=self._largest(node)))
                warn_fallback(self.fallbacks[-1])
        self._add_leader(node, strategies)

    def _largest(self, node) -> str:
        """The biggest operand or result of `node`, e.g. "operand float32[64, 64]" (with its
        path for an argument leaf)."""
        t, role = max(((self.g.tensors[t], r) for ts, r in ((node.inputs, "operand"),
                                                             (node.outputs, "result"))
                       for t in ts), key=lambda tr: tr[0].nbytes)
        path = f" ({t.path})" if t.kind == TensorKind.INPUT and t.path else ""
        return f"{role} {t.dtype}{list(t.shape)}{path}"

    def _pinned_split(self, tid: int) -> bool:
        """Whether `tid` has one possible sharding and it is split (a pinned ZeRO moment or a
        `sharding_rules` pin): an elementwise update of its size follows it, so the update
        runs on the shard instead of gathering the pinned operand."""
        specs = self.tensor_specs[tid]
        return len(specs) == 1 and any(specs[0]) and tid not in self.unpinned

    def _objective(self, node, s: Strategy) -> float:
        return s.compute_s + s.comm_s

    def _add_leader(self, node, strategies: list[Strategy]) -> None:
        strategies = scaled(strategies, self.trips[node.id])
        g = self.new_group(len(strategies), ("node", node.id))
        self.costs[g] += [self._objective(node, s) for s in strategies]
        self._finish(node, g, strategies)

    def _add_follower(self, node, follow, pos: int) -> None:
        tid = node.inputs[pos]
        g = self.tensor_group[tid]
        by_spec: dict = {}   # options of the followed group often share a spec
        for spec in self.tensor_specs[tid]:
            if spec not in by_spec:
                by_spec[spec] = follow(self.ctx, node, pos, spec)
        strategies = scaled([by_spec[spec] for spec in self.tensor_specs[tid]],
                            self.trips[node.id])
        self.costs[g] += [self._objective(node, s) for s in strategies]
        self._finish(node, g, strategies)

    def _finish(self, node, g: int, strategies: list[Strategy]) -> None:
        self.node_group[node.id] = g
        self.node_strategies[node.id] = strategies
        self._scale, self._reader = self.trips[node.id], node.id   # a body operand is moved
        for i, tid in enumerate(node.inputs):                         # every iteration
            self.connect(tid, g, [s.in_specs[i] for s in strategies])
        self._scale, self._reader = 1, None
        for j, tid in enumerate(node.outputs):
            self.tensor_group[tid] = g
            self.tensor_specs[tid] = [s.out_specs[j] for s in strategies]

    # --------------------------------------------------------------------- method pins
    def restrict(self, allowed: Callable[..., bool]) -> list[int]:
        """Drop the options of every group that give one of its tensors, or want for one of
        its operators' operands, a sharding the method forbids (`allowed(tid, spec,
        wanted)`), so the
        ILP cannot choose them (a batch-split activation is then never gathered either). A
        tensor that no option of its group can satisfy is returned (reported, not enforced)."""
        checks: dict[int, list] = {}     # group -> (tensor, spec per option, wanted)
        for tid, g in enumerate(self.tensor_group):
            if g >= 0:
                checks.setdefault(g, []).append((tid, self.tensor_specs[tid], False))
        for nid, g in enumerate(self.node_group):
            strategies = self.node_strategies[nid]
            if g >= 0:
                for i, tid in enumerate(self.g.nodes[nid].inputs):
                    checks.setdefault(g, []).append(
                        (tid, [s.in_specs[i] for s in strategies], True))
        unmet, keep = set(), {}
        for g, items in checks.items():
            mask = np.ones(len(self.costs[g]), dtype=bool)
            for tid, specs, wanted in items:
                ok = np.array([s is None or allowed(tid, s, wanted) for s in specs])
                if ok.all():
                    continue
                if (mask & ok).any():
                    mask &= ok
                else:
                    unmet.add(tid)
            if not mask.all():
                keep[g] = np.flatnonzero(mask)
        self.kept = keep
        for g, idx in keep.items():
            self.costs[g], self.diag[g] = self.costs[g][idx], self.diag[g][idx]
        for tid, g in enumerate(self.tensor_group):
            if g in keep:
                self.tensor_specs[tid] = [self.tensor_specs[tid][i] for i in keep[g]]
        for nid, g in enumerate(self.node_group):
            if g in keep:
                self.node_strategies[nid] = [self.node_strategies[nid][i] for i in keep[g]]
        for (u, v), mat in list(self.edges.items()):
            if u in keep or v in keep:
                self.edges[(u, v)] = mat[keep.get(u, slice(None))][:, keep.get(v, slice(None))]
        return sorted(unmet)

    # -------------------------------------------------------------------------- memory
    def memory_points(self, budget: float | None) -> list[MemoryPoint]:
        """One constraint per liveness point that could exceed the budget, skipping points
        whose live set only shrank since the previous one (they are dominated). Terms are
        kept per group incrementally, so a point costs O(live groups) to record."""
        if budget is None:
            return []
        g, mesh = self.g, self.ctx.mesh_shape
        events = schedule(g)                  # the events `solve.peak_memory` walks
        tracker = _LiveBytes(self, mesh, events.model)
        for t in events.start:
            tracker.add(t)
        born_x, freed_x = self._collective_events(events)
        points, grown, n = [], True, len(g.nodes)
        for i in range(n + 1):
            if i < n:
                for o in events.born.get(i, ()):
                    tracker.add(o)
                    grown = True
                for key, grp, vec in born_x.get(i, ()):
                    tracker.add_vector(key, grp, vec)
                    grown = True
            if (i in events.freed or i in freed_x or i == n) and grown:
                grown = False
                if tracker.worst > budget:
                    points.append(tracker.point())
            for t in events.freed.get(i, ()):
                tracker.remove(t)
            for key, grp, vec in freed_x.get(i, ()):
                tracker.remove_vector(key, grp, vec)
        return points

    def _collective_events(self, events) -> tuple[dict, dict]:
        """The buffers of the gradient collectives (`memory.collective_buffers`) as
        ({position: [(key, group, bytes per strategy)]}, {position freed after: [...]}),
        only where some strategy of the node's group has one."""
        born: dict[int, list] = {}
        freed: dict[int, list] = {}
        for n, (a, b) in collective_buffers(self.g, events).items():
            grp, strategies = self.node_group[n], self.node_strategies[n]
            for what, at in (("partial_bytes", a), ("collective_out_bytes", b)):
                vec = np.array([getattr(s, what) for s in strategies], float)
                if grp >= 0 and vec.any():
                    born.setdefault(at, []).append(((what, n), grp, vec))
                    freed.setdefault(b, []).append(((what, n), grp, vec))
        return born, freed


class _LiveBytes:
    """Bytes per device of the live tensors, per ILP group (immutable vectors, so a recorded
    point keeps its values while the tracker moves on)."""

    def __init__(self, b: _Builder, mesh, model):
        self.b, self.mesh, self.model, self.size_of = b, mesh, model, model.size_of
        self.live: set[int] = set()
        self.terms: dict[int, np.ndarray] = {}
        self.folded: dict[int, tuple[np.ndarray, float, float]] = {}  # shifted, min, max - min
        self.count: dict[int, int] = {}
        self.const = 0.0
        self.worst = 0.0

    def _set(self, grp: int, vec: np.ndarray | None) -> None:
        """Group `grp`'s summed bytes, kept folded too (the point's form, see
        `folded_point`), so recording a point costs no numpy call per group."""
        if vec is None:
            del self.terms[grp], self.folded[grp]
            return
        lo = float(vec.min())
        self.terms[grp] = vec
        self.folded[grp] = (vec - lo, lo, float(vec.max()) - lo)

    def _bytes(self, tid: int) -> np.ndarray:
        """Per option of the group of `size_of[tid]`, the bytes of `tid`."""
        like = self.size_of[tid]
        vec = option_bytes(self.b.g, self.b.tensor_specs, like, self.mesh)
        ts = self.b.g.tensors
        scale = self.model.nbytes(self.b.g, tid) / ts[like].nbytes
        return vec if scale == 1.0 else vec * scale

    def add(self, tid: int) -> None:
        if tid in self.live:
            return
        self.live.add(tid)
        self._add(self.b.tensor_group[self.size_of[tid]], self._bytes(tid))

    def add_vector(self, key, grp: int, vec: np.ndarray) -> None:
        """A buffer that is no tensor's (`key`), of `vec[i]` bytes under strategy i of `grp`."""
        self.live.add(key)
        self._add(grp, vec)

    def remove_vector(self, key, grp: int, vec: np.ndarray) -> None:
        self.live.discard(key)
        self._drop(grp, vec)

    def _add(self, grp: int, vec: np.ndarray) -> None:
        self.worst += float(vec.max())
        if len(vec) == 1:
            self.const += float(vec[0])
        else:
            self._set(grp, self.terms[grp] + vec if grp in self.terms else vec)
            self.count[grp] = self.count.get(grp, 0) + 1

    def remove(self, tid: int) -> None:
        if tid not in self.live:
            return
        self.live.discard(tid)
        self._drop(self.b.tensor_group[self.size_of[tid]], self._bytes(tid))

    def _drop(self, grp: int, vec: np.ndarray) -> None:
        self.worst -= float(vec.max())
        if len(vec) == 1:
            self.const -= float(vec[0])
        else:
            self.count[grp] -= 1
            if self.count[grp] == 0:
                del self.count[grp]
                self._set(grp, None)
            else:
                self._set(grp, self.terms[grp] - vec)

    def point(self) -> MemoryPoint:
        folded = self.folded.values()
        const = max(self.const, 0.0) + math.fsum(lo for _, lo, _ in folded)
        return MemoryPoint(terms=tuple((g, f[0]) for g, f in self.folded.items() if f[2] > 0),
                           constant_bytes=const, folded=True,
                           max_bytes=const + math.fsum(span for _, _, span in folded))


def build_ilp(graph: OpGraph, ctx: RuleContext, input_options: Callable[[int], list[Spec]],
              output_targets: dict[OutputPos, TensorId], budget: float | None,
              allowed: Callable[..., bool] | None = None,
              output_pins: dict[OutputPos, Spec] | None = None,
              hints: dict[TensorId, Spec] | None = None,
              unpinned: frozenset[int] = frozenset()) -> Built:
    """Build the ILP. `output_targets` maps a flat output position to the tensor id of the
    input it replaces next step (a loop-carried state; `OpGraph.carried_tensors`): the output
    is charged for moving into that input's sharding. `allowed(tid, spec, wanted)`: the
    method's pins on every tensor (see `constraints.method_tensor_rule`); options that break
    them are not offered. `output_pins` fixes the sharding of results (`out_shardings`): the
    result is charged for moving into it (a pin overrides a carried output's target).
    `hints`: shardings the user prefers (`annotations="hint"`): every other option of the
    value pays moving it there. `unpinned`: pinned tensors that an elementwise update of their
    size need not follow (`constraints.update_statistics`)."""
    output_pins = output_pins or {}
    b = _Builder(graph, ctx, input_options, unpinned)
    b.add_sources()
    cheap = cheap_source_tensors(graph)
    for node in graph.nodes:
        b.add_node(node, cheap)
    for pos, spec in output_pins.items():
        out_tid = graph.outputs[pos]
        b.connect(out_tid, b.tensor_group[out_tid], [spec] * len(b.tensor_specs[out_tid]))
    for pos, in_tid in output_targets.items():
        if pos in output_pins:
            continue
        out_tid = graph.outputs[pos]
        g_in = b.tensor_group[in_tid]
        b.connect(out_tid, g_in, list(b.tensor_specs[in_tid]))
    for tid, spec in (hints or {}).items():
        g = b.tensor_group[tid]
        b.diag[g] += np.array([b.reshard(tid, s, spec) for s in b.tensor_specs[tid]])
    stacked = stacked_tensors(graph)
    if stacked:      # a loop's iteration dimension (dim 0 of its xs and ys) is never split
        method_allowed = allowed
        allowed = lambda tid, spec, wanted=False: (
            not (tid in stacked and spec and spec[0])
            and (method_allowed is None or method_allowed(tid, spec, wanted)))
    unmet = b.restrict(allowed) if allowed is not None else []
    node_costs = tuple(c + d for c, d in zip(b.costs, b.diag))
    edges = [IlpEdge(u=u, v=v, cost=m) for (u, v), m in b.edges.items()]
    problem = IlpProblem(node_costs=node_costs, edges=tuple(edges),
                         memory_points=tuple(b.memory_points(budget)),
                         memory_budget_bytes=budget)
    reads = tuple(r if r.group not in b.kept else Read(
        tensor=r.tensor, group=r.group, node=r.node,
        wanted=tuple(r.wanted[i] for i in b.kept[r.group])) for r in b.reads)
    return Built(problem=problem, tensor_group=b.tensor_group, tensor_specs=b.tensor_specs,
                 node_group=b.node_group, node_strategies=b.node_strategies,
                 group_size=[len(c) for c in b.costs], reshard_diag=b.diag, edges=edges,
                 owners=b.owners, fallbacks=b.fallbacks, unmet_pins=tuple(unmet),
                 reads=reads,
                 constant_tensors=frozenset(t for t, c in enumerate(cheap) if c))


def default_input_options(graph: OpGraph, mesh_shape) -> Callable[[int], list[Spec]]:
    def options(tid: int) -> list[Spec]:
        t = graph.tensors[tid]
        if t.dtype in ("key", "token"):
            return [replicated(t.rank)]
        return enumerate_specs(t.shape, mesh_shape)
    return options


__all__ = ["Built", "Fallback", "build_ilp", "option_bytes", "cheap_source_tensors",
           "default_input_options", "InputRole"]
