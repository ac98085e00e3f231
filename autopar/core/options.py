"""Parallelization methods: frozen option values, no global configuration.

Example:
    >>> autopar.ShardParallel(memory_budget_bytes=8 << 30, solver=autopar.SolverBackend.CBC)
    >>> autopar.Zero3Parallel()
"""
from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass

import numpy as np

from autopar.core.enums import Annotations, Remat, Schedule, SolverBackend
from autopar.core.errors import InvalidArgumentError


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
    PIPESHARD = "pipeshard_parallel"  # pipeline stages on submeshes, each sharded by the ILP


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardParallel:
    r"""Single-mesh parallelism: one sharding per tensor chosen by Alpa's intra-op ILP.

    Args:
      memory_budget_bytes: per-device bytes the plan must fit; None uses the device memory
        reported by the cluster description.
      solver: ILP backend (HiGHS through `highspy`, or CBC through `pulp`).
      solver_time_limit_s: after this the best solution found so far is used; with none, a
        greedy plan. Either way the dump and a log warning say so.
      layer_reuse: tie the ILP variables of repeated layers (`block_0`, `block_1`, ...) so a
        deep model is solved about as fast as one layer; see `LayerReuse`.
      num_microbatches: gradient accumulation. With M > 1 the batch is split into M equal
        microbatches (M must divide the batch size; microbatch m holds examples m, m + M,
        ...); one executable runs forward and backward on each and adds its gradient into an
        accumulator, then one executable applies the update, so activation memory is that of
        one microbatch. The step must take its gradient with `autopar.value_and_grad` /
        `autopar.grad` (with `jax.value_and_grad` it is refused with an
        InvalidArgumentError). The loss, its gradient and the `has_aux` outputs come back as
        the full batch's: each output of the loss function is combined as its graph says
        (a mean over examples: averaged; a sum: summed; `sum(l * w) / sum(w)` with weights
        from the batch, e.g. a padded token loss: weighted by each microbatch's share of
        sum(w), so loss and gradient are exact; a value with the batch dimension, e.g.
        logits: the microbatches' rows put back in batch order). An output that is none of
        these is averaged (integers summed) with a `MicrobatchReductionWarning`; see
        `autopar.value_and_grad`. A random key the loss reads (dropout) is folded with the
        microbatch's index, so microbatches draw different masks. The shardings come from
        the ILP at the microbatch's size.

    Example:
      sharding_rules: pin input leaves to a sharding: `(regex, spec)` pairs; the first
        regex that `re.search`-matches a leaf's path (e.g.
        `state.params['params']['block_0']['attn']['qkv']['kernel']`, as `dump` prints it)
        fixes that leaf's sharding to `spec`, written like a `PartitionSpec` over the mesh's
        axis names (missing trailing entries are unsplit; `()` is replicated). The ILP
        chooses everything else around it. Optimizer-state paths contain their parameter's
        path, so one rule usually pins both. In a pipeline the rules apply inside every
        stage, whose logical mesh axes are ("data", "model"). Use it to try a hand-written
        plan (e.g. Megatron's column/row split) under the same cost model. A rule for a
        batch leaf pins that leaf only; `batch_axis` pins the whole batch path.
      batch_axis: a mesh axis name (or tuple of names) the batch dimension is split over
        along the whole batch path: the batch leaves and every value computed from them keep
        their batch dimension on these axes (Alpa's `force_batch_dim_to_mesh_dim`); the ILP
        chooses what the other axes split. DataParallel and ZeRO split the batch over every
        axis unless it names fewer.
      annotations: what the plan does with the sharding annotations in the step's code
        (`with_sharding_constraint`, `jax.sharding.reshard`, `out_sharding=` of einsums and
        matmuls, Flax `nn.with_logical_constraint`): "pin" (default) gives each annotated
        value exactly its annotated sharding, "hint" prefers it (any other sharding pays the
        move into it), "ignore" plans as if there were none. Replicated annotations and the
        backward pass's transposed ones are not taken as the user's. In a pipeline an
        annotation applies in a stage whose logical mesh has its axis names and sizes.
      remat: rematerialization (`Remat`; plain strings accepted). "auto" (default): when the
        fastest plan does not fit the memory budget, the search recomputes activations in
        the backward pass instead of keeping them, per layer (per stage in a pipeline), as
        little as fits: "selective" keeps matmul outputs and recomputes the elementwise work
        (`jax.checkpoint_policies.dots_saveable`), "full" keeps only each layer's input. "none"
        never recomputes (the plan and its `InfeasiblePlanError` as without the search);
        "selective" / "full" apply to every layer. On one mesh any gradient will do
        (`jax.value_and_grad`, `jax.grad`, `nnx.value_and_grad`, `autopar.value_and_grad`):
        autopar finds the backward pass in the traced step (`inter_op.step_remat`); a loop's
        body is not recomputed; the user's own `jax.checkpoint` is always kept as written.
        The plan records the choice per layer (`dump` shows it).

    Example:
        >>> autopar.ShardParallel(num_microbatches=4)      # 4-step gradient accumulation
        >>> autopar.Zero3Parallel(num_microbatches=2)
        >>> autopar.ShardParallel(remat="none")             # never recompute activations
        >>> autopar.ShardParallel(batch_axis="data")  # data parallel on "data", ILP on the rest
        >>> autopar.ShardParallel(sharding_rules=(         # Megatron-style MLP, batch on data
        ...     (r"\['fc'\]\['kernel'\]", (None, "model")),
        ...     (r"\['proj'\]\['kernel'\]", ("model", None)),
        ...     (r"^batch", ("data",))))
    """
    memory_budget_bytes: int | None = None
    solver: SolverBackend = SolverBackend.HIGHS
    solver_time_limit_s: float = 60.0
    layer_reuse: LayerReuse = LayerReuse.AUTO
    num_microbatches: int = 1
    sharding_rules: tuple[tuple[str, tuple], ...] = ()
    batch_axis: str | tuple[str, ...] | None = None
    annotations: Annotations = Annotations.PIN
    remat: Remat = Remat.AUTO

    def __post_init__(self):
        name = type(self).__name__
        object.__setattr__(self, "remat", Remat.of(self.remat, f"{name}.remat"))
        object.__setattr__(self, "annotations", _as_enum(
            self, "annotations", Annotations, " ('pin': the code's sharding annotations are "
            "kept exactly, 'hint': preferred, 'ignore': planned without)"))
        object.__setattr__(self, "layer_reuse", _as_enum(
            self, "layer_reuse", LayerReuse, " (repeated layers share ILP variables)"))
        v = self.num_microbatches
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise InvalidArgumentError(
                f"{name}.num_microbatches={v!r} must be an int >= 1 (1: no gradient "
                f"accumulation). Fix: {name}(num_microbatches=4) with a number that divides "
                "the batch size, or leave it out.")
        budget = self.memory_budget_bytes
        if budget is not None and (not _is_number(budget) or budget <= 0):
            raise InvalidArgumentError(
                f"{name}.memory_budget_bytes={budget!r} must be a positive number of bytes per "
                f"device, or None (the cluster's device memory). Fix: e.g. {name}("
                "memory_budget_bytes=16 * 2**30) for 16 GiB, or leave it out.")
        if not _is_number(self.solver_time_limit_s) or not self.solver_time_limit_s > 0:
            raise InvalidArgumentError(
                f"{name}.solver_time_limit_s={self.solver_time_limit_s!r} must be a positive "
                f"number of seconds. Fix: e.g. {name}(solver_time_limit_s=60.0).")
        if not isinstance(self.solver, SolverBackend):
            raise InvalidArgumentError(
                f"{name}.solver={self.solver!r} is not a SolverBackend. Fix: pass one of "
                f"{[b for b in SolverBackend]}, e.g. solver=autopar.SolverBackend.HIGHS.")
        object.__setattr__(self, "sharding_rules", _check_rules(self.sharding_rules))
        axis = self.batch_axis
        if isinstance(axis, list):
            axis = tuple(axis)
            object.__setattr__(self, "batch_axis", axis)
        if not (axis is None or isinstance(axis, str) or (
                isinstance(axis, tuple) and axis and all(isinstance(a, str) for a in axis))):
            raise InvalidArgumentError(
                f"{name}.batch_axis={axis!r} must be None, a mesh axis name or a tuple of axis "
                f"names. Fix: e.g. {name}(batch_axis='data') or batch_axis=('x', 'y').")

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


