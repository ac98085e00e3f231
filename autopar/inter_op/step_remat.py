"""Rematerialization as a rewrite of the traced step: works on any gradient the step takes
(`jax.value_and_grad`, `jax.grad`, `nnx.value_and_grad`, `eqx.filter_value_and_grad`,
`autopar.value_and_grad`), since it reads only the graph JAX traced.

The backward pass is the nodes JAX made by transposing the linearized forward (their name
stacks start `transpose(`); the forward is the nodes before it that the backward reads from,
transitively; the residuals are the forward's values the backward reads. The forward is cut
into layers (`forward_layers`); a layer that is rematerialized keeps only its saved values
(its inputs; with `selective` also its matmul and convolution results, as JAX's
`dots_saveable`) and recomputes the rest of its residuals in the backward pass, right before
the first backward node that reads one of them.

The recomputation reads its saved values through one `optimization_barrier`, and that barrier
also takes a value the backward pass has just made (a cotangent of the node it feeds), so XLA
can neither merge the recomputation with the forward (common-subexpression elimination) nor,
on GPU and TPU, run it early. XLA:CPU removes barriers before it schedules, and its default
scheduler would then hoist the recomputation into the forward pass, keeping everything alive
as if nothing were recomputed; there (`ClusterSpec.hoists_recomputation`, `StepRemat.tied`)
each activation the recomputation reads is also tied to that value by arithmetic XLA cannot
fold away (`_tied`): a scalar of the cotangent, its largest element, which a device computes
from its own shard and one all-reduce of 4 bytes. (It used to be the cotangent's first
element, a slice that XLA's partitioner made by gathering the whole sharded cotangent: a
2-block GPT's full recomputation on 2x4 compiled to 11.6 MB under XLA:CPU's
memory-minimizing scheduler, which issued those gathers early and held them, against 7.7 MB
now, 7.1 MB predicted.) Without ties that scheduler runs the 8-block LM of issue 15 1-6% over
its prediction and over its budget, and the default scheduler undoes the recomputation
entirely.

Loops (`scan`, `while`, `cond`) are not cut: a loop's results count as saved values, and its
body is neither recomputed nor rewritten (wrap a scanned block in `jax.checkpoint` / `nn.remat`
to recompute it).

Example:
    >>> bounds = forward_layers(graph, num_layers=4)
    >>> graph2 = rematerialize(graph, StepRemat(boundaries=bounds, choices=(Remat.FULL,) * 4))
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np

from autopar.core import _compat
from autopar.core.enums import Remat
from autopar.core.errors import InvalidArgumentError
from autopar.core.graph import InputRole, Node, OpGraph, Tensor, TensorKind
from autopar.frontend.checks import dtype_name
from autopar.frontend.loops import PSEUDO_PRIMITIVES
from autopar.inter_op.layers import cluster_layers, cut_bytes_from_liveness

SAVED_BY_SELECTIVE = ("dot_general", "conv_general_dilated")
CONCRETE = (Remat.NONE, Remat.SELECTIVE, Remat.FULL)   # cheapest recomputation first


def choices_of(remat: Remat) -> tuple[Remat, ...]:
    """The concrete choices a method's `remat` lets a search take."""
    return CONCRETE if remat == Remat.AUTO else (remat,)


def candidates(num_layers: int) -> list[tuple[Remat, ...]]:
    """The remat plans a search tries, from the least recomputation to the most:
    selective on the first k layers (k = 1..L), then full on the first k with the rest
    selective. Memory falls (about) monotonically along the list, so the search bisects it
    for the first plan that fits."""
    out = []
    for k in range(1, num_layers + 1):
        out.append((Remat.SELECTIVE,) * k + (Remat.NONE,) * (num_layers - k))
    for k in range(1, num_layers + 1):
        out.append((Remat.FULL,) * k + (Remat.SELECTIVE,) * (num_layers - k))
    return out


