"""How each output of the loss combines over microbatches (gradient accumulation, pipelines).

With M microbatches the loss function runs on B / M examples at a time; its outputs (the loss
and `has_aux` leaves) must come back as the full batch's. This pass reads the loss's forward
graph at the microbatch size, next to the same loss traced at the full batch size, and says
per output:

- `CONCAT`: the output carries the batch dimension (logits, per-example losses): the
  microbatches' rows are put back in batch order.
- `MEAN`: a mean over the examples (`jnp.mean(ce)`, plus terms without the batch, such as a
  weight decay): the microbatches' mean. The loss's gradients are averaged too.
- `SUM`: a sum over the examples (`jnp.sum(per_example)`): summed, gradients too.
- `RATIO`: `sum(l * w) / den` with a scalar denominator computed without the parameters
  (from the batch and constants: `sum(w)`, `jnp.maximum(sum(w), 1)`, `sum(w) + eps`, a count
  built with `jnp.where`; a padded token loss): microbatch m's value num_m / den_m is
  weighted by den_m / den, den the denominator of the whole batch (computed once per step
  from the loss traced at the full size), so the loss is sum_m num_m / den and its gradient
  sum_m grad(num_m) / den, exactly the full batch's. `guard_ratios` makes a microbatch whose
  denominator is 0 add nothing (not 0 / 0).
- `UNKNOWN`: none of these could be shown (e.g. `exp(mean)`, a max over the batch, a
  denominator that depends on the parameters, BatchNorm statistics). The output is averaged
  (floats) or summed (integers) and a `MicrobatchReductionWarning` names it.

The analysis follows every value with its kind (free of the batch, per example, a sum over
examples, a ratio of sums, or unknown) and its *scale*: the ratio of its value at the
microbatch size to its value at the full batch size, found by comparing the literals of the
two traces node by node (`jnp.mean` divides by 32 in one and by 128 in the other: scale M).
It also lists the random keys the loss reads (`rng_inputs`) and the random draws that carry
the batch (`draws`, `inter_op.random_rows`): each microbatch computes its rows of the whole
batch's draws, so dropout masks are the whole batch's; where that cannot be shown
(`fold_reason`), each microbatch folds its index into the keys instead.

Example:
    >>> red = reduce_outputs(forward, full_forward, batch_inputs=frozenset({5}), num_diff=4,
    ...                      num_microbatches=4)
    >>> [o.combine.value for o in red.outputs]
    ['ratio', 'concat']
"""
from __future__ import annotations

import dataclasses
import enum
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from autopar.core.errors import MicrobatchReductionWarning
from autopar.core.graph import Node, OpGraph, TensorKind
from autopar.core.primitives import ELEMENTWISE, KEY_OPS, RANDOM_BITS
from autopar.frontend.interpret import Reemitted
from autopar.inter_op.random_rows import RandomRows, batch_draws
from autopar.intra_op.batch_dims import batch_dims


class Combine(enum.Enum):
    MEAN = "mean"
    SUM = "sum"
    RATIO = "ratio"
    CONCAT = "concat"
    UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True, kw_only=True)
class OutputCombine:
    """How one loss output combines over microbatches."""
    combine: Combine
    batch_dim: int | None = None    # CONCAT: the dimension that carries the examples
    den: int | None = None          # RATIO: forward tensor id of the denominator
    reason: str = ""                # UNKNOWN: what could not be shown, and where


