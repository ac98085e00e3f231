"""Split a traced step for pipelining: the loss (marked by `autopar.value_and_grad`), its layers
and its stage slices.

The step is traced with the gradient marker kept as one node. Its loss jaxpr becomes a forward
`OpGraph` whose nodes are cut into layers (at `mark_stage_boundary` calls, or automatically);
a stage is a contiguous node range of that forward graph. Everything outside the marker (the
optimizer update, global-norm clipping, metrics) is the apply-gradient part (`apply_grad.py`).

Example:
    >>> loss = split_step(step_graph)
    >>> bounds = layer_boundaries(loss.forward, AutoLayerOption(num_layers=4))
    >>> slices = slice_stages(loss, [(bounds[0], bounds[2]), (bounds[2], bounds[4])])
"""
from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.extend.core as jcore
import numpy as np

from autopar.core.errors import InvalidArgumentError, UnsupportedError
from autopar.core.graph import InputRole, OpGraph, TensorKind, cheap_source_tensors
from autopar.core.options import AutoLayerOption, ManualLayerOption
from autopar.frontend.grad import VALUE_AND_GRAD
from autopar.frontend.loops import atomic_spans
from autopar.frontend.subscans import has_scan, split_scans
from autopar.frontend.tracer import trace
from autopar.inter_op.layers import cluster_layers, cut_bytes_from_liveness
from autopar.inter_op.reduction import LossReduction, guard_ratios, reduce_outputs, warn_inexact

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class LossGraph:
    """The step with its gradient node, and the loss's forward graph."""
    step: OpGraph                  # traced with the gradient marker kept as node `grad_node`
    grad_node: int
    forward: OpGraph               # inputs = the marker's operands, in order
    num_diff: int                  # the first num_diff forward inputs are the parameters
                                   # (differentiated, unless forward_only)
    batch_inputs: frozenset[int]   # forward input positions split into microbatches
    reduction: LossReduction | None = None   # how outputs combine over microbatches (M > 1)
    forward_only: bool = False     # a step without gradient (`frontend.grad.forward_marked`):
                                   # forward stages only, no backward, no gradients

    @property
    def num_aux(self) -> int:
        return len(self.forward.outputs) - 1


def _batch_derived(step: OpGraph) -> set[int]:
    """Step tensors computed from batch inputs (and from nothing but batch inputs and values
    computed from constants alone, such as the broadcast 1 and 0 of `jnp.where(m, 1, 0)`)."""
    derived = {t for t in step.inputs if step.tensors[t].role == InputRole.BATCH}
    constant = cheap_source_tensors(step)
    for node in step.nodes:
        ins = [t for t in node.inputs if not constant[t]]
        if ins and all(t in derived for t in ins):
            derived.update(node.outputs)
    return derived


def takes_gradient(step: OpGraph) -> bool:
    """Whether `step` differentiates anything: an `autopar.value_and_grad` mark, or operators
    JAX's own differentiation made (their name stacks read `jvp(` / `transpose(`)."""
    return any(n.primitive == VALUE_AND_GRAD or "jvp(" in n.name_stack
               or "transpose(" in n.name_stack for n in step.nodes)


def _grad_node(step: OpGraph):
    grads = [n for n in step.nodes if n.primitive == VALUE_AND_GRAD]
    if len(grads) != 1:
        raise InvalidArgumentError(
            f"PipeshardParallel and gradient accumulation (num_microbatches > 1) need exactly "
            f"one autopar.value_and_grad / autopar.grad call in the step, found {len(grads)} "
            "(jax.value_and_grad and nnx.value_and_grad do not count: they leave no mark). Fix: "
            "take the gradient with `autopar.value_and_grad(loss_fn)(params, ...)` once per "
            "step (a drop-in for jax's, and for nnx's on NNX modules: "
            "`autopar.value_and_grad(loss_fn)(model, batch)`). A step without any gradient "
            "(an eval step) runs as a forward-only pipeline.")
    return grads[0]