def is_backward(node: Node) -> bool:
    """A node of a backward pass: JAX made it by transposing a linearized forward."""
    return "transpose(" in node.name_stack


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class StepRemat:
    """A step's rematerialization: its forward (`forward_nodes`) cut into layers at
    `boundaries` (positions in that list, first 0, last its length) and a concrete choice per
    layer."""
    boundaries: tuple[int, ...]
    choices: tuple[Remat, ...]
    tied: bool = True      # activations tied to the cotangent (`ClusterSpec.hoists_recomputation`)

    def to_json(self) -> dict:
        return {"layer_boundaries": list(self.boundaries),
                "layers": [c.value for c in self.choices], "tied": self.tied}

    @classmethod
    def from_json(cls, d: dict) -> StepRemat:
        return cls(boundaries=tuple(int(b) for b in d["layer_boundaries"]),
                   choices=tuple(Remat.of(c) for c in d["layers"]),
                   tied=bool(d.get("tied", True)))


def _in_loops(graph: OpGraph) -> np.ndarray:
    inside = np.zeros(len(graph.nodes), dtype=bool)
    for r in graph.regions:
        inside[r.start:r.stop] = True
    return inside


def _backward_span(graph: OpGraph) -> tuple[int, int] | None:
    """(first, last + 1) node ids of the backward pass, or None when the step takes no
    gradient."""
    ids = [n.id for n in graph.nodes if is_backward(n)]
    return (ids[0], ids[-1] + 1) if ids else None


def forward_nodes(graph: OpGraph) -> tuple[int, ...]:
    """Ids of the step's forward nodes that a rematerialization may recompute, in order: the
    nodes before the backward pass that it reads from, transitively, outside loops, without
    side effects, not already a user's `jax.checkpoint`."""
    span = _backward_span(graph)
    if span is None:
        return ()
    first, stop = span
    loops = _in_loops(graph)
    needed = np.zeros(len(graph.nodes), dtype=bool)
    todo = [t for n in graph.nodes[first:stop] for t in n.inputs]
    while todo:
        t = graph.tensors[todo.pop()]
        p = t.producer
        if t.kind != TensorKind.INTERMEDIATE or p >= first or needed[p]:
            continue
        needed[p] = True
        todo.extend(graph.nodes[p].inputs)
    return tuple(i for i in range(first) if needed[i] and _recomputable(graph.nodes[i],
                                                                          loops[i]))


def _recomputable(node: Node, in_loop: bool) -> bool:
    return not (in_loop or node.primitive in PSEUDO_PRIMITIVES or node.barrier is not None
                or node.remat is not None or getattr(node.eqn, "effects", None)
                or is_backward(node))


def forward_layers(graph: OpGraph, num_layers: int) -> tuple[int, ...] | None:
    """Where each of about `num_layers` layers of the forward starts (positions in
    `forward_nodes(graph)`), plus its length: contiguous layers of about equal FLOPs, cut
    where few bytes cross (as pipeline layers are). None when the step takes no gradient."""
    fwd = forward_nodes(graph)
    if not fwd:
        return None
    index = {nid: i for i, nid in enumerate(fwd)}
    readers = graph.consumers()
    defined, last, sizes = [], [], []
    for node in (graph.nodes[i] for i in fwd):
        for t in node.outputs:
            defined.append(index[node.id])
            last.append(max((index[c] for c in readers[t] if c in index), default=-1))
            sizes.append(graph.tensors[t].nbytes)
    cut = cut_bytes_from_liveness(defined, last, sizes, len(fwd))
    flops = np.array([graph.nodes[i].flops for i in fwd], dtype=float)
    units = cluster_layers(flops, cut, max(1, min(num_layers, len(fwd))))
    return tuple(int(b) for b in units.boundaries)


@dataclasses.dataclass(slots=True)
class _New:
    """A node to insert: `like`'s equation on `inputs`, its results the tensors `outputs`."""
    like: Node
    inputs: list[int]
    outputs: list[int]
    name_stack: str
    barrier: int | None = None


