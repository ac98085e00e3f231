"""Lower pass for pipeline plans: per-stage jitted forward / backward executables on submesh
`Mesh`es, and one jitted executable per apply-gradient segment.

A stage's executables re-emit its training graph (the one its ILP solved) cut in two by
`split_train_graph`, with every intermediate pinned to the ILP's sharding: the forward returns
the stage outputs and the residuals it computes (a list of arrays that stays on the stage's
devices); the backward reads them, the stage's parameters, data and the activation inputs it
needs (the executor keeps those by reference: no copy per microbatch in flight) and the output
cotangents, and adds the parameter gradients into the accumulator (donated). Where the last
stage's backward of a microbatch directly follows its forward (1F1B, and so every microbatch
of gradient accumulation) `fused` runs both in one executable and keeps no residuals. Values
move between submeshes with `jax.device_put` (see `runtime.executor`).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from autopar.core import progress
from autopar.core.enums import Schedule
from autopar.frontend.interpret import RESULT, resharded, run_nodes
from autopar.inter_op.apply_grad import PIPELINE, Placement, Segment
from autopar.inter_op.local_grads import LocalGrads, partial_spec, run_nodes_local
from autopar.inter_op.pipeline import LossGraph, StageSlice
from autopar.inter_op.schedule import PipelineSchedule, make_schedule
from autopar.inter_op.stage_solve import (
    StageIO,
    split_train_graph,
    stage_backward_split,
    stage_io,
)
from autopar.inter_op.stages import AXIS_NAMES, ChosenStage
from autopar.lowering.accumulate import accumulated_step, runs_whole
from autopar.lowering.microbatch_bits import with_batch_draws
from autopar.lowering.single_mesh import named, reshard_paths


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class StageExecutable:
    index: int
    slice: StageSlice
    mesh: jax.sharding.Mesh
    io: StageIO
    param_shardings: tuple[NamedSharding, ...]   # per slice.param_inputs
    data_shardings: tuple[NamedSharding, ...]    # per slice.data_inputs (microbatch shape)
    act_shardings: dict[int, NamedSharding]      # per act input tensor id
    out_shardings: dict[int, NamedSharding]      # per output tensor id
    # Each takes last `mb`, the microbatch's index (an int32 scalar): its random draws are its
    # rows of the whole batch's (`lowering.microbatch_bits`).
    forward: Callable     # (params, data, float_acts, int_acts, mb) -> (outs, int_outs,
                          # residuals)
    backward: Callable | None   # ((residuals, params, data, saved acts), cts, acc, mb) ->
                                # (acc, act_grads); acc=None the first time; None in a
                                # forward-only pipeline (and so `fused`)
    fused: Callable | None      # (params, data, float_acts, int_acts, cts, acc, mb) ->
                                # (outs, int_outs, acc, act_grads)
    # The backward split for zero-bubble schedules: B gives the activation gradients and the
    # values W reads that B computes (its hand-off); W adds the parameter gradients.
    backward_input: Callable | None = None    # (saved, cts, mb) -> (act_grads, handoff);
                                              # None where B computes nothing
    handoff_cts: tuple[int, ...] = ()         # then: the cotangents W reads (positions)
    backward_weight: Callable | None = None   # (saved, handoff, acc, mb) -> acc
    backward_split: Any = None                # the BackwardSplit they run, of `graph`
    graph: Any = None                         # the stage's training graph (an OpGraph)
    reduce: Callable | None = None   # acc -> the step's gradients, where the accumulator
                                     # keeps partial sums (see inter_op.local_grads)
    local_grads: int = 0             # how many parameter gradients are accumulated locally
    saved_acts: tuple[int, ...] = ()  # positions of the activation inputs the backward reads
    weight_residuals: tuple[int, ...] = ()   # of the forward's residuals, those W reads
    weight_acts: tuple[int, ...] = ()        # of the saved activation inputs, those W reads
    acc_shardings: tuple[NamedSharding, ...] = ()   # of the accumulator's entries


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class PipelineProgram:
    loss: LossGraph
    placement: Placement
    stages: tuple[StageExecutable, ...]
    in_shardings: tuple[NamedSharding, ...]      # per step input
    segment_fns: tuple[Callable | None, ...]     # per segment (None for the pipeline)
    schedule: PipelineSchedule
    num_microbatches: int
    max_in_flight_calls: int | None              # None: never wait (accelerators)
    # gradient accumulation on one mesh: the whole step as one jit (`lowering.accumulate`),
    # which the executor runs instead of the schedule; None for a pipeline
    whole_step: Callable | None = None


def stage_mesh(stage: ChosenStage, devices_by_id: dict[int, Any]) -> jax.sharding.Mesh:
    devs = np.array([devices_by_id[d] for d in stage.device_ids], dtype=object)
    return jax.sharding.Mesh(devs.reshape(stage.solution.logical_shape), AXIS_NAMES)


def _stage_executable(loss: LossGraph, stage: ChosenStage, mesh, local: LocalGrads | None,
                      num_microbatches: int) -> StageExecutable:
    sl, sol, graph = stage.slice, stage.solution, stage.graph
    draws = loss.reduction.draws if loss.reduction is not None else ()
    drawn = lambda mb: with_batch_draws(graph, draws, num_microbatches, mb)
    io = stage_io(loss, sl)
    sh = lambda specs: tuple(named(mesh, s) for s in specs)
    acts = dict(zip((*io.float_acts, *io.int_acts), sh(sol.act_specs)))
    outs = dict(zip((*io.float_outputs, *io.int_outputs), sh(sol.out_specs)))
    grads = sh(sol.grad_specs)
    constrain = {t: named(mesh, spec) for t, spec in sol.constraints}
    # A planned resharding that takes more than one collective passes through its
    # intermediate layouts, one constraint each: in one step XLA replicates the whole tensor
    # ("involuntary full rematerialization"). A one-collective move is left to XLA, which
    # measured cheaper on stage programs than forcing the planned one (it often avoids it).
    pinned = dict(sol.constraints)
    pinned.update(zip(graph.inputs, (*sol.param_specs, *sol.data_specs, *sol.act_specs,
                                     *sol.out_specs[:len(io.float_outputs)])))
    reshard = {k: path for k, path in reshard_paths(
        graph, pinned, sol.reshards, sol.logical_shape, mesh).items() if len(path) > 1}
    split = split_train_graph(graph, sl)
    nodes = lambda g, ids: [g.nodes[n] for n in ids]
    # all but the cotangents (a forward-only stage's graph has none)
    n_in = len(graph.inputs) - (0 if sl.forward_only else len(io.float_outputs))
    n_out = len(io.float_outputs) + len(io.int_outputs)
    n_grads = len(sl.param_inputs)
    # With several microbatches, gradients accumulate as per-device partial sums, reduced
    # once per step by `reduce`.
    reduce = None
    if local:
        specs = dict(sol.constraints)
        run_bwd = lambda g, env, ns: run_nodes_local(g, ns, env, specs, local, mesh, named,
                                                     reshard)
        acc_sh = [named(mesh, partial_spec(s, local.partial[t])) if kept else g
                  for s, g, t, kept in zip(sol.grad_specs, grads, graph.outputs[n_out:],
                                           local.grad_outputs)]
        reduce = jax.jit(lambda acc: [a.sum(0) if kept else a
                                      for a, kept in zip(acc, local.grad_outputs)],
                         out_shardings=list(grads))
        grads = tuple(acc_sh)
    else:
        run_bwd = lambda g, env, ns: run_nodes(g, ns, env, constrain, reshard)

    def env_of(inputs, values):
        env = dict(graph.const_values)
        env.update(zip(inputs, values))
        return env

    kept = set(i for i, k in enumerate(local.grad_outputs) if k) if local else set()

    def result(env, pos):
        """The stage graph's result `pos`, moved into its planned spec step by step (a kept
        partial sum stays as it is)."""
        path = None if pos - n_out in kept else reshard.get((RESULT, pos))
        return resharded(env, graph.outputs[pos], path)

    constrain_to = jax.lax.with_sharding_constraint

    def param_grads_of(env, acc):
        """acc + the param grads, on the ILP's shardings of the params."""
        param_grads = [result(env, pos) for pos in range(n_out, n_out + n_grads)]
        if acc is not None:
            param_grads = [a + g for a, g in zip(acc, param_grads)]
        return [constrain_to(g, s) for g, s in zip(param_grads, grads)]

    def act_grads_of(env):
        act_grads = [result(env, pos) for pos in range(n_out + n_grads, len(graph.outputs))]
        return [constrain_to(g, acts[t]) for g, t in zip(act_grads, io.float_acts)]

    def finish(env, acc):
        """(acc + param grads, act grads) on the ILP's shardings of params and acts."""
        return param_grads_of(env, acc), act_grads_of(env)

    # The forward returns the residuals it computes; those that are the stage's inputs (its
    # parameters, data and activations) the executor keeps and hands the backward as they are
    # (returned by the forward, each would be a copy per microbatch in flight).
    n_pd = len(sl.param_inputs) + len(sl.data_inputs)
    param_data, act_ids = graph.inputs[:n_pd], graph.inputs[n_pd:n_in]
    computed = tuple(t for t in split.residuals if t not in set(graph.inputs[:n_in]))
    wanted = set(split.residuals)
    saved_acts = tuple(i for i, t in enumerate(act_ids) if t in wanted)

    def forward(params, data, float_acts, int_acts, mb):
        env = env_of(graph.inputs[:n_in], [*params, *data, *float_acts, *int_acts])
        g = drawn(mb)
        run_nodes(g, nodes(g, split.forward_nodes), env, constrain, reshard)
        out = [result(env, pos) for pos in range(n_out)]
        return out[:len(io.float_outputs)], out[len(io.float_outputs):], \
            [env[t] for t in computed]

    def saved_env(saved, extra_ids=(), extra=(), res_ids=computed,
                  acts_of=tuple(act_ids[i] for i in saved_acts)):
        residuals, params, data, acts = saved
        return env_of((*res_ids, *param_data, *acts_of, *extra_ids),
                      [*residuals, *params, *data, *acts, *extra])

    def backward(saved, cts, acc, mb):
        env = saved_env(saved, graph.inputs[n_in:], cts)
        g = drawn(mb)       # a draw recomputed in the backward (remat) is the forward's
        run_bwd(g, env, nodes(g, split.backward_nodes))
        return finish(env, acc)

    out_sh = ([outs[t] for t in io.float_outputs], [outs[t] for t in io.int_outputs])
    common = dict(index=sl.index, slice=sl, mesh=mesh, io=io,
                  param_shardings=sh(sol.param_specs), data_shardings=sh(sol.data_specs),
                  act_shardings=acts, out_shardings=outs, graph=graph)
    if sl.forward_only:              # a step without gradient: the forward alone
        return StageExecutable(**common, forward=jax.jit(forward, out_shardings=(*out_sh, None)),
                               backward=None, fused=None)
    parts = stage_backward_split(graph, sl, split.backward_nodes)

    def backward_input(saved, cts, mb):
        env = saved_env(saved, graph.inputs[n_in:], cts)
        g = drawn(mb)
        run_bwd(g, env, nodes(g, parts.input_nodes))
        return act_grads_of(env), [env[t] for t in parts.handoff]

    # After B, a microbatch keeps only what W reads (`weight_residuals` of the residuals,
    # `weight_acts` of the saved activation inputs): the executor drops the rest.
    w_reads = {t for n in parts.weight_nodes for t in graph.nodes[n].inputs}
    w_res = tuple(i for i, t in enumerate(computed) if t in w_reads)
    w_acts = tuple(j for j, i in enumerate(saved_acts) if act_ids[i] in w_reads)

    def backward_weight(saved, handoff, acc, mb):
        env = saved_env(saved, parts.handoff, handoff,
                        res_ids=tuple(computed[i] for i in w_res),
                        acts_of=tuple(act_ids[saved_acts[j]] for j in w_acts))
        g = drawn(mb)
        run_bwd(g, env, nodes(g, parts.weight_nodes))
        return param_grads_of(env, acc)

    def fused(params, data, float_acts, int_acts, cts, acc, mb):
        env = env_of(graph.inputs, [*params, *data, *float_acts, *int_acts, *cts])
        g = drawn(mb)
        run_bwd(g, env, g.nodes)
        out = [result(env, pos) for pos in range(n_out)]
        return (out[:len(io.float_outputs)], out[len(io.float_outputs):], *finish(env, acc))

    return StageExecutable(
        **common, forward=jax.jit(forward, out_shardings=(*out_sh, None)),
        backward=jax.jit(backward, donate_argnums=(2,)),
        fused=jax.jit(fused, donate_argnums=(5,), out_shardings=(*out_sh, None, None)),
        # The B of a stage with no float activation inputs (the first stage: no activation
        # gradients to send back) is not dispatched; W gets the cotangents it reads directly.
        backward_input=jax.jit(backward_input) if io.float_acts else None,
        handoff_cts=() if io.float_acts else tuple(
            graph.inputs[n_in:].index(t) for t in parts.handoff),
        backward_weight=jax.jit(backward_weight, donate_argnums=(2,)), backward_split=parts,
        reduce=reduce, local_grads=sum(local.grad_outputs) if local else 0,
        saved_acts=saved_acts, acc_shardings=grads, weight_residuals=w_res,
        weight_acts=w_acts)


