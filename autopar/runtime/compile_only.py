"""Compiling a pipeline program without running it.

`compile_program` walks one step of the `Executor` on abstract values (`jax.ShapeDtypeStruct`s
with shardings) instead of arrays: every stage and apply-gradient executable the first real
step calls is lowered and compiled with exactly the arguments that step passes, which
`jax.jit` keeps, so the first call compiles them no more (only the executor's small helpers,
the batch split and the loss merges, compile again). It returns one `Call` per distinct
executable: its role, its stage, the compiled executable (`memory_analysis()`), the abstract
arguments it got and whether each is one of the step's inputs, and the residuals each stage
kept at most (as the executor counts them). `pipeline_memory_check` composes stage peaks
from them.

Example:
    >>> calls, stats = compile_program(program, abstract_args(leaves, program.in_shardings))
    >>> [(c.role.value, c.stage) for c in calls]         # doctest: +SKIP
    [('forward', 0), ('backward', 0), ('backward', 0), ('fused', 1), ('fused', 1), ...]
"""
from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from autopar.lowering.microbatch import add_all
from autopar.lowering.pipeline import PipelineProgram
from autopar.runtime.executor import Executor, ExecutorStats


class Role(enum.Enum):
    FORWARD = "forward"      # (params, data, float acts, int acts) -> (outs, int outs, residuals)
    BACKWARD = "backward"    # ((residuals, params, data, acts), cotangents, acc) -> (acc,
                             # act grads)
    FUSED = "fused"          # (params, data, float acts, int acts, cts, acc) -> (outs, int
                             # outs, acc, act grads)
    BACKWARD_INPUT = "backward-input"   # B of a split backward: ((residuals, params, data,
                                        # acts), cts) -> (act grads, hand-off to W)
    WEIGHT = "weight"        # W: ((residuals, ...), hand-off, acc) -> acc
    REDUCE = "reduce"        # acc -> the step's gradients (partial sums reduced)
    APPLY = "apply"          # an apply-gradient segment
    STEP = "step"            # the whole step as one executable (gradient accumulation)
    OTHER = "other"          # the batch split, key folding, cotangent sums, loss weights


@dataclass(frozen=True, slots=True, eq=False)
class Call:
    role: Role
    stage: int | None            # None: a helper not tied to one stage
    compiled: Any                # jax.stages.Compiled
    args: tuple                  # the abstract arguments (a pytree per positional argument)
    outs: Any                    # the abstract results (compiled.out_info, format dropped)
    held: tuple[bool, ...]       # per flattened argument leaf: one of the step's inputs


def abstract(value, sharding=None) -> jax.ShapeDtypeStruct:
    """`value` (an array, numpy array or abstract value) as an abstract value on `sharding`
    (default: its own)."""
    aval = value if isinstance(value, jax.ShapeDtypeStruct) else jax.typeof(value)
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=bool(aval.weak_type),
                                sharding=sharding if sharding is not None
                                else getattr(value, "sharding", None))


def abstract_args(leaves, shardings) -> list[jax.ShapeDtypeStruct]:
    """The step's flat arguments as the executor receives them: each on its input sharding."""
    return [abstract(x, s) for x, s in zip(leaves, shardings)]


def shard_bytes(value) -> int:
    """Bytes of one device's shard of an abstract value (0 for None); a pytree sums."""
    total = 0
    for x in jax.tree_util.tree_leaves(value):
        sharding = getattr(x, "sharding", None)
        shape = sharding.shard_shape(tuple(x.shape)) if sharding is not None else x.shape
        total += int(np.prod(shape, dtype=np.int64)) * int(getattr(x.dtype, "itemsize", 0))
    return total


