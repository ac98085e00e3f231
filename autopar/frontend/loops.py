"""Trace side of loops: a `scan`, `while` or `cond` equation becomes a *region* of the OpGraph.

Its body (each branch of a `cond`) is walked into the same graph, with the tracer's own
inlining of `jit` / custom calls / `remat`, so every body operator is an ordinary node that the
intra-op ILP gives strategies to. Pseudo-nodes connect the body to the outside:

- `loop_carry`  outer init -> body carry-in (a value of its own sharding, kept across
  iterations: the body's carry-out is moved into it, priced per iteration);
- `loop_slice`  outer xs `[T, ...]` -> body x `[...]` (the body spec drops dim 0, which stays
  whole outside);
- `loop_stack`  body y `[...]` -> outer ys `[T, ...]` (dim 0 whole);
- `loop_exit`   body carry-out -> outer final carry (the carry-in's sharding);
- `branch_exit` every branch's k-th result -> the cond's k-th result (one sharding for all).

Loop constants and a cond's operands are the outer tensors themselves (one sharding inside
and out). A `LoopRegion` (graph.py) records the node range and the boundary so that lowering
re-emits `jax.lax.scan` / `while_loop` / `switch` around the planned body.

Example:
    >>> g = trace(lambda ws, x: jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0],
    ...           (ws, x))
    >>> [n.primitive for n in g.nodes]
    ['loop_carry', 'loop_slice', 'dot_general', 'tanh', 'loop_exit']
    >>> g.regions[0].trips
    3
"""
from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass, field
from typing import Any

from autopar.core import _compat
from autopar.core.graph import LoopKind, LoopRegion, Node, OpGraph, TensorKind
from autopar.core.primitives import BRANCH_EXIT, LOOP_CARRY, LOOP_EXIT, LOOP_SLICE, LOOP_STACK
from autopar.core.primitives import CONTROL_FLOW as REGION_PRIMITIVES
from autopar.core.primitives import LOOP_PSEUDO as PSEUDO_PRIMITIVES


@dataclass(frozen=True, slots=True, kw_only=True)
class PseudoEqn:
    """The `eqn` of a pseudo-node: plain parameters (read by the fingerprint and the ILP; a
    while loop's condition, which is not in the graph, among them) and the loop equation's
    source info. Never bound: lowering re-emits the whole region."""
    params: dict
    source_info: Any = field(repr=False)


def trace_region(b, eqn, in_ids: list[int], env: dict, outer_source: str | None) -> None:
    """Walk the loop or cond `eqn` (operands `in_ids`) into builder `b` (trace._Builder) and
    bind its results in `env`."""
    kind = LoopKind(eqn.primitive.name)
    rid = len(b.regions)
    b.regions.append(None)            # reserved: regions are numbered in order of start
    source = _compat.source_summary(eqn.source_info) or outer_source
    scope = _compat.name_stack(eqn.source_info)
    start = len(b.nodes)
    p = eqn.params
    if kind is LoopKind.COND:
        ins, outs, bodies = [], [], []
        for branch in p["branches"]:
            ins.append(tuple(in_ids[1:]))       # a branch reads the operands themselves
            first = len(b.nodes)
            outs.append(tuple(_walk_body(b, branch, dict(zip(branch.jaxpr.invars, in_ids[1:])),
                                         source, scope)))
            bodies.append((first, len(b.nodes)))
        entry = [-1] * (len(in_ids) - 1)
        exits = [_pseudo(b, BRANCH_EXIT, tuple(o[k] for o in outs), v.aval, eqn, env,
                         source, rid, k) for k, v in enumerate(eqn.outvars)]
        trips = 1
    else:
        if kind is LoopKind.SCAN:
            closed, (n_const, n_carry) = p["jaxpr"], _compat.scan_counts(p)
            outer_of = list(in_ids)
            trips = int(p["length"])
        else:
            closed, n_const = p["body_jaxpr"], p["body_nconsts"]
            n_carry = len(closed.jaxpr.invars) - n_const
            outer_of = list(in_ids[p["cond_nconsts"]:])
            trips = counted_trips(eqn, in_ids, b.const_values) or 1   # unknown: costed once
        body_env, entry, body_in = {}, [], []
        for k, v in enumerate(closed.jaxpr.invars):
            if k < n_const:
                tid, nid = outer_of[k], -1
            else:
                prim = LOOP_CARRY if k < n_const + n_carry else LOOP_SLICE
                nid = _pseudo(b, prim, (outer_of[k],), v.aval, eqn, None, source, rid, k)
                tid = b.nodes[nid].outputs[0]
            body_env[v] = tid
            entry.append(nid)
            body_in.append(tid)
        first = len(b.nodes)
        body_out = _walk_body(b, closed, body_env, source, scope)
        bodies, ins, outs = [(first, len(b.nodes))], [tuple(body_in)], [tuple(body_out)]
        exits = []
        for k, (tid, v) in enumerate(zip(body_out, eqn.outvars)):
            prim = LOOP_EXIT if k < n_carry else LOOP_STACK
            extra = {"carry_in": body_in[n_const + k]} if k < n_carry else {}
            exits.append(_pseudo(b, prim, (tid,), v.aval, eqn, env, source, rid, k, **extra))
    b.regions[rid] = LoopRegion(
        id=rid, kind=kind, eqn=eqn, start=start, stop=len(b.nodes), trips=trips,
        outer_inputs=tuple(in_ids),
        outer_outputs=tuple(b.nodes[n].outputs[0] for n in exits),
        entry_nodes=tuple(entry), exit_nodes=tuple(exits), body_inputs=tuple(ins),
        body_outputs=tuple(outs), body_nodes=tuple(bodies))


