"""The enums a user passes to a method (`autopar.ShardParallel(remat=..., solver=...)`,
`PipeshardParallel(schedule=...)`): values only, so that the options and every pass below them
can name them without importing the pass that acts on them."""
from __future__ import annotations

import enum

from autopar.core.errors import InvalidArgumentError


class Schedule(enum.Enum):
    """Pipeline schedule policy (`inter_op.schedule` builds each one's table)."""
    GPIPE = "gpipe"            # all forwards, then all backwards
    ONE_F_ONE_B = "1f1b"       # PipeDream-flush: warm-up forwards, steady 1F1B, cool-down backwards
    # v stage chunks per device group, stage k on group k mod G (Megatron's interleaved 1F1B)
    INTERLEAVED_1F1B = "interleaved-1f1b"
    # the backward split into B (input gradient) and W (weight gradient), W filling the
    # bubble: H1 at 1F1B's in-flight activations, H2 with about twice as many (Qi et al.)
    ZERO_BUBBLE_H1 = "zb-h1"
    ZERO_BUBBLE_H2 = "zb-h2"
    ZERO_BUBBLE_V = "zb-v"     # 2 chunks per group in a V (stage k and 2G-1-k on group k)
    AUTO = "auto"              # the stage search prices every schedule a plan can run
    # forwards only, each as soon as its input is ready: the schedule of a step without a
    # gradient (an eval step), whatever schedule the method names
    FORWARD = "forward"


class SolverBackend(enum.Enum):
    """Which MIP solver runs the reduced model."""
    HIGHS = "highs"   # highspy, model passed as numpy arrays (fast); the default
    CBC = "cbc"       # pulp.PULP_CBC_CMD


class Remat(str, enum.Enum):
    """What a layer keeps for its backward pass.

    `AUTO` (the default of every method) lets the search choose per layer (per stage in a
    pipeline) where memory needs it; the others apply to every layer.
    """
    AUTO = "auto"
    NONE = "none"            # keep every activation the backward reads
    SELECTIVE = "selective"  # keep matmul / conv outputs, recompute the elementwise work
    FULL = "full"            # keep only the layer's input; recompute its whole forward

    @classmethod
    def of(cls, value, where: str = "remat") -> Remat:
        """`value` as a Remat (plain strings accepted), or a clear error."""
        try:
            return cls(value)
        except ValueError:
            raise InvalidArgumentError(
                f"{where}={value!r} is not a rematerialization choice ('auto': searched "
                "where memory needs it, 'none': keep every activation, 'selective': recompute "
                "elementwise work, 'full': recompute each layer from its input). Fix: pass one "
                f"of {[r.value for r in cls]}, e.g. {where}='auto'.") from None


class Annotations(str, enum.Enum):
    """What the plan does with the sharding annotations in the user's code."""
    PIN = "pin"          # annotated values take exactly the annotated sharding
    HINT = "hint"        # a preference: other shardings pay the move into the annotated one
    IGNORE = "ignore"    # planned as if the code had no annotations


class SolveStatus(enum.Enum):
    """How a solution was obtained."""
    OPTIMAL = "optimal"
    FEASIBLE = "feasible"        # the solver stopped early (time limit); its best incumbent is used
    FALLBACK = "fallback"        # the solver stopped with no incumbent or failed; greedy plan used
    INFEASIBLE = "infeasible"    # the memory constraints cannot be met