def _as_enum(owner, field: str, cls: type[enum.Enum], meaning: str = "") -> enum.Enum:
    """`owner.field` as a member of `cls` (its value strings accepted), or a clear error."""
    value = getattr(owner, field)
    try:
        return cls(value)
    except ValueError:
        values = [m.value for m in cls]
        raise InvalidArgumentError(
            f"{type(owner).__name__}.{field}={value!r} must be one of {values}{meaning}. Fix: "
            f"e.g. {type(owner).__name__}({field}={values[0]!r}) or "
            f"{field}=autopar.{cls.__name__}.{cls(values[0]).name}.") from None


def _is_number(v) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)


def _rule_entry(entry, where: str):
    ok = entry is None or isinstance(entry, str) or (
        isinstance(entry, (tuple, list)) and all(isinstance(a, str) for a in entry))
    if not ok:
        raise InvalidArgumentError(
            f"sharding_rules{where}: spec entry {entry!r} must be None, a mesh axis name or a "
            "tuple of axis names, as in jax.sharding.PartitionSpec. Fix: e.g. (None, 'model') "
            "or (('data', 'model'), None).")
    return tuple(entry) if isinstance(entry, list) else entry


def _check_rules(rules) -> tuple[tuple[str, tuple], ...]:
    """Validate `sharding_rules` and normalize it to a hashable tuple of (regex, spec)."""
    if isinstance(rules, dict):
        rules = tuple(rules.items())
    out = []
    for i, rule in enumerate(rules or ()):
        if not (isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[0], str)
                and hasattr(rule[1], "__iter__") and not isinstance(rule[1], str)):
            raise InvalidArgumentError(
                f"sharding_rules[{i}]={rule!r} must be a (regex, spec) pair. Fix: e.g. "
                "(r\"\\['fc'\\]\\['kernel'\\]\", (None, \"model\")).")
        try:
            re.compile(rule[0])
        except re.error as e:
            raise InvalidArgumentError(
                f"sharding_rules[{i}]: {rule[0]!r} is not a regular expression ({e}). Fix: "
                "correct it (re.search on leaf paths; escape brackets: r\"\\['w'\\]\").") from None
        out.append((rule[0], tuple(_rule_entry(e, f"[{i}]") for e in rule[1])))
    return tuple(out)