def _segment_fn(loss: LossGraph, seg: Segment, pinned: dict[int, NamedSharding],
                donate: tuple[int, ...] = ()) -> Callable:
    """One apply-gradient segment as a jit; `pinned` outputs (the next step's state) come out
    exactly on the sharding the step's inputs expect, the others where XLA puts them; the
    inputs at positions `donate` are donated (see `donated_inputs`)."""
    step = loss.step
    nodes = [step.nodes[n] for n in seg.nodes]

    def run(*values):
        env = dict(step.const_values)
        env.update(zip(seg.inputs, values))
        run_nodes(step, nodes, env)
        return [env[t] for t in seg.outputs]

    return jax.jit(run, out_shardings=[pinned.get(t) for t in seg.outputs],
                   donate_argnums=donate)


def donated_inputs(loss: LossGraph, placement: Placement, index: int) -> tuple[int, ...]:
    """Positions of segment `index`'s inputs it donates: state the user donated
    (`donate_argnums`) whose new value (its carried output) the segment makes on the same
    stage and sharding, read by no later segment and not itself a result. Without it the
    update would hold the old state and the new one at once.

    Example:
        >>> donated_inputs(loss, placement, 2)      # the update of stage 0's parameters
        (0, 1, 3, 4)
    """
    step, seg = loss.step, placement.segments[index]
    later = {t for s in placement.segments[index + 1:] for t in s.inputs} | set(step.outputs)
    replaced = {step.inputs[i] for o, i in step.carried_outputs.items()
                if i in step.donated_inputs and step.outputs[o] in seg.outputs
                and placement.input_stage[i] == seg.stage == placement.output_stage[o]
                and placement.output_spec[o] == placement.input_spec[i]}
    return tuple(k for k, t in enumerate(seg.inputs) if t in replaced and t not in later)


