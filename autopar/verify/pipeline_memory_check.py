"""Verified memory for pipelines (and gradient accumulation): a plan whose stage predictions
bind their budget is compiled stage by stage during planning and each stage's peak, composed
from the `memory_analysis()` of the executables XLA compiled for it, checked against the
budget; over it the plan is re-made with the search's budget set to the worst stage's
prediction scaled by budget / compiled (at most `ROUNDS` times, logged), and
`InfeasiblePlanError` names the stage, its predicted and compiled bytes when nothing fits (as
`memory_check` does for one mesh, with the same `BINDING` and `ROUNDS`).

How a stage's peak is composed (per device, `StageMemory`): the executables are compiled by
walking one step of the executor on abstract values (`runtime.compile_only`), so they are the
very executables the first call runs (jax.jit keeps them). On stage s:

- `held`: the step's inputs placed on s (parameters, optimizer state, the batch), plus
  parameters a segment before the pipeline made for it (e.g. cast copies);
- `data`: the microbatches' copies of its batch inputs (the executor splits them up front);
- `accumulator`: the gradient accumulator (the backward's donated output);
- `stash`: one microbatch's residuals, the forward executable's outputs kept until its
  backward (with the activation inputs the backward reads), times `in_flight`, the
  microbatches between their forward and their backward (1F1B: up to stages - s; 0 where
  forward and backward are fused);
- `weight_stash` (a split backward): what a microbatch keeps from its B to its W, the
  residuals and activations W reads and B's hand-off, times `deferred`, the microbatches
  between their B and their W; (`in_flight`, `deferred`) is the pair the executor passed
  through (`ExecutorStats.kept_states`) that keeps the most;
- `work`: the largest of the forward, backward, fused and reduce executables' arguments +
  outputs + temp - aliased, less what the terms above count already (their parameters,
  data, accumulator and residuals): activations in and out, cotangents, temporaries;
- `apply`: the apply-gradient segments on s, arguments + outputs + temp - aliased less the
  step inputs among their arguments (they run after the pipeline, its residuals freed; the
  new state aliases the old only where the user donated it, see
  `lowering.pipeline.donated_inputs`).

peak = max(held + data + accumulator + in_flight * stash + deferred * weight_stash + work,
           held + apply).

Gradient accumulation on one mesh runs as one executable (`lowering.accumulate`): its peak is
that executable's arguments + outputs + temp - aliased, recorded as `held` (the step's
inputs) and `work` (the rest: the microbatches, the accumulator, one microbatch's
activations, the update).

The stage chunks of interleaved 1F1B and ZB-V share their device group: the budget is
checked per device, predicted (`predicted_per_device`) and compiled (`compiled_per_device`:
the chunks' held bytes summed, the most their microbatches keep at once under the table,
the largest working memory).

Small helpers (the batch split, cotangent sums, loss merges) are left out: they run where
little else is live. The plan records the per-stage peaks and their terms
(`measured["compiled_stage_bytes"]`, `measured["compiled_stage_memory"]`); `autopar.dump`
shows them next to the predictions.

Example (what `parallelize` does for a pipeline plan):
    >>> made = verified_pipeline(plan_at, program_of, leaves)     # doctest: +SKIP
    >>> max(made.plan.measured["compiled_stage_bytes"]) <= made.plan.memory_budget_bytes
    True
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax

from autopar.core.enums import Schedule
from autopar.core.plan import ParallelPlan
from autopar.frontend.meshes import no_context_mesh
from autopar.inter_op.chunks import device_bytes
from autopar.inter_op.schedule import CHUNKED, make_schedule, worst_mix
from autopar.runtime.compile_only import Call, Role, abstract_args, compile_program, shard_bytes
from autopar.verify.memory_check import BINDING, Over, compiled_bytes, replan_until_it_fits

_PIPELINE_ROLES = (Role.FORWARD, Role.BACKWARD, Role.FUSED, Role.REDUCE, Role.BACKWARD_INPUT,
                   Role.WEIGHT)
_FIX = ("Fix: raise memory_budget_bytes, use more devices per stage or more stages, more "
        "(smaller) microbatches, or remat='full'.")


@dataclass(frozen=True, slots=True)
class StageMemory:
    """One stage's compiled peak per device and its terms (see the module docstring)."""
    stage: int
    held: int
    data: int
    accumulator: int
    stash: int
    in_flight: int
    work: int
    apply: int
    weight_stash: int = 0     # what a microbatch keeps from its B to its W (split backward)
    deferred: int = 0         # the most microbatches between their B and their W at once

    @property
    def peak(self) -> int:
        return max(self.held + self.data + self.accumulator + self.in_flight * self.stash
                   + self.deferred * self.weight_stash + self.work, self.held + self.apply)


@dataclass(frozen=True, slots=True)
class VerifiedPipeline:
    """A pipeline plan, what `plan_at` returned with it, and (when it was checked) the
    lowered program whose executables are compiled."""
    plan: ParallelPlan
    planned: tuple            # (plan, parts, graph) as plan_pipeline returns them
    program: Any = None