class LayerOptionKind(enum.Enum):
    AUTO = "auto"
    MANUAL = "manual"


@dataclass(frozen=True, slots=True, kw_only=True)
class AutoLayerOption:
    """Cut the loss's forward graph into `num_layers` layers automatically: balanced FLOPs
    (each layer within `1 + imbalance` of the mean) with the fewest bytes crossing the cuts."""
    num_layers: int = 4
    imbalance: float = 0.25

    def __post_init__(self):
        if isinstance(self.num_layers, bool) or not isinstance(self.num_layers, int) \
                or self.num_layers < 1:
            raise InvalidArgumentError(
                f"AutoLayerOption.num_layers={self.num_layers!r} must be an int >= 1. Fix: "
                "e.g. AutoLayerOption(num_layers=4), at least the number of pipeline stages.")
        if not _is_number(self.imbalance) or not self.imbalance >= 0:
            raise InvalidArgumentError(
                f"AutoLayerOption.imbalance={self.imbalance!r} must be a number >= 0 (each "
                "layer's FLOPs within 1 + imbalance of the mean). Fix: e.g. "
                "AutoLayerOption(imbalance=0.25).")

    @property
    def kind(self) -> LayerOptionKind:
        return LayerOptionKind.AUTO


@dataclass(frozen=True, slots=True, kw_only=True)
class ManualLayerOption:
    """Layers end where the model calls `autopar.mark_stage_boundary(...)`."""

    @property
    def kind(self) -> LayerOptionKind:
        return LayerOptionKind.MANUAL