class _Rewrite:
    """The tensors, constants and nodes a rewrite adds to `graph`."""

    def __init__(self, graph: OpGraph):
        self.graph = graph
        self.tensors = list(graph.tensors)
        self.const_values = dict(graph.const_values)
        self.inserts: dict[int, list[_New]] = {}           # before node id -> new nodes
        # (from node id, old -> new tensor, before node id; None: the backward's end)
        self.swaps: list[tuple[int, dict[int, int], int | None]] = []

    def copy(self, like: Tensor) -> int:
        """A new value with `like`'s shape and dtype (`like` may be an input)."""
        return self._add(like.shape, like.dtype, TensorKind.INTERMEDIATE, like.key_dtype)

    def new(self, aval, kind=TensorKind.INTERMEDIATE) -> int:
        dtype = dtype_name(aval)
        return self._add(tuple(int(d) for d in aval.shape), dtype, kind,
                         aval.dtype if dtype == "key" else None)

    def _add(self, shape: tuple[int, ...], dtype: str, kind: TensorKind, key_dtype=None) -> int:
        self.tensors.append(Tensor(id=len(self.tensors), shape=shape, dtype=dtype, kind=kind,
                                   key_dtype=key_dtype))
        return len(self.tensors) - 1

    def splice(self, fun, inputs: list[int], site: Node, name_stack: str, avals=None,
               ) -> tuple[list[_New], list[int]]:
        """Nodes computing `fun` on tensors `inputs` (its equations, lax only), and its
        results' tensors; `avals`: the inputs' abstract values where a tensor's dtype does not
        say it (a PRNG key's implementation)."""
        avals = avals or [jax.ShapeDtypeStruct(self.tensors[t].shape,
                                               np.dtype(self.tensors[t].dtype)) for t in inputs]
        closed = jax.make_jaxpr(fun)(*avals)
        env = dict(zip(closed.jaxpr.invars, inputs))
        for v, c in zip(closed.jaxpr.constvars, closed.consts):
            env[v] = self.const(c, v.aval)

        def read(atom):
            return self.const(atom.val, atom.aval) if isinstance(atom, _compat.Literal) \
                else env[atom]
        new = []
        for eqn in closed.jaxpr.eqns:
            outs = [self.new(v.aval) for v in eqn.outvars]
            new.append(_New(like=dataclasses.replace(site, primitive=eqn.primitive.name,
                                                     flops=0.0, eqn=eqn),
                            inputs=[read(v) for v in eqn.invars], outputs=outs,
                            name_stack=name_stack))
            env.update(zip(eqn.outvars, outs))
        return new, [read(v) for v in closed.jaxpr.outvars]

    def const(self, value, aval) -> int:
        tid = self.new(aval, TensorKind.CONST)
        self.const_values[tid] = value
        return tid


def rematerialize(graph: OpGraph, remat: StepRemat, *, forward_apart: bool = False) -> OpGraph:
    """`graph` with each layer whose choice is not `none` recomputed in the backward pass from
    its saved values (see the module docstring). A layer's value that another layer reads is
    saved, not recomputed; so is one that a forward node outside the layers reads (the loss
    value's path; measured: recomputing those instead compiled the issue-24 LM to 26.6 MB for
    20.7 MB predicted under XLA:CPU's default scheduler, 21.4 MB saving them). With
    `forward_apart` (a pipeline stage, whose forward runs as its own executable) only another
    layer's read saves it.

    Raises:
      InvalidArgumentError: `remat` was made for a step with another forward.
    """
    fwd = forward_nodes(graph)
    if not remat.boundaries or remat.boundaries[-1] != len(fwd) or \
            len(remat.choices) != len(remat.boundaries) - 1:
        raise InvalidArgumentError(
            f"the rematerialization cuts a forward pass of {remat.boundaries[-1:]} operators "
            f"into {len(remat.choices)} layers, but this step's forward pass has {len(fwd)} "
            "operators: it was made for another step. Fix: re-plan.")
    first, stop = _backward_span(graph)
    readers = graph.consumers()
    outer_start = list(range(len(graph.nodes)))
    for r in graph.regions:
        for i in range(r.start, r.stop):
            outer_start[i] = min(outer_start[i], r.start)
    rw = _Rewrite(graph)
    recomputable = set(fwd)
    late_forward = set() if forward_apart else {
        i for i in range(first) if i not in recomputable}
    for layer, choice in enumerate(remat.choices):
        choice = Remat.of(choice)
        if choice == Remat.AUTO:
            raise InvalidArgumentError("rematerialize needs concrete choices, not 'auto'.")
        nodes = [graph.nodes[i] for i in fwd[remat.boundaries[layer]:remat.boundaries[layer + 1]]]
        ids = {n.id for n in nodes}
        made = {t: n for n in nodes for t in n.outputs}
        saved = {t for t, n in made.items()       # kept anyway: another part reads it
                 if any(c not in ids and (c in recomputable or (c in late_forward))
                        for c in readers[t])
                 or (choice == Remat.SELECTIVE and n.primitive in SAVED_BY_SELECTIVE)}
        residuals = [t for t in made if t not in saved
                     and any(first <= c < stop for c in readers[t])]
        if choice == Remat.NONE or not residuals:
            continue
        todo, again = list(residuals), set()
        while todo:
            t = todo.pop()
            if t in made and t not in saved and made[t].id not in again:
                again.add(made[t].id)
                todo.extend(made[t].inputs)
        at = outer_start[min(c for t in residuals for c in readers[t] if first <= c < stop)]
        _recompute(rw, [n for n in nodes if n.id in again], residuals, first, at, -(layer + 1),
                   remat.tied)
    if remat.tied:
        for group in user_remats(graph):
            _tie_user_remat(rw, group, first)
    return _rebuilt(rw, stop)