def _held_bytes(call: Call, positions: tuple[int, ...] | None = None) -> int:
    """Bytes of the call's arguments (at `positions`; default all) that are step inputs."""
    out, i = 0, 0
    for pos, arg in enumerate(call.args):
        leaves = jax.tree_util.tree_leaves(arg)
        if positions is None or pos in positions:
            out += sum(shard_bytes(x) for x, held in zip(leaves, call.held[i:i + len(leaves)])
                       if held)
        i += len(leaves)
    return out


def _accumulator(call: Call) -> tuple[int, int]:
    """(bytes of the accumulator argument, of the accumulator result) of a backward / fused
    call (the argument is None on the first microbatch)."""
    if call.role is Role.WEIGHT:
        return shard_bytes(call.args[2]), shard_bytes(call.outs)
    acc_in = call.args[2] if call.role is Role.BACKWARD else call.args[5]
    acc_out = call.outs[0] if call.role is Role.BACKWARD else call.outs[2]
    return shard_bytes(acc_in), shard_bytes(acc_out)


def stage_memory(program, leaves, num_microbatches: int) -> tuple[StageMemory, ...] | None:
    """Each stage's compiled peak (see the module docstring) for the step's flat argument
    `leaves`; None when the backend reports no memory analysis."""
    args = abstract_args(leaves, program.in_shardings)
    with no_context_mesh():          # as the calls run (api.ParallelizedFunction._call)
        calls, stats = compile_program(program, args)
    loss, placement = program.loss, program.placement
    if program.whole_step is not None:     # one executable: its own peak
        (call,) = calls
        feet = compiled_bytes(call.compiled)
        if feet is None:
            return None
        held = _held_bytes(call)
        return (StageMemory(stage=0, held=held, data=0, accumulator=0, stash=0, in_flight=0,
                            work=max(feet - held, 0), apply=0),)
    out = []
    for st in program.stages:
        s = st.index
        mine = [c for c in calls if c.stage == s]
        feet = {id(c): compiled_bytes(c.compiled) for c in mine}
        if any(f is None for f in feet.values()):
            return None
        held = sum(shard_bytes(a) for a, where in zip(args, placement.input_stage) if where == s)
        derived = data = acc = stash = kept = work = apply = 0
        split = loss.batch_inputs | _rng_inputs(program)
        for c in mine:
            if c.role in (Role.FORWARD, Role.FUSED):
                derived = max(derived, shard_bytes(c.args[0]) - _held_bytes(c, (0,)))
                mb = [0, 0]         # bytes not on the step's inputs: split per microbatch, once
                for q, x in zip(st.slice.data_inputs, c.args[1]):
                    mb[q in split] += shard_bytes(x)
                data = max(data, mb[0] + mb[1] * num_microbatches - _held_bytes(c, (1,)))
            if c.role is Role.FORWARD:
                acts = [*c.args[2], *c.args[3]]
                stash = max(stash, shard_bytes(c.outs[2])
                            + shard_bytes([acts[i] for i in st.saved_acts]))
            if c.role in (Role.BACKWARD, Role.FUSED, Role.WEIGHT):
                acc = max(acc, *_accumulator(c))
            if c.role is Role.WEIGHT:     # W's part of the residuals, with B's hand-off
                saved = c.args[0]
                kept = max(kept, shard_bytes([saved[0], saved[3]]) + shard_bytes(c.args[1]))
        for c in mine:
            counted = 0
            if c.role is Role.FORWARD:
                counted = shard_bytes(c.args[0]) + shard_bytes(c.args[1]) + stash
            elif c.role is Role.BACKWARD:      # residuals, parameters, data, saved acts
                a_in, a_out = _accumulator(c)
                counted = shard_bytes(c.args[0]) + (a_in or a_out)
            elif c.role is Role.BACKWARD_INPUT:
                counted = shard_bytes(c.args[0])
            elif c.role is Role.WEIGHT:        # saved, the hand-off and the accumulator
                a_in, a_out = _accumulator(c)
                counted = shard_bytes(c.args[0]) + shard_bytes(c.args[1]) + (a_in or a_out)
            elif c.role is Role.FUSED:
                a_in, a_out = _accumulator(c)
                counted = shard_bytes(c.args[0]) + shard_bytes(c.args[1]) + (a_in or a_out)
            elif c.role is Role.REDUCE:
                counted = shard_bytes(c.args[0])
            if c.role in _PIPELINE_ROLES:
                work = max(work, feet[id(c)] - counted)
            elif c.role is Role.APPLY:
                apply = max(apply, feet[id(c)] - _held_bytes(c))
        # the mix of microbatches in flight and deferred that keeps the most
        q, d = worst_mix(stats.kept_states[s], stash, kept)
        out.append(StageMemory(stage=s, held=held + derived, data=data, accumulator=acc,
                               stash=stash, in_flight=q, work=max(work, 0),
                               apply=max(apply, 0), weight_stash=kept, deferred=d))
    return tuple(out)