@dataclass(frozen=True, slots=True, kw_only=True)
class LossReduction:
    """Per loss output (the loss first) its combination, and what the RATIO weights need."""
    outputs: tuple[OutputCombine, ...]
    rows: int                        # examples per microbatch
    dens: tuple[int, ...]            # distinct RATIO denominators (forward tensor ids)
    den_nodes: tuple[int, ...]       # forward nodes computing them, in order
    den_inputs: tuple[int, ...]      # forward input positions those nodes read
    rng_inputs: tuple[int, ...] = ()  # forward input positions that are random keys (dropout)
    full_forward: OpGraph | None = None  # the loss at the full batch size, node for node (the
                                         # denominators' whole-batch values), or None
    whole_dens: tuple[int, ...] = ()     # dens weighted by den_m / den of the whole batch (a
                                         # clamp, an epsilon, ...); the others (plain sums, or
                                         # means over examples) by den_m / sum of the den_m
    draws: tuple[RandomRows, ...] = ()  # random draws with the batch: each microbatch draws
                                        # its rows of the whole batch's (`random_rows`)
    fold_reason: str = ""             # why the microbatches cannot draw the whole batch's bits;
                                      # then microbatch m draws from fold_in(key, m)

    @property
    def folds_keys(self) -> bool:
        return bool(self.fold_reason) and bool(self.rng_inputs)

    @property
    def loss(self) -> OutputCombine:
        return self.outputs[0]


class _Kind(enum.Enum):
    FREE = 0       # computed without the batch (parameters, constants, random bits)
    EXAMPLE = 1    # carries the batch dimension; each example's slice from that example alone
    MIXED = 2      # carries the batch dimension, but examples were mixed (BatchNorm)
    SUM = 3        # a sum over examples (times a factor free of the batch)
    RATIO = 4      # SUM / SUM, the denominator free of the parameters
    UNKNOWN = 5


@dataclass(frozen=True, slots=True)
class _Val:
    kind: _Kind
    scale: float | None = 1.0    # value at the microbatch size / value at the full size
    free_term: bool = False      # SUM: plus a term free of the batch
    den: int | None = None       # RATIO: the denominator's tensor id
    why: str = ""                # UNKNOWN: the first node that could not be classified


# Primitives whose result holds their first operand's values, rearranged (or cast).
_MOVES = frozenset({
    "reshape", "squeeze", "broadcast_in_dim", "expand_dims", "transpose", "convert_element_type",
    "copy", "copy_p", "reduce_precision", "slice", "rev", "gather", "dynamic_slice",
    "stop_gradient", "optimization_barrier", "sharding_constraint", "reshard", "device_put",
    "mesh_cast", "reduce_sum", "cumsum"})
_SAME_SCALE = frozenset({"add", "sub", "add_any", "max", "min", "neg", "concatenate", "pad",
                         "select_n", "clamp", "reduce_max", "reduce_min", "cummax", "cummin"})
# Value by value: a random mask's bits become floats elementwise at any shape.
_VALUEWISE = ELEMENTWISE | {"bitcast_convert_type"}
_RANDOM = KEY_OPS | RANDOM_BITS | {"threefry2x32"}   # what reads a random key
_BILINEAR = frozenset({"mul", "dot_general", "conv_general_dilated"})
_PASS = frozenset({"reshape", "squeeze", "broadcast_in_dim", "expand_dims", "convert_element_type",
                   "copy", "copy_p", "reduce_precision", "neg", "stop_gradient", "reduce_sum",
                   "optimization_barrier", "sharding_constraint", "reshard", "device_put",
                   "mesh_cast"})


def _close(a: float | None, b: float) -> bool:
    return a is not None and math.isclose(a, b, rel_tol=1e-6)


def _const_scale(micro, full) -> float | None:
    """A literal's (or closed-over array's) value at the microbatch size over its value at the
    full size: 1 where they are equal, their quotient for scalars."""
    if micro is full:
        return 1.0
    try:
        a, b = np.asarray(micro), np.asarray(full)
        if a.shape == b.shape and np.array_equal(a, b):
            return 1.0
        if a.size == 1 and b.size == 1 and float(b) != 0:
            return float(a.reshape(())) / float(b.reshape(()))
    except (TypeError, ValueError):
        pass
    return None


def _floating(graph: OpGraph, tid: int) -> bool:
    return graph.tensors[tid].dtype.startswith(("float", "bfloat"))


def _same_params(a: Node, b: Node | None) -> bool:
    if b is None:
        return False
    try:
        return bool(a.eqn.params == b.eqn.params)
    except Exception:     # params holding arrays or jaxprs
        return False