def user_remats(graph: OpGraph) -> list[list[Node]]:
    """The barrier nodes of each `jax.checkpoint` the user wrote (`nnx.remat`, `nn.remat`,
    `eqx.filter_checkpoint`) whose recomputation the backward pass runs, one list per
    checkpoint: the traced backward reads the checkpoint's saved inputs and the cotangent it
    waits for through one `optimization_barrier` (`tracer.remat_barrier`)."""
    span = _backward_span(graph)
    groups: dict[int, list[Node]] = {}
    for n in graph.nodes[slice(*span) if span else slice(0)]:
        if n.barrier is not None and n.primitive == "optimization_barrier":
            groups.setdefault(n.barrier, []).append(n)
    return list(groups.values())


def _tie_user_remat(rw: _Rewrite, barrier: list[Node], first: int) -> None:
    """A user's checkpoint recomputed as the backward pass needs it, on a backend that would
    run it early (`StepRemat.tied`): JAX's barrier takes the cotangent the recomputation waits
    for, but XLA:CPU drops barriers before it schedules, and its default scheduler then runs
    the recomputations early (`autopar.models.nnx_remat_lm` on 2x4: 13.0 MB compiled without
    the tie, 7.75 MB with it; under the memory-minimizing scheduler 12.86 and 12.99 MB). The
    activations the barrier passes on are tied to that cotangent by `_tied`, as the
    rewrite's own recomputation is, and so are its PRNG keys (`_tied_key`); the barrier
    stays. `first`: the backward pass's first node."""
    graph = rw.graph
    values = [n for n in barrier if _barrable(graph.tensors[n.inputs[0]])
              and _on_device(graph, n.inputs[0])]     # not what a policy offloads
    made_after = [n for n in values if graph.tensors[n.inputs[0]].producer is not None
                  and graph.tensors[n.inputs[0]].producer >= first
                  and np.issubdtype(np.dtype(graph.tensors[n.inputs[0]].dtype), np.floating)]
    keys = [n for n in barrier if graph.tensors[n.inputs[0]].dtype == "key"]
    tied_nodes = [n for n in values if n not in made_after
                  and _activation(graph.tensors[n.inputs[0]])] + keys
    if not made_after or not tied_nodes:
        return
    name = f"remat({barrier[0].name_stack})"
    acts = [n.outputs[0] for n in tied_nodes]
    new, tied = rw.splice(_tied, [made_after[0].outputs[0], *acts], barrier[0], name,
                          avals=[n.eqn.outvars[0].aval for n in (made_after[0], *tied_nodes)])
    at = max(n.id for n in barrier) + 1
    rw.inserts.setdefault(at, []).extend(new)
    rw.swaps.append((at, dict(zip(acts, tied)), len(graph.nodes)))   # the barrier's readers