_COMPARE = {"lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge,
            "ne": operator.ne}
MAX_COUNTED_TRIPS = 1 << 20
# A counter's update: (counter, step) operand orders and the step's sign.
_STEPS = {"add": lambda v: (((v[0], v[1]), 1), ((v[1], v[0]), 1)),
          "sub": lambda v: (((v[0], v[1]), -1),)}


def counted_trips(eqn, in_ids: list[int], const_values: dict) -> int | None:
    """The trip count of a `while` loop that counts: its condition compares one integer
    carry with a bound fixed for the loop (a literal, a constant, or a carry the body passes
    through), the body adds or subtracts a literal step to that carry, and its initial value
    is a constant (`while i < 5: ...; i += 1`, `fori_loop` with a constant bound). None for
    any other loop (its body is then costed once).

    Example:
        >>> counted_trips(while_eqn_of(lambda c: c[0] < 5, step_by_one, (0, x)), ids, consts)
        5
    """
    p = eqn.params
    cond, body, n_cond, n_body = (p["cond_jaxpr"], p["body_jaxpr"], p["cond_nconsts"],
                                  p["body_nconsts"])
    if len(cond.jaxpr.eqns) != 1:
        return None
    (test,) = cond.jaxpr.eqns
    compare = _COMPARE.get(test.primitive.name)
    invars = list(cond.jaxpr.invars)
    consts = dict(zip(cond.jaxpr.constvars, cond.consts))

    def position(atom) -> int | None:          # index among the cond's inputs
        if isinstance(atom, _compat.Literal):
            return None
        return next((k for k, v in enumerate(invars) if v is atom), None)

    def fixed(atom):                           # a value that is the same every iteration
        if isinstance(atom, _compat.Literal):
            return atom.val
        if atom in consts:
            return consts[atom]
        k = position(atom)
        if k is not None and k >= n_cond:      # a carry the body passes through unchanged
            c = k - n_cond
            k = n_cond + n_body + c if body.jaxpr.outvars[c] is body.jaxpr.invars[n_body + c] \
                else None
        return const_values.get(in_ids[k]) if k is not None else None

    if compare is None or test.outvars[0] is not cond.jaxpr.outvars[0]:
        return None
    (lhs, rhs), flip = test.invars, False
    k = position(lhs)
    if k is None or k < n_cond:
        (rhs, lhs), flip = test.invars, True
        k = position(lhs)
    bound = fixed(rhs)
    if k is None or k < n_cond or bound is None:
        return None
    carry = k - n_cond
    init = const_values.get(in_ids[n_cond + n_body + carry])
    carry_in, carry_out = body.jaxpr.invars[n_body + carry], body.jaxpr.outvars[carry]
    step = next((other.val * sign for e in body.jaxpr.eqns if e.outvars[0] is carry_out
                 for (a, other), sign in _STEPS.get(e.primitive.name, lambda v: ())(e.invars)
                 if a is carry_in and isinstance(other, _compat.Literal)), None)
    try:
        i, bound, step = int(init), int(bound), int(step)
    except (TypeError, ValueError):          # not a constant integer
        return None
    if step == 0:
        return None
    n = 0
    while (compare(bound, i) if flip else compare(i, bound)):
        i, n = i + step, n + 1
        if n > MAX_COUNTED_TRIPS:
            return None
    return max(n, 1)