def _scale(node: Node, ins: Sequence[_Val], graph: OpGraph) -> float | None:
    """The scale of a value-wise result from its operands' scales (None: unknown)."""
    p, scales = node.primitive, [v.scale for v in ins]
    if p in RANDOM_BITS:
        return 1.0            # random bits at any shape: the same distribution
    if p in _MOVES:
        return scales[0]
    if any(s is None for s in scales):
        return None
    if p in _BILINEAR:
        return float(np.prod(scales))
    if p == "div" and _floating(graph, node.outputs[0]):
        return scales[0] / scales[1] if scales[1] else None
    if p in _SAME_SCALE:
        used = scales[1:] if p == "select_n" else scales   # select_n: not the predicate
        return used[0] if used and all(_close(s, used[0]) for s in used) else None
    return 1.0 if all(_close(s, 1.0) for s in scales) else None


def _mixes(node: Node, dims: Sequence[int | None]) -> bool:
    """An operator along the batch dimension (a cumulative sum or a sort over examples)."""
    params = node.eqn.params
    axis = params.get("axis", params.get("dimension"))
    return axis is not None and any(dims[t] == axis for t in node.inputs)


class _Analysis:
    def __init__(self, fwd: OpGraph, full: OpGraph | None, batch_inputs, num_diff: int):
        self.fwd, self.num_diff = fwd, num_diff
        aligned = full is not None and len(full.nodes) == len(fwd.nodes) and all(
            a.primitive == b.primitive and len(a.inputs) == len(b.inputs)
            for a, b in zip(fwd.nodes, full.nodes)) and len(full.tensors) == len(fwd.tensors) \
            and all(a.kind == b.kind and a.producer == b.producer
                    for a, b in zip(fwd.tensors, full.tensors))
        self.full = full if aligned else None
        # The batch dimension is followed at the full size where the two graphs align (tensor
        # ids then match): a microbatch of one example has a batch dimension of size 1, which
        # reshapes and broadcasts do not tell apart from any other.
        ref = self.full if self.full is not None else fwd
        self.dims = batch_dims(ref, {ref.inputs[q]: 0 for q in batch_inputs})
        self.vals: list[_Val | None] = [None] * len(fwd.tensors)
        self.whole_dens: set[int] = set()    # RATIO denominators weighted by their whole
                                             # batch's value (not a plain sum)
        self.param_dep = [False] * len(fwd.tensors)
        for pos, t in enumerate(fwd.inputs):
            self.vals[t] = _Val(_Kind.EXAMPLE if pos in batch_inputs else _Kind.FREE)
            self.param_dep[t] = pos < num_diff
        for node in fwd.nodes:
            self._visit(node)

    def _operand(self, node: Node, j: int) -> _Val:
        t = node.inputs[j]
        if self.fwd.tensors[t].kind == TensorKind.CONST:
            if self.full is None:
                return _Val(_Kind.FREE, None)
            other = self.full.nodes[node.id].inputs[j]
            return _Val(_Kind.FREE, _const_scale(self.fwd.const_values[t],
                                                 self.full.const_values.get(other)))
        return self.vals[t]

    def _visit(self, node: Node) -> None:
        ins = [self._operand(node, j) for j in range(len(node.inputs))]
        dep = any(self.param_dep[t] for t in node.inputs)
        for t in node.outputs:
            self.param_dep[t] = dep
        if all(v.kind == _Kind.FREE for v in ins):
            full = self.full.nodes[node.id] if self.full is not None else None
            scale = _scale(node, ins, self.fwd)
            if not (node.primitive in _VALUEWISE or node.primitive in _PASS - {"reduce_sum"}
                    or node.primitive in RANDOM_BITS):
                same = _same_params(node, full) and all(
                    self.fwd.tensors[a].shape == self.full.tensors[b].shape
                    for a, b in zip(node.inputs, full.inputs))
                scale = scale if same else None
            for t in node.outputs:
                self.vals[t] = _Val(_Kind.FREE, scale)
            return
        for t in node.outputs:
            self.vals[t] = self._batched(node, ins, t)

    def _unknown(self, node: Node, ins: Sequence[_Val], what: str) -> _Val:
        earlier = next((v.why for v in ins if v.kind == _Kind.UNKNOWN), "")
        return _Val(_Kind.UNKNOWN, None, why=earlier or f"{what} (`{node.primitive}` at "
                                                       f"{node.source})")

    def _batched(self, node: Node, ins: Sequence[_Val], out: int) -> _Val:
        if self.dims[out] is not None:
            pure = all(v.kind in (_Kind.FREE, _Kind.EXAMPLE) for v in ins)
            if pure and not _mixes(node, self.dims):
                return _Val(_Kind.EXAMPLE, _scale(node, ins, self.fwd))
            return _Val(_Kind.MIXED, None)
        if node.primitive == "div" and ins[0].kind == _Kind.SUM \
                and self._batch_only(node.inputs[1]):
            return self._product(node, ins)       # sum(l * w) / f(batch): any f
        if any(v.kind in (_Kind.UNKNOWN, _Kind.MIXED) for v in ins):
            return self._unknown(node, ins, "it combines values that mix examples")
        p, kinds = node.primitive, [v.kind for v in ins]
        first = ins[0]
        if p == "reduce_sum" and first.kind == _Kind.EXAMPLE:
            return _Val(_Kind.SUM, first.scale)               # the sum over examples
        if p == "dot_general" and kinds == [_Kind.EXAMPLE, _Kind.EXAMPLE]:
            return _Val(_Kind.SUM, _scale(node, ins, self.fwd))   # contracted over examples
        if len(ins) == 1 and p in _PASS and first.kind in (_Kind.SUM, _Kind.RATIO):
            return first
        if _Kind.EXAMPLE in kinds:
            return self._unknown(node, ins, "the batch dimension is lost in a way that is not "
                                            "a sum over examples")
        if p in ("mul", "div"):
            return self._product(node, ins)
        if p in ("add", "sub", "add_any"):
            return self._sum_of(node, ins)
        return self._unknown(node, ins, "it is not a sum or ratio of sums over examples")

    def _product(self, node: Node, ins: Sequence[_Val]) -> _Val:
        a, b = ins
        floating = _floating(self.fwd, node.outputs[0])
        if node.primitive == "mul" and a.kind == _Kind.FREE:
            a, b = b, a
        if b.kind == _Kind.FREE and b.scale is not None and (floating or node.primitive == "mul"):
            if a.kind == _Kind.SUM and a.scale is not None:
                s = a.scale * b.scale if node.primitive == "mul" else a.scale / b.scale
                return _Val(_Kind.SUM, s, a.free_term)
            if a.kind == _Kind.RATIO and _close(b.scale, 1.0):
                return a
        den = node.inputs[1]
        plain = a.kind == b.kind == _Kind.SUM and not (a.free_term or b.free_term) \
            and a.scale is not None and _close(b.scale, a.scale)
        if node.primitive == "div" and floating and a.kind == _Kind.SUM and not plain \
                and not a.free_term and _close(a.scale, 1.0) and self._batch_only(den):
            # any other denominator made from the batch alone: weighted by den_m / den of
            # the whole batch
            self.whole_dens.add(den)
            return _Val(_Kind.RATIO, 1.0, den=den)
        if node.primitive == "div" and floating and a.kind == b.kind == _Kind.SUM:
            if not plain:
                return self._unknown(node, ins, "a ratio whose numerator and denominator are "
                                                "not both plain sums over examples")
            if self.param_dep[den]:
                return self._unknown(node, ins, "a ratio whose denominator depends on the "
                                                "parameters")
            return _Val(_Kind.RATIO, 1.0, den=den)
        return self._unknown(node, ins, "a product or quotient that is not a sum over examples "
                                        "times a factor free of the batch")

    def _sum_of(self, node: Node, ins: Sequence[_Val]) -> _Val:
        a, b = ins
        if a.kind == _Kind.FREE:
            a, b = b, a
        if a.kind == _Kind.SUM and b.kind == _Kind.SUM and a.scale is not None \
                and _close(b.scale, a.scale):
            return _Val(_Kind.SUM, a.scale, a.free_term or b.free_term)
        if b.kind == _Kind.FREE and _close(b.scale, 1.0):
            if a.kind == _Kind.SUM:
                return _Val(_Kind.SUM, a.scale, True)
            if a.kind == _Kind.RATIO:
                return a            # the weights sum to 1: a constant term stays exact
        if a.kind == b.kind == _Kind.RATIO and a.den == b.den:
            return a
        return self._unknown(node, ins, "a sum of terms that combine differently over "
                                        "microbatches")

    def _batch_only(self, tid: int) -> bool:
        """A scalar made without the parameters (from the batch, constants and other inputs)
        that the loss traced at the full batch size computes too (node for node)."""
        t = self.fwd.tensors[tid]
        return (self.full is not None and t.rank == 0 and not self.param_dep[tid]
                and _floating(self.fwd, tid) and self.vals[tid] is not None)

    def output(self, tid: int, num_microbatches: int, rows: int) -> OutputCombine:
        v, d, t = self.vals[tid], self.dims[tid], self.fwd.tensors[tid]
        floating = _floating(self.fwd, tid)
        if d is not None:
            if self.full is not None and self.full.tensors[tid].rank != t.rank:
                return OutputCombine(combine=Combine.UNKNOWN, reason=(
                    "it has another rank at the microbatch's size than at the batch's"))
            if t.shape[d] % rows == 0:
                return OutputCombine(combine=Combine.CONCAT, batch_dim=d)
            return OutputCombine(combine=Combine.UNKNOWN, reason=(
                f"its batch dimension {d} has {t.shape[d]} entries, not a multiple of the "
                f"microbatch's {rows} examples"))
        if v.kind == _Kind.FREE and _close(v.scale, 1.0):
            return OutputCombine(combine=Combine.MEAN)     # the same in every microbatch
        if v.kind == _Kind.SUM:
            if floating and _close(v.scale, float(num_microbatches)):
                return OutputCombine(combine=Combine.MEAN)
            if _close(v.scale, 1.0) and not v.free_term:
                return OutputCombine(combine=Combine.SUM)
            return OutputCombine(combine=Combine.UNKNOWN, reason=(
                "it is a sum over examples scaled by a factor that depends on the batch size "
                "neither as a mean nor as a sum" if not v.free_term else
                "it is a sum over examples plus a term free of the batch (the term would be "
                "added once per microbatch)"))
        if v.kind == _Kind.RATIO:
            return OutputCombine(combine=Combine.RATIO, den=v.den)
        return OutputCombine(combine=Combine.UNKNOWN, reason=v.why or (
            "its value depends on the batch size in a way the analysis cannot follow"))