def _recompute(rw: _Rewrite, recompute: list[Node], residuals: list[int], first: int, at: int,
               group: int, tied: bool) -> None:
    """Insert before node `at` the nodes `recompute` on barred copies of what they read (the
    barrier also takes a value the backward made), with `tied` the activations also tied to
    that value; the backward from `at` on reads the recomputed `residuals`."""
    graph, site = rw.graph, recompute[0]
    inside = {t for n in recompute for t in n.outputs}
    reads = [t for t in dict.fromkeys(t for n in recompute for t in n.inputs)
             if t not in inside and _barrable(graph.tensors[t])]
    tie, routed = _tie(graph, first, at)
    barred = {t: rw.copy(graph.tensors[t]) for t in (*reads, *([tie] if tie is not None
                                                                   else []))}
    name = f"remat({site.name_stack})"
    new = [_New(like=_barrier_like(graph, t, site), inputs=[t], outputs=[barred[t]],
                name_stack=name, barrier=group) for t in barred]
    env = dict(barred)
    acts = [t for t in reads if _activation(graph.tensors[t])]
    if tied and tie is not None and acts:
        tied_nodes, tied = rw.splice(_tied, [barred[tie], *(barred[t] for t in acts)], site,
                                     name)
        new += tied_nodes
        env.update(zip(acts, tied))
    for n in recompute:
        outs = [rw.copy(graph.tensors[t]) for t in n.outputs]
        new.append(_New(like=n, inputs=[env.get(t, t) for t in n.inputs], outputs=outs,
                        name_stack=f"remat({n.name_stack})"))
        env.update(zip(n.outputs, outs))
    rw.inserts.setdefault(at, []).extend(new)
    rw.swaps.append((at, {t: env[t] for t in residuals}, None))
    if routed:
        rw.swaps.append((-at - 1, {tie: barred[tie]}, None))  # node `at` alone reads it barred


def _on_device(graph: OpGraph, t: int) -> bool:
    """Whether tensor `t` lives in device memory, as its producer made it (a remat policy may
    offload residuals to the host, where no arithmetic runs; the barrier's own aval does not
    say so)."""
    p = graph.tensors[t].producer
    node = graph.nodes[p] if p is not None and p >= 0 else None
    outvars = getattr(node.eqn, "outvars", None) if node is not None else None
    if outvars is None or len(outvars) != len(node.outputs):     # a loop's pseudo node
        return True
    aval = outvars[node.outputs.index(t)].aval
    return getattr(getattr(aval, "memory_space", None), "name", "Device") == "Device"


def _tied(cotangent, *activations):
    """`activations` unchanged, bit for bit, yet computed from `cotangent`: each minus
    0 * |c| (+0.0; c the cotangent's largest element if finite, else 0), which XLA cannot
    fold away, so nothing computed from them runs before the cotangent exists. XLA:CPU drops
    optimization barriers before it schedules; this dependency stays. A reduction, not a
    slice: each device reduces its own shard and one scalar all-reduce joins them, where a
    slice of one element made the partitioner gather the whole cotangent."""
    c = jax.lax.reduce_max(cotangent, tuple(range(cotangent.ndim)))
    c = jax.lax.select(jax.lax.is_finite(c), c, jax.lax.full_like(c, 0))
    zero = jax.lax.mul(jax.lax.abs(c), jax.lax.full_like(c, 0))
    return tuple(_tied_key(zero, a) if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key)
                 else jax.lax.sub(a, jax.lax.broadcast_in_dim(
                     jax.lax.convert_element_type(zero, a.dtype), a.shape, ()))
                 for a in activations)


def _tied_key(zero, key):
    """PRNG key `key` unchanged, yet computed from the floating +0.0 `zero`: its words plus
    the bits of +0.0 (which are 0; XLA folds neither the bit cast nor the addition), so
    XLA's common-subexpression elimination cannot merge the random bits drawn from it with
    the forward pass's: a user's checkpointed dropout draws its mask again in the backward
    instead of keeping the forward's bits (two words per element) from the forward to the
    backward's end."""
    data = jax.random.key_data(key)
    bits = jax.lax.bitcast_convert_type(jax.lax.convert_element_type(zero, np.float32),
                                        np.uint32)
    bits = jax.lax.convert_element_type(bits, data.dtype)
    return jax.random.wrap_key_data(
        jax.lax.add(data, jax.lax.broadcast_in_dim(bits, data.shape, ())),
        impl=jax.random.key_impl(key))


def _tie(graph: OpGraph, first: int, at: int) -> tuple[int | None, bool]:
    """(a floating value the backward pass makes just before node `at`, whether `at` reads
    it): the recomputation waits for it."""
    def ok(t):
        return np.issubdtype(np.dtype(graph.tensors[t].dtype), np.floating) and \
            graph.tensors[t].kind == TensorKind.INTERMEDIATE
    node = graph.nodes[at]
    if node.primitive not in PSEUDO_PRIMITIVES and node.barrier is None:
        for t in node.inputs:
            if ok(t) and first <= graph.tensors[t].producer < at:
                return t, True
    for n in reversed(graph.nodes[first:at]):
        if n.outputs and n.primitive not in PSEUDO_PRIMITIVES and ok(n.outputs[0]):
            return n.outputs[0], False
    return None, False