def _check_shape_tuple(owner: str, name: str, value, length: int | None = None) -> tuple:
    try:
        items = tuple(tuple(item) for item in value)
    except TypeError:
        items = None
    if items is None or not items or not all(
            isinstance(x, (int, np.integer)) and not isinstance(x, bool)
            for item in items for x in item):
        raise InvalidArgumentError(
            f"{owner}.{name}={value!r} must be a non-empty tuple of int tuples, one per stage. "
            f"Fix: e.g. {name}=((0, 1), (2, 3)) for two stages.")
    out = tuple(tuple(int(x) for x in item) for item in items)
    if any(x < 0 for item in out for x in item) or (length is not None and len(out) != length):
        raise InvalidArgumentError(
            f"{owner}.{name}={value!r} is invalid: need {length if length else 'some'} tuples "
            "of non-negative ints (one per stage). Fix: give one tuple per entry of "
            "layer_spans.")
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class AutoStageOption:
    """Choose stages and submeshes with Alpa's DP over intra-op ILP costs.

    Args:
      max_stages: cap on the number of pipeline stages (None: up to the number of layers).
      logical_shapes: which logical views of a submesh of n devices the DP tries:
        "all" tries every 2-D factorization (a x b = n), "flat" only (1, n) and (n, 1).
      workers: worker processes that solve the layers' ILPs (the plan is the same with any
        number); 1 solves them in this process; None: the environment variable
        AUTOPAR_PLAN_WORKERS, else the CPU count less one (at most 16).

    Example:
        >>> autopar.AutoStageOption(logical_shapes="flat", workers=2)
    """
    max_stages: int | None = None
    logical_shapes: str = "all"
    workers: int | None = None

    def __post_init__(self):
        if self.max_stages is not None and (not isinstance(self.max_stages, int)
                                            or isinstance(self.max_stages, bool)
                                            or self.max_stages < 1):
            raise InvalidArgumentError(
                f"AutoStageOption.max_stages={self.max_stages!r} must be None or an int >= 1. "
                "Fix: e.g. AutoStageOption(max_stages=4), or None (up to the number of "
                "layers).")
        if self.logical_shapes not in ("all", "flat"):
            raise InvalidArgumentError(
                f"AutoStageOption.logical_shapes={self.logical_shapes!r} must be 'all' or "
                "'flat'. Fix: AutoStageOption(logical_shapes='all') (every 2-D view of a "
                "submesh) or 'flat' ((1, n) and (n, 1) only).")
        if self.workers is not None and (isinstance(self.workers, bool) or not isinstance(
                self.workers, int) or self.workers < 1):
            raise InvalidArgumentError(
                f"AutoStageOption.workers={self.workers!r} must be None or an int >= 1 (1: plan "
                "in this process). Fix: e.g. AutoStageOption(workers=2), or None.")


@dataclass(frozen=True, slots=True, kw_only=True)
class UniformStageOption:
    """`num_stages` stages with equal layer counts on equal submeshes (devices split in
    order); each stage's logical mesh is still chosen by the ILP costs."""
    num_stages: int

    def __post_init__(self):
        if isinstance(self.num_stages, bool) or not isinstance(self.num_stages, int) \
                or self.num_stages < 1:
            raise InvalidArgumentError(
                f"UniformStageOption.num_stages={self.num_stages!r} must be an int >= 1. Fix: "
                "e.g. UniformStageOption(num_stages=2), a number that divides the device "
                "count.")