def split_step(step: OpGraph, micro: OpGraph, num_microbatches: int, *,
               scan_pieces: int = 1) -> LossGraph:
    """Find the `autopar.value_and_grad` node of `step` and the loss's forward graph at the
    microbatch size (from `micro`: the same step traced with batch leaves of B / M rows).
    With `scan_pieces` > 1 every scan of the loss runs as that many sub-scans over ranges of
    its iterations (`frontend.subscans`), so that layer clustering can cut a scanned layer
    stack between stages."""
    node, micro_node = _grad_node(step), _grad_node(micro)
    params = node.eqn.params
    forward_only = "num_params" in params       # `forward_marked`: no gradient
    num_diff = params["num_params"] if forward_only else params["num_diff"]
    closed: jcore.ClosedJaxpr = micro_node.eqn.params["jaxpr"]
    derived = _batch_derived(step)
    batch = set()
    full_avals = params["jaxpr"].in_avals
    if len(full_avals) != len(closed.in_avals):
        raise UnsupportedError(
            "PipeshardParallel: the loss takes a different number of inputs at the microbatch "
            "size than at the full batch size; the step's structure must not depend on the batch "
            "size.")
    for pos, (tid, full, mb) in enumerate(zip(node.inputs, full_avals, closed.in_avals)):
        t = step.tensors[tid]
        if tid in derived and pos >= num_diff:
            if t.rank == 0 or (num_microbatches > 1 and tuple(full.shape) == tuple(mb.shape)):
                continue   # no batch dimension (a token count): every microbatch reads it whole
            if t.shape[0] % num_microbatches or \
                    tuple(mb.shape) != (t.shape[0] // num_microbatches, *t.shape[1:]):
                raise InvalidArgumentError(
                    f"num_microbatches={num_microbatches}: the loss input computed from the batch "
                    f"with shape {t.shape} cannot be split into {num_microbatches} equal "
                    "microbatches along dimension 0 (it must be [batch, ...]). Fix: choose "
                    "num_microbatches dividing the batch size, and pass the loss batch-major "
                    "values.")
            batch.add(pos)
        elif tuple(full.shape) != tuple(mb.shape):
            raise UnsupportedError(
                f"PipeshardParallel: loss input {pos} has shape {tuple(full.shape)} for the full "
                f"batch but {tuple(mb.shape)} for a microbatch, yet it is not computed from the "
                "batch_argnums arguments. Fix: list every batch argument in batch_argnums.")
    avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in closed.in_avals]
    # scans cut into sub-scans the same way at both sizes, so the graphs align node for node
    cut = lambda j: split_scans(j, scan_pieces) if scan_pieces > 1 and has_scan(j) \
        else jcore.jaxpr_as_fun(j)                                          # noqa: E731
    forward = trace(cut(closed), avals)
    what = "the step (a forward-only pipeline)" if forward_only else "the loss function"
    for out in forward.outputs:
        if forward.tensors[out].kind != TensorKind.INTERMEDIATE:
            raise UnsupportedError(
                f"PipeshardParallel: an output of {what} is an input or a constant rather "
                "than computed from them; the pipeline cannot place it. Fix: return values "
                f"computed in {what.split(' (')[0]}.")
    reduction = None
    if num_microbatches > 1:
        full = trace(cut(params["jaxpr"]),
                     [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in full_avals])
        reduction = reduce_outputs(forward, full, batch_inputs=frozenset(batch),
                                   num_diff=num_diff, num_microbatches=num_microbatches)
        warn_inexact(reduction, forward, num_microbatches, [
            f"output {i} of the step" for i in range(len(forward.outputs))]
            if forward_only else (), gradient=not forward_only)
        forward = guard_ratios(forward, reduction)
    return LossGraph(step=step, grad_node=node.id, forward=forward, num_diff=num_diff,
                     batch_inputs=frozenset(batch), reduction=reduction,
                     forward_only=forward_only)