def _barrier_like(graph: OpGraph, t: int, site: Node) -> Node:
    """A one-operand barrier node for tensor `t`, attributed to `site`'s line."""
    tensor = graph.tensors[t]
    aval = jax.ShapeDtypeStruct(tensor.shape, np.dtype(tensor.dtype))
    return dataclasses.replace(site, primitive="optimization_barrier", flops=0.0,
                               eqn=_compat.barrier_eqn(aval, site.eqn.source_info))


def _activation(tensor: Tensor) -> bool:
    """A floating value computed from the batch (tied to the cotangent; parameters are not:
    a copy of a weight would cost its bytes)."""
    return np.issubdtype(np.dtype(tensor.dtype), np.floating) and (
        tensor.kind == TensorKind.INTERMEDIATE or tensor.role == InputRole.BATCH)


def _barrable(tensor: Tensor) -> bool:
    """A value that can pass through a barrier (numbers, not keys or tokens)."""
    return tensor.kind != TensorKind.CONST and tensor.dtype not in ("key", "token")


def _rebuilt(rw: _Rewrite, stop: int) -> OpGraph:
    """The graph with `rw.inserts[i]` placed before node i, renumbered; the backward nodes
    from node `at` on (to the backward's end, or the swap's own end) read `rw.swaps`' new
    tensors (an entry at -at - 1: node `at` alone)."""
    graph, tensors, inserts, swaps = rw.graph, rw.tensors, rw.inserts, rw.swaps
    order: list[Node | _New] = []
    new_id: dict[int, int] = {}
    for node in graph.nodes:
        order.extend(inserts.get(node.id, ()))
        new_id[node.id] = len(order)
        order.append(node)
    new_id[len(graph.nodes)] = len(order)
    out_nodes = []
    for pos, item in enumerate(order):
        if isinstance(item, _New):
            like = item.like
            node = dataclasses.replace(like, id=pos, inputs=tuple(item.inputs),
                                       outputs=tuple(item.outputs), name_stack=item.name_stack,
                                       barrier=item.barrier, remat=None)
        else:
            inputs = item.inputs
            for at, swap, end in swaps:
                if (at >= 0 and at <= item.id < (stop if end is None else end)) or \
                        at == -item.id - 1:
                    inputs = tuple(swap.get(t, t) for t in inputs)
            node = dataclasses.replace(item, id=pos, inputs=inputs, outputs=item.outputs)
        out_nodes.append(node)
        for t in node.outputs:
            tensors[t] = dataclasses.replace(tensors[t], producer=pos)
    regions = tuple(_renumbered(r, new_id, swaps, stop) for r in graph.regions)
    markers = tuple(dataclasses.replace(m, position=new_id[m.position])
                    for m in graph.stage_markers)
    return dataclasses.replace(graph, nodes=tuple(out_nodes), tensors=tuple(tensors),
                               const_values=rw.const_values, regions=regions,
                               stage_markers=markers)


def _renumbered(region, new_id: dict[int, int], swaps, stop: int):
    outer = region.outer_inputs
    for at, swap, end in swaps:
        if at >= 0 and at <= region.start < (stop if end is None else end):
            outer = tuple(swap.get(t, t) for t in outer)
    return dataclasses.replace(
        region, start=new_id[region.start], stop=new_id[region.stop - 1] + 1,
        outer_inputs=outer,
        entry_nodes=tuple(new_id[e] if e >= 0 else e for e in region.entry_nodes),
        exit_nodes=tuple(new_id[e] for e in region.exit_nodes),
        body_nodes=tuple((new_id[a], new_id[b - 1] + 1) for a, b in region.body_nodes))


def stage_remats(method, option, num_stages: int) -> list[tuple[Remat, ...]]:
    """Per stage, the rematerializations to try: a `ManualStageOption`'s own, else the
    method's (all of them for "auto")."""
    given = getattr(option, "remat", ()) or (method.remat,) * num_stages
    return [choices_of(r) for r in given]