@dataclass(frozen=True, slots=True, kw_only=True)
class ManualStageOption:
    """Pin the stage choice exactly: per stage its (first, last) layer, its submesh as
    (hosts, devices per host), its logical mesh shape and optionally its rematerialization
    (`Remat`; default: the method's `remat`, "auto" searching it per stage) and whether ZeRO
    splits its optimizer state over its data axis (default: where memory needs it). A plan's
    `stage_option()` gives the one it chose, so a dumped plan can be replayed.

    Example:
        >>> autopar.ManualStageOption(layer_spans=((0, 1), (2, 3)),
        ...                           submesh_shapes=((1, 4), (1, 4)),
        ...                           logical_shapes=((2, 2), (1, 4)))
    """
    layer_spans: tuple[tuple[int, int], ...]
    submesh_shapes: tuple[tuple[int, int], ...]
    logical_shapes: tuple[tuple[int, ...], ...]
    remat: tuple[Remat, ...] = ()
    zero: tuple[bool, ...] = ()

    def __post_init__(self):
        spans = _check_shape_tuple("ManualStageOption", "layer_spans", self.layer_spans)
        n = len(spans)
        zero = tuple(self.zero)
        if zero and (len(zero) != n or not all(isinstance(z, bool) for z in zero)):
            raise InvalidArgumentError(
                f"ManualStageOption.zero={self.zero!r}: give one bool per stage ({n}), or none "
                "(the search splits a stage's optimizer state over its data axis where memory "
                f"needs it). Fix: e.g. zero=({', '.join(['False'] * n)}{',' * (n == 1)}).")
        object.__setattr__(self, "zero", zero)
        remat = tuple(Remat.of(r, "ManualStageOption.remat") for r in self.remat)
        if remat and len(remat) != n:
            raise InvalidArgumentError(
                f"ManualStageOption.remat={self.remat!r} has {len(remat)} entries for {n} "
                "stage(s). Fix: give one per stage, or none (the method's remat for every "
                "stage).")
        object.__setattr__(self, "remat", remat)
        object.__setattr__(self, "layer_spans", spans)
        object.__setattr__(self, "submesh_shapes", _check_shape_tuple(
            "ManualStageOption", "submesh_shapes", self.submesh_shapes, n))
        object.__setattr__(self, "logical_shapes", _check_shape_tuple(
            "ManualStageOption", "logical_shapes", self.logical_shapes, n))
        for p, (a, b) in enumerate(spans):
            if b < a or (p and a != spans[p - 1][1] + 1) or (p == 0 and a != 0):
                raise InvalidArgumentError(
                    f"ManualStageOption.layer_spans={spans!r}: stage {p} covers layers {a}..{b}; "
                    "spans must be (first, last) pairs covering 0..L-1 in order. Fix: e.g. "
                    "layer_spans=((0, 1), (2, 3)) for 4 layers in 2 stages.")
        for p, (sub, logical) in enumerate(zip(self.submesh_shapes, self.logical_shapes)):
            if math.prod(sub) != math.prod(logical) or len(sub) != 2:
                raise InvalidArgumentError(
                    f"ManualStageOption: stage {p} has submesh {sub} ({math.prod(sub)} devices) "
                    f"but logical mesh {logical}. Fix: give the submesh as (hosts, devices) and "
                    "a logical shape with the same device count, e.g. (1, 4) and (2, 2).")


StageOption = AutoStageOption | UniformStageOption | ManualStageOption