def layer_boundaries(forward: OpGraph,
                     option: AutoLayerOption | ManualLayerOption) -> tuple[int, ...]:
    """Node index where each layer starts, plus the end (length L + 1)."""
    n = len(forward.nodes)
    spans = atomic_spans(forward)          # a loop region is one unit: never cut inside
    if isinstance(option, ManualLayerOption):
        marked = {m.position for m in forward.stage_markers if not m.backward} - {0, n}
        cuts = sorted(marked & {a for a, _ in spans})
        if len(cuts) < len(marked):
            log.warning("autopar: %d stage marker(s) inside a loop body (scan/while/cond) are "
                        "ignored: a loop stays in one pipeline stage", len(marked) - len(cuts))
        if not cuts:
            raise InvalidArgumentError(
                "ManualLayerOption: the loss has no autopar.mark_stage_boundary(...) call, so it "
                "is one layer. Fix: mark the values between layers, e.g. `x = "
                "autopar.mark_stage_boundary(x)` after each block, or use AutoLayerOption.")
        return (0, *cuts, n)
    num_layers = min(option.num_layers, len(spans))
    if num_layers < option.num_layers:
        warnings.warn(
            f"AutoLayerOption(num_layers={option.num_layers}): the loss has only {len(spans)} "
            f"places it can be cut into layers ({n} forward operators; a loop is one unit), so "
            f"it is cut into {num_layers} layers, not {option.num_layers}. Fix: "
            f"AutoLayerOption(num_layers={num_layers}) or fewer.", UserWarning, stacklevel=2)
    trips = forward.node_trips()
    flops = np.array([sum(forward.nodes[i].flops * trips[i] for i in range(a, b))
                      for a, b in spans])
    defined = [t.producer if t.kind == TensorKind.INTERMEDIATE else -1 for t in forward.tensors]
    last = forward.last_use()
    cut = cut_bytes_from_liveness(defined, last, [t.nbytes for t in forward.tensors], n)
    starts = [a for a, _ in spans] + [n]
    units = cluster_layers(flops, cut[starts], num_layers, imbalance=option.imbalance)
    return tuple(starts[u] for u in units.boundaries)


@dataclass(frozen=True, slots=True, kw_only=True)
class StageSlice:
    """One pipeline stage: a node range of the forward graph and what crosses its edges."""
    index: int
    start: int
    stop: int
    param_inputs: tuple[int, ...]   # forward input positions < num_diff used here
    data_inputs: tuple[int, ...]    # other forward input positions used here
    act_inputs: tuple[int, ...]     # tensor ids made by earlier stages, used here
    outputs: tuple[int, ...]        # tensor ids made here and used later (or loss outputs)
    forward_only: bool = False      # the loss's: the stage runs its forward alone

    @property
    def calls(self) -> int:
        """Executable calls per microbatch its latency counts: forward and backward (the
        forward alone in a forward-only pipeline)."""
        return 1 if self.forward_only else 2


def slice_range(loss: LossGraph, start: int, stop: int, index: int = 0) -> StageSlice:
    """The stage made of forward nodes [start, stop): what it reads from the loss inputs and
    from other nodes, and what it makes that other nodes (or the loss outputs) read. Nodes
    are in topological order, so only the stage's own nodes are walked: a value made inside
    is an output when a node at or after `stop` reads it (`_last_reader`)."""
    fwd = loss.forward
    position = {tid: pos for pos, tid in enumerate(fwd.inputs)}
    last = _last_reader(fwd)
    params, data, acts, outs = set(), set(), set(), set()
    for node in fwd.nodes[start:stop]:
        for t in node.inputs:
            tensor = fwd.tensors[t]
            if tensor.kind == TensorKind.INPUT:
                (params if position[t] < loss.num_diff else data).add(position[t])
            elif tensor.kind == TensorKind.INTERMEDIATE and not start <= tensor.producer < stop:
                acts.add(t)
        outs.update(t for t in node.outputs if last[t] >= stop)
    outs.update(t for t in fwd.outputs if fwd.tensors[t].kind == TensorKind.INTERMEDIATE
                and start <= fwd.tensors[t].producer < stop)
    return StageSlice(index=index, start=start, stop=stop, param_inputs=tuple(sorted(params)),
                      data_inputs=tuple(sorted(data)), act_inputs=tuple(sorted(acts)),
                      outputs=tuple(sorted(outs)), forward_only=loss.forward_only)


_LAST_READER: dict[int, tuple[OpGraph, list[int]]] = {}    # graph id -> (graph, last reader)


def _last_reader(graph: OpGraph) -> list[int]:
    """Per tensor, the id of the last node reading it (-1: none); kept for the last graphs
    (a layer DP slices one forward graph thousands of times)."""
    hit = _LAST_READER.get(id(graph))
    if hit is None or hit[0] is not graph:
        hit = _LAST_READER[id(graph)] = (graph, [c[-1] if c else -1 for c in graph.consumers()])
        while len(_LAST_READER) > 4:
            _LAST_READER.pop(next(iter(_LAST_READER)))
    return hit[1]


def slice_stages(loss: LossGraph, ranges: Sequence[tuple[int, int]]) -> tuple[StageSlice, ...]:
    """Stages over consecutive node ranges [start, stop) covering the forward graph."""
    return tuple(slice_range(loss, a, b, s) for s, (a, b) in enumerate(ranges))
