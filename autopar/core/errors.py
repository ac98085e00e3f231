"""Errors raised by autopar. Every message names the rule, the offending value, where it came
from, and how to fix it."""
from __future__ import annotations


class AutoparError(Exception):
    """Base class of every error autopar raises."""


class InvalidArgumentError(AutoparError, ValueError):
    """An argument to the public API breaks a rule (wrong `batch_argnums`, a mesh that does not
    match the devices, a batch that does not divide the mesh, ...)."""


class InfeasiblePlanError(AutoparError):
    """No sharding plan fits the per-device memory budget.

    Attributes:
      needed_bytes: peak bytes per device of the best plan found (the minimum-memory plan).
      budget_bytes: the per-device budget the plan had to fit.
    """

    def __init__(self, message: str, *, needed_bytes: int, budget_bytes: int):
        super().__init__(message)
        self.needed_bytes = int(needed_bytes)
        self.budget_bytes = int(budget_bytes)


class UnsupportedError(AutoparError):
    """A construct autopar cannot plan or lower (a primitive, an effect, a mesh shape)."""


class PlanMismatchError(AutoparError):
    """A saved plan does not match the function or arguments it is applied to."""


class ProfileError(AutoparError):
    """A device profile is corrupt, of another version, or for another device or mesh."""


class FallbackWarning(UserWarning):
    """An operator had no sharding rule and was replicated (operands gathered on every
    device, results whole on every device): the message names the primitive, its source line
    and the bytes each device then holds. Silence it with `warnings.filterwarnings("ignore",
    category=autopar.FallbackWarning)` once the cost is understood."""


class MicrobatchReductionWarning(UserWarning):
    """With `num_microbatches > 1` (gradient accumulation, pipelines) an output of the loss
    function (the loss, or an auxiliary output) could not be shown to combine exactly over
    microbatches: it is not a mean, a sum or a ratio of sums over the examples, nor a value
    with the batch dimension (see `autopar.value_and_grad`). The message names the output, its
    source line, why, and how to rewrite it. For the loss, the gradient trained on is then
    the microbatches' mean, not the full batch's."""