@dataclass(frozen=True, slots=True, kw_only=True)
class PipeshardParallel(ShardParallel):
    """Inter- and intra-op parallelism (Alpa's PipeshardParallel): the loss is cut into layers,
    layers are grouped into pipeline stages, each stage runs on its own submesh with shardings
    from the intra-op ILP, and microbatches flow through the stages under `schedule`.

    A training step takes its gradient with `autopar.value_and_grad` / `autopar.grad`; a
    step with no gradient at all (an eval step: logits, a mean loss) runs as a forward-only
    pipeline (`Schedule.FORWARD`, whatever `schedule` says), its outputs put back together
    over the microbatches (rows in batch order, means averaged).

    Args:
      num_microbatches: the batch is split into this many equal microbatches (it must
        divide the batch size); the loss, gradients and aux come back as the full batch's,
        combined over microbatches as `ShardParallel.num_microbatches` says.
      schedule: `Schedule.ONE_F_ONE_B` (default; at most S microbatches in flight per stage),
        `Schedule.GPIPE`, `Schedule.INTERLEAVED_1F1B` or `Schedule.ZERO_BUBBLE_V` (2 stage
        chunks per device group; with AutoStageOption, the search places the chunks), or a
        zero-bubble table: `Schedule.ZERO_BUBBLE_H1` (each backward
        split into B, the input gradient, and W, the weight gradient, W filling the bubble:
        about a third of 1F1B's bubble, every stage holding up to S microbatches, 1F1B's
        first stage's count), `Schedule.ZERO_BUBBLE_H2` (about twice as many in flight), or
        `Schedule.AUTO`: the schedule is searched with the stages (with AutoStageOption:
        1F1B's stage DP, then ZB-H1's and ZB-H2's own DPs and the chunk layouts of the
        chunked two, every layout priced by each schedule's table with its stages' F, B and
        W times); the fastest that fits memory runs (`plan.pipeline["schedule_search"]`
        prices every schedule for the chosen stages, `plan.alternatives` the other layouts).
      layer_option: `AutoLayerOption(num_layers=...)` or `ManualLayerOption()`.
      stage_option: `AutoStageOption()`, `UniformStageOption(num_stages=...)` or
        `ManualStageOption(...)`.
      max_in_flight_calls: the executor waits on the call this many dispatches back (JAX on
        simulated CPU devices hangs with too many queued collectives; see JAX_NOTES).

    Example:
        >>> method = autopar.PipeshardParallel(
        ...     num_microbatches=8, schedule=autopar.Schedule.ONE_F_ONE_B,
        ...     layer_option=autopar.AutoLayerOption(num_layers=4),
        ...     stage_option=autopar.UniformStageOption(num_stages=2))
    """
    schedule: Schedule = Schedule.ONE_F_ONE_B
    layer_option: AutoLayerOption | ManualLayerOption = AutoLayerOption()
    stage_option: StageOption = AutoStageOption()
    max_in_flight_calls: int = 16

    def __post_init__(self):
        super(PipeshardParallel, self).__post_init__()
        v = self.max_in_flight_calls
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise InvalidArgumentError(
                f"PipeshardParallel.max_in_flight_calls={v!r} must be an int >= 1. Fix: e.g. "
                "PipeshardParallel(max_in_flight_calls=16).")
        if not isinstance(self.schedule, Schedule):
            raise InvalidArgumentError(
                f"PipeshardParallel.schedule={self.schedule!r} is not a Schedule. Fix: pass one "
                f"of {[s for s in Schedule]}, e.g. schedule=autopar.Schedule.ONE_F_ONE_B.")
        if not isinstance(self.layer_option, (AutoLayerOption, ManualLayerOption)):
            raise InvalidArgumentError(
                f"PipeshardParallel.layer_option={self.layer_option!r} is not a layer option. "
                "Fix: pass AutoLayerOption(num_layers=...) or ManualLayerOption().")
        if not isinstance(self.stage_option, (AutoStageOption, UniformStageOption,
                                              ManualStageOption)):
            raise InvalidArgumentError(
                f"PipeshardParallel.stage_option={self.stage_option!r} is not a stage option. "
                "Fix: pass AutoStageOption(), UniformStageOption(num_stages=...) or "
                "ManualStageOption(...).")

    @property
    def kind(self) -> MethodKind:
        return MethodKind.PIPESHARD


__all__ = ["LayerReuse", "MethodKind", "ShardParallel", "DataParallel", "Zero2Parallel",
           "Zero3Parallel", "SolverBackend",
           "PipeshardParallel", "AutoLayerOption", "ManualLayerOption", "AutoStageOption",
           "UniformStageOption", "ManualStageOption", "Schedule", "Remat"]