@progress.timed("lowering", lambda p: f"{len(p.stages)} stage(s)", long=False)
def lower_pipeline(loss: LossGraph, placement: Placement, stages: tuple[ChosenStage, ...],
                   devices: list, schedule: Schedule, num_microbatches: int,
                   max_in_flight_calls: int,
                   local_grads: tuple[LocalGrads | None, ...]) -> PipelineProgram:
    """The stages' and segments' executables; `local_grads` (per stage, as `plan_pipeline`
    found them) says which gradients accumulate as partial sums."""
    by_id = {int(d.id): d for d in devices}
    meshes = [stage_mesh(st, by_id) for st in stages]
    execs = tuple(_stage_executable(loss, st, m, lg, num_microbatches)
                  for st, m, lg in zip(stages, meshes, local_grads))
    step = loss.step
    in_sh = tuple(named(meshes[s], spec)
                  for s, spec in zip(placement.input_stage, placement.input_spec))
    segment_fns = []
    for index, seg in enumerate(placement.segments):
        if seg.stage == PIPELINE:
            segment_fns.append(None)
            continue
        pinned = {}
        for pos, tid in enumerate(step.outputs):
            spec = placement.output_spec[pos]
            if spec is not None and placement.output_stage[pos] == seg.stage \
                    and tid in seg.outputs:
                pinned[tid] = named(meshes[seg.stage], spec)
        segment_fns.append(_segment_fn(loss, seg, pinned,
                                       donated_inputs(loss, placement, index)))
    cpu = all(d.platform == "cpu" for d in devices)
    program = PipelineProgram(
        loss=loss, placement=placement, stages=execs, in_shardings=in_sh,
        segment_fns=tuple(segment_fns),
        schedule=make_schedule(schedule, len(stages), num_microbatches),
        num_microbatches=num_microbatches,
        max_in_flight_calls=max_in_flight_calls if cpu else None)
    if runs_whole(program):
        program = dataclasses.replace(program, whole_step=accumulated_step(program))
    return program