def _ancestors(fwd: OpGraph, tids: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(nodes computing `tids`, in order; forward input positions they read)."""
    need, nodes = set(tids), set()
    for node in reversed(fwd.nodes):
        if any(t in need for t in node.outputs):
            nodes.add(node.id)
            need.update(node.inputs)
    position = {t: q for q, t in enumerate(fwd.inputs)}
    return tuple(sorted(nodes)), tuple(sorted(position[t] for t in need if t in position))


def reduce_outputs(forward: OpGraph, full_forward: OpGraph | None, *,
                   batch_inputs: frozenset[int], num_diff: int,
                   num_microbatches: int) -> LossReduction:
    """How each output of the loss's `forward` graph (at the microbatch size) combines over
    `num_microbatches` microbatches; `full_forward` is the same loss at the full batch size
    (None, or a graph of another structure: no literal can be compared, so sums and means
    cannot be told apart and those outputs are UNKNOWN)."""
    analysis = _Analysis(forward, full_forward, batch_inputs, num_diff)
    rows = forward.tensors[forward.inputs[min(batch_inputs)]].shape[0] if batch_inputs else 1
    outs = tuple(analysis.output(t, num_microbatches, rows) for t in forward.outputs)
    dens = tuple(dict.fromkeys(o.den for o in outs if o.combine == Combine.RATIO))
    nodes, inputs = _ancestors(forward, dens)
    consumers = forward.consumers()
    keys = tuple(q for q, t in enumerate(forward.inputs) if q >= num_diff
                 and q not in batch_inputs and any(
                     forward.nodes[n].primitive in _RANDOM for n in consumers[t]))
    draws, why = batch_draws(forward, analysis.full, num_microbatches=num_microbatches,
                             rows=rows)
    return LossReduction(outputs=outs, rows=rows, dens=dens, den_nodes=nodes, den_inputs=inputs,
                         rng_inputs=keys, full_forward=analysis.full,
                         whole_dens=tuple(d for d in dens if d in analysis.whole_dens),
                         draws=draws, fold_reason=why)


class _GuardedDiv:
    """`num / den` that divides by 1 where den is 0. A RATIO's microbatch whose denominator
    is 0 (all its examples padded) has weight 0 and numerator 0 (a sum of terms weighted 0):
    its loss is then 0 and its gradient 0, not 0 / 0 (NaN) in the forward and in the
    backward. Elsewhere it is the division itself."""
    name = "div"
    multiple_results = False

    @staticmethod
    def bind(num, den, **params):
        return jax.lax.div(num, jnp.where(den == 0, jnp.ones_like(den), den))


def guard_ratios(forward: OpGraph, reduction: LossReduction) -> OpGraph:
    """`forward` with every division by a RATIO denominator guarded (see `_GuardedDiv`);
    tensors and nodes keep their ids."""
    dens = set(reduction.dens)
    nodes = tuple(dataclasses.replace(n, eqn=Reemitted(n.eqn, _GuardedDiv))
                  if n.primitive == "div" and n.inputs[1] in dens else n
                  for n in forward.nodes)
    return dataclasses.replace(forward, nodes=nodes)


def warn_inexact(reduction: LossReduction, forward: OpGraph, num_microbatches: int,
                 names: Sequence[str] = (), gradient: bool = True) -> None:
    """A `MicrobatchReductionWarning` for every output combined without proof that it equals
    the full batch's (the loss: its gradient would differ too). `names`: each output's name;
    `gradient`: whether output 0 is a loss that is differentiated (not in a forward-only
    pipeline)."""
    for pos, (out, tid) in enumerate(zip(reduction.outputs, forward.outputs)):
        if out.combine != Combine.UNKNOWN:
            continue
        t = forward.tensors[tid]
        node = forward.nodes[t.producer] if t.producer is not None else None
        where = node.source if node is not None else "<unknown>"
        what = names[pos] if pos < len(names) else (
            "the loss" if pos == 0 else f"auxiliary output {pos - 1}")
        how = "averaged" if _floating(forward, tid) else "summed"
        fix = ("write the loss as a mean over examples (jnp.mean), a sum over examples "
               "(jnp.sum), or sum(l * w) / sum(w) with weights computed from the batch alone; "
               "or use num_microbatches=1" if pos == 0 and gradient else
               "return the per-example values (they are concatenated) or sums over examples, "
               "and reduce them after the gradient step")
        warnings.warn(MicrobatchReductionWarning(
            f"num_microbatches={num_microbatches}: {what} (shape {t.shape}, made at {where}) "
            f"cannot be shown to combine exactly over microbatches: {out.reason}. It is "
            f"{how} over the microbatches, which is not the full batch's value in general"
            + (", and so is its gradient" if pos == 0 and gradient else "")
            + f". Fix: {fix}."),
            stacklevel=2)
    if reduction.fold_reason:
        how = ("each microbatch draws from fold_in(key, m), so its dropout masks are not the "
               "rows of the whole batch's" if reduction.rng_inputs else
               "every microbatch draws the same bits, not its rows of the whole batch's")
        warnings.warn(MicrobatchReductionWarning(
            f"num_microbatches={num_microbatches}: the loss's random draws cannot be the "
            f"whole batch's: {reduction.fold_reason}; {how}. The loss and its gradients then "
            "differ from the whole-batch step's (the same distribution, other bits)."),
            stacklevel=2)