class _Compiling:
    """Stands in for a jitted function: compiles it for the abstract arguments it is called
    with (once per distinct signature), records a `Call`, returns abstract results."""

    def __init__(self, fn, role: Role, stage: int | None, calls: list, held_ids: set):
        self.fn, self.role, self.stage = fn, role, stage
        self.calls, self.held_ids = calls, held_ids
        self.done: dict = {}

    def __call__(self, *args):
        leaves, tree = jax.tree_util.tree_flatten(args)
        key = (tree, tuple((tuple(x.shape), str(x.dtype), bool(getattr(x, "weak_type", 0)),
                            getattr(x, "sharding", None)) for x in leaves))
        if key not in self.done:
            compiled = self.fn.lower(*args).compile()
            outs = jax.tree_util.tree_map(
                lambda o: jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=o.sharding,
                                               weak_type=bool(getattr(o, "weak_type", False))),
                compiled.out_info)
            self.done[key] = outs
            self.calls.append(Call(role=self.role, stage=self.stage, compiled=compiled,
                                   args=args, outs=outs,
                                   held=tuple(id(x) in self.held_ids for x in leaves)))
        return self.done[key]


class _Merges:
    """The executor's `Merger` on abstract values: the key folding and loss weights compile
    (they run on a stage's devices); a loss output's merge (scalars or the aux rows) is only
    shaped, on the values' devices."""

    def __init__(self, merger, wrap: Callable):
        self._merger = merger
        self.rng_inputs, self.den_inputs = merger.rng_inputs, merger.den_inputs
        self.outputs, self.seed = merger.outputs, merger.seed
        self.fold_keys = wrap(merger.fold_keys)
        self.weights = None if merger.weights is None else wrap(merger.weights)

    def __call__(self, pos: int, values: list, weights: list | None = None):
        out = jax.eval_shape(lambda v, w: self._merger(pos, v, w), list(values), weights)
        first = values[0].sharding
        same = tuple(out.shape) == tuple(values[0].shape)
        return abstract(out, first if same else NamedSharding(first.mesh, PartitionSpec()))


class _CompileOnly(Executor):
    """The executor with every dispatch compiled instead of run (see the module docstring)."""

    def __init__(self, program: PipelineProgram, calls: list, held_ids: set):
        def wrap(fn, role, stage=None):
            return None if fn is None else _Compiling(fn, role, stage, calls, held_ids)
        stages = tuple(dataclasses.replace(
            st, forward=wrap(st.forward, Role.FORWARD, st.index),
            backward=wrap(st.backward, Role.BACKWARD, st.index),
            fused=wrap(st.fused, Role.FUSED, st.index),
            backward_input=wrap(st.backward_input, Role.BACKWARD_INPUT, st.index),
            backward_weight=wrap(st.backward_weight, Role.WEIGHT, st.index),
            reduce=wrap(st.reduce, Role.REDUCE, st.index)) for st in program.stages)
        segments = tuple(wrap(fn, Role.APPLY, seg.stage)
                         for seg, fn in zip(program.placement.segments, program.segment_fns))
        super().__init__(dataclasses.replace(program, stages=stages, segment_fns=segments,
                                             whole_step=wrap(program.whole_step, Role.STEP, 0)))
        self._split = wrap(self._split, Role.OTHER)
        self._sum = wrap(add_all, Role.OTHER)
        self._merge = _Merges(self._merge, lambda fn: wrap(fn, Role.OTHER))

    def _dispatched(self, out):
        self.stats.num_dispatches += 1
        return out

    def _move(self, value, sharding):
        return abstract(value, sharding)

    def _made(self, make):
        """Constants the executor places (loss seeds, zero cotangents): made (they are small
        or made by the real step too) and kept abstract."""
        return abstract(make())


def compile_program(program: PipelineProgram, args: list) -> tuple[tuple[Call, ...],
                                                                   ExecutorStats]:
    """(the `Call` of every distinct executable one step of `program` runs, the executor's
    `ExecutorStats` of that step: per stage the most microbatches it keeps residuals of, in
    flight and deferred) for the abstract step arguments `args`."""
    calls: list[Call] = []
    executor = _CompileOnly(program, calls, {id(x) for x in args})
    executor.run(list(args))
    return tuple(calls), executor.stats
