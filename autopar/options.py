"""Parallelization methods: frozen option values, no global configuration.

Example:
    >>> autopar.ShardParallel(memory_budget_bytes=8 << 30, solver=autopar.SolverBackend.CBC)
    >>> autopar.Zero3Parallel()
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from .errors import InvalidArgumentError
from .intra_op.ilp import SolverBackend


class LayerReuse(enum.Enum):
    """Whether repeated identical layers share ILP variables (solved once, reused)."""
    AUTO = "auto"        # when a block repeats 4+ times and 300+ operators have a choice
    ALWAYS = "always"
    NEVER = "never"      # every operator gets its own variable (exact, slower)


class MethodKind(enum.Enum):
    SHARD = "shard_parallel"       # the full intra-op ILP
    DATA = "data_parallel"         # batch split over every device, state replicated
    ZERO2 = "zero2"                # + optimizer state (and so gradients) sharded
    ZERO3 = "zero3"                # + parameters sharded


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardParallel:
    """Single-mesh parallelism: one sharding per tensor chosen by Alpa's intra-op ILP.

    Args:
      memory_budget_bytes: per-device bytes the plan must fit; None uses the device memory
        reported by the cluster description.
      solver: ILP backend (HiGHS through `highspy`, or CBC through `pulp`).
      solver_time_limit_s: after this the best solution found so far is used; with none, a
        greedy plan. Either way the dump and a log warning say so.
      layer_reuse: tie the ILP variables of repeated layers (`block_0`, `block_1`, ...) so a
        deep model is solved about as fast as one layer; see `LayerReuse`.
    """
    memory_budget_bytes: int | None = None
    solver: SolverBackend = SolverBackend.HIGHS
    solver_time_limit_s: float = 60.0
    layer_reuse: LayerReuse = LayerReuse.AUTO

    def __post_init__(self):
        if self.memory_budget_bytes is not None and self.memory_budget_bytes <= 0:
            raise InvalidArgumentError(
                f"memory_budget_bytes={self.memory_budget_bytes!r} must be positive or None.")
        if not self.solver_time_limit_s > 0:
            raise InvalidArgumentError(
                f"solver_time_limit_s={self.solver_time_limit_s!r} must be positive.")
        if not isinstance(self.solver, SolverBackend):
            raise InvalidArgumentError(
                f"solver={self.solver!r} is not a SolverBackend; use one of "
                f"{[b for b in SolverBackend]}.")

    @property
    def kind(self) -> MethodKind:
        return MethodKind.SHARD


@dataclass(frozen=True, slots=True, kw_only=True)
class DataParallel(ShardParallel):
    """Pure data parallelism: the batch dimension of every `batch_argnums` leaf is split over
    all devices, parameters and optimizer state are replicated (one gradient all-reduce)."""

    @property
    def kind(self) -> MethodKind:
        return MethodKind.DATA


@dataclass(frozen=True, slots=True, kw_only=True)
class Zero2Parallel(ShardParallel):
    """ZeRO stage 2: data parallel, with optimizer state sharded over all devices; gradients
    are reduce-scattered into the shards and updated parameters all-gathered."""

    @property
    def kind(self) -> MethodKind:
        return MethodKind.ZERO2


@dataclass(frozen=True, slots=True, kw_only=True)
class Zero3Parallel(ShardParallel):
    """ZeRO stage 3: like ZeRO-2 with the parameters sharded too (gathered where used)."""

    @property
    def kind(self) -> MethodKind:
        return MethodKind.ZERO3


__all__ = ["LayerReuse", "MethodKind", "ShardParallel", "DataParallel", "Zero2Parallel", "Zero3Parallel",
           "SolverBackend"]