def _walk_body(b, closed, env: dict, source, scope: str) -> list[int]:
    """Walk a (closed) body jaxpr into `b` with `env` binding its inputs; its result ids.
    Body equations name their scope relative to the loop: `scope` (the loop's) is put
    in front."""
    inner = getattr(closed, "jaxpr", closed)
    for v, c in zip(inner.constvars, getattr(closed, "consts", ())):
        env[v] = b.const(c, v.aval)
    first = len(b.nodes)
    b.walk(inner, env, source)
    if scope:
        for i in range(first, len(b.nodes)):
            node = b.nodes[i]
            b.nodes[i] = dataclasses.replace(
                node, name_stack=f"{scope}/{node.name_stack}" if node.name_stack else scope)
    return [b.read(env, v) for v in inner.outvars]


def _pseudo(b, primitive: str, inputs: tuple[int, ...], aval, eqn, env, source, rid: int,
            index: int, **params) -> int:
    """Append pseudo-node `primitive` with one result of type `aval`; bind it to the loop
    equation's result `index` in `env` (when given); return the node id."""
    node_id = len(b.nodes)
    tid = b.new_tensor(aval, TensorKind.INTERMEDIATE, producer=node_id)
    if env is not None and not isinstance(eqn.outvars[index], _compat.DropVar):
        env[eqn.outvars[index]] = tid
    p = eqn.params
    plain = {k: p[k] for k in ("length", "reverse", "unroll", "cond_jaxpr") if k in p}
    b.nodes.append(Node(
        id=node_id, primitive=primitive, inputs=inputs, outputs=(tid,), flops=0.0,
        source=source or "<unknown>", name_stack=_compat.name_stack(eqn.source_info),
        eqn=PseudoEqn(params={"region": rid, "index": index, **plain, **params},
                      source_info=eqn.source_info), remat=b.region))
    return node_id


def stacked_tensors(graph: OpGraph) -> frozenset[int]:
    """Tensors whose dimension 0 is a loop's iteration dimension (scanned-over xs and stacked
    ys): it is never split, so each iteration reads or writes a whole slice."""
    out = set()
    for node in graph.nodes:
        if node.primitive == LOOP_SLICE:
            out.add(node.inputs[0])
        elif node.primitive == LOOP_STACK:
            out.add(node.outputs[0])
    return frozenset(out)


def stacks_born_early(graph: OpGraph) -> dict[int, int]:
    """Stacked results (a loop's ys) -> the node where their buffer is allocated: the loop's
    first node, not the stack pseudo-node after the body (the loop writes one slice per
    iteration into a buffer that exists from the start), for liveness."""
    out = {}
    for r in graph.regions:
        for n in r.exit_nodes:
            if graph.nodes[n].primitive == LOOP_STACK:
                out[graph.nodes[n].outputs[0]] = r.start
    return out


def atomic_spans(graph: OpGraph) -> list[tuple[int, int]]:
    """The graph's nodes as consecutive [start, stop) spans that a cut may separate: one per
    node outside every region, one per outermost region (a pipeline stage boundary inside a
    loop would split its body from its boundary)."""
    spans, n = [], 0
    outer = sorted((r.start, r.stop) for r in graph.regions)
    for start, stop in outer:
        if start < n:                # nested in a region already taken whole
            continue
        spans += [(i, i + 1) for i in range(n, start)]
        spans.append((start, stop))
        n = stop
    return spans + [(i, i + 1) for i in range(n, len(graph.nodes))]


def region_at(graph: OpGraph) -> dict[int, list[LoopRegion]]:
    """Regions by their first node id, outermost first (a cond's first branch, or a body
    starting with a loop, starts where the region around it starts)."""
    out: dict[int, list[LoopRegion]] = {}
    for r in graph.regions:          # numbered in order of entry: outer before inner
        out.setdefault(r.start, []).append(r)
    return out


__all__ = ["LOOP_CARRY", "LOOP_SLICE", "LOOP_STACK", "LOOP_EXIT", "BRANCH_EXIT",
           "PSEUDO_PRIMITIVES", "REGION_PRIMITIVES", "PseudoEqn", "trace_region",
           "stacked_tensors", "region_at", "atomic_spans", "counted_trips",
           "stacks_born_early"]