def _rng_inputs(program) -> frozenset[int]:
    """Forward input positions the executor folds into one key per microbatch."""
    red = program.loss.reduction
    if red is None or program.num_microbatches <= 1 or not red.folds_keys:
        return frozenset()
    return frozenset(red.rng_inputs)


def predicted_per_device(plan: ParallelPlan) -> list[float]:
    """Per stage, its devices' predicted peak: for stage chunks sharing a device group, the
    plan's `pipeline["device_peak_bytes"]` (`schedule_choice.device_peaks`), else the
    stage's own."""
    if plan.pipeline.get("schedule") in {s.value for s in CHUNKED}:
        return list(plan.pipeline["device_peak_bytes"])
    return [s.peak_memory_bytes for s in plan.stages]


def compiled_per_device(plan: ParallelPlan, memory: tuple[StageMemory, ...]) -> list[float]:
    """Per stage, its devices' compiled peak: its own where it has its device group alone.
    Stage chunks sharing a group (interleaved 1F1B, ZB-V) add their held, data and
    accumulator bytes, the largest of their working memories (their executables run one at a
    time) and the most their microbatches keep at once under the plan's table
    (`PipelineSchedule.group_kept_peak`); after the pipeline, their held bytes and apply
    segments."""
    name = plan.pipeline.get("schedule")
    if name not in {s.value for s in CHUNKED}:
        return [m.peak for m in memory]
    table = make_schedule(Schedule(name), len(memory), plan.pipeline["num_microbatches"])
    during = device_bytes(table, [m.held + m.data + m.accumulator for m in memory],
                          [m.work for m in memory], [m.stash for m in memory],
                          [m.weight_stash for m in memory])
    after = device_bytes(table, [m.held + m.apply for m in memory], [0.0] * len(memory),
                         [0.0] * len(memory), [0.0] * len(memory))
    return [max(a, b) for a, b in zip(during, after)]


def binding(plan: ParallelPlan) -> bool:
    """Whether some device's predicted peak is within `BINDING` of the plan's budget."""
    return any(p >= BINDING * plan.memory_budget_bytes for p in predicted_per_device(plan))


def _record(plan: ParallelPlan, memory: tuple[StageMemory, ...] | None, budget: float,
            round_: int) -> ParallelPlan:
    measured = {**plan.measured, "memory_check_rounds": round_,
                "compiled_stage_bytes": None if memory is None else [m.peak for m in memory]}
    if memory is not None:
        measured["compiled_stage_memory"] = [dataclasses.asdict(m) for m in memory]
    return dataclasses.replace(plan, memory_budget_bytes=budget, measured=measured)


def _worst(plan: ParallelPlan, got: list[float]) -> tuple[int, float, float]:
    """(stage, its devices' predicted bytes, their compiled bytes `got`) of the stage whose
    devices are most over the budget (a stage chunk's: its device group's)."""
    s = max(range(len(got)), key=lambda i: got[i])
    return s, predicted_per_device(plan)[s], got[s]


def verified_pipeline(plan_at: Callable[[int | None], tuple],
                      program_of: Callable[[Any], Any], leaves,
                      ) -> VerifiedPipeline:
    """`plan_at(None)` (the method's budget), checked against XLA when a stage binds.
    `plan_at(budget)` plans with the search's budget scaled to `budget` bytes and returns
    `(plan, parts, graph)` as `plan_pipeline` does; `program_of(parts)` lowers the plan
    (`lowering.pipeline`); `leaves` are the step's flat arguments.

    Raises:
      InfeasiblePlanError: a stage compiles over the budget after `ROUNDS` re-plans (or the
        scaled budget leaves no plan); it names the stage, its predicted and compiled bytes.
    """
    planned = plan_at(None)
    if not binding(planned[0]):
        return VerifiedPipeline(planned[0], planned)
    budget = float(planned[0].memory_budget_bytes)
    ilp_budget = budget

    def measure(planned, round_):
        nonlocal ilp_budget
        program = program_of(planned[1])
        memory = stage_memory(program, leaves, planned[0].pipeline["num_microbatches"])
        plan = _record(planned[0], memory, budget, round_)
        planned = (plan, *planned[1:])
        devices = None if memory is None else compiled_per_device(plan, memory)
        if devices is None or max(devices) <= budget:
            return planned, program, None
        s, predicted, got = _worst(plan, devices)
        # the budget at which the worst stage's prediction shrinks by its compiled excess
        ilp_budget = min(ilp_budget, predicted) * budget / got
        return planned, program, Over(f"stage {s} of the pipeline", predicted, got,
                                      ilp_budget)

    planned, program = replan_until_it_fits(planned, budget, measure,
                                            lambda b: plan_at(int(b)), _FIX)
    return VerifiedPipeline(planned[0], planned, program)


def with_budget(method, stage_method, budget: int | None):
    """(method, stage_method) with the search's memory budget `budget` (None: as given)."""
    if budget is None:
        return method, stage_method
    return (dataclasses.replace(method, memory_budget_bytes=budget),
            None if stage_method is None
            else dataclasses.replace(stage_method, memory_budget_bytes=budget))
