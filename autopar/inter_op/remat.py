"""Rematerialization as a search dimension: per layer, keep every activation (`none`), keep
the matmul outputs and recompute the cheap elementwise work (`selective`, JAX's
`dots_saveable`), or keep only the layer's input (`full`).

A choice is applied to a loss's forward `OpGraph`: the nodes of a rematerialized layer get a
`RematRegion` with the choice's policy, so that whatever differentiates the graph (a pipeline
stage's `jax.vjp`, or the single-mesh step's `autopar.value_and_grad` expanded by
`remat_expand`) runs them under `jax.checkpoint`. Tracing that gradient gives a graph whose
residuals, recomputation and barriers are the real ones: the ILP prices their memory and
FLOPs like any other operator, and lowering emits what XLA keeps (the barrier of issue 7). A
user's own `jax.checkpoint` is kept as given: its nodes are never re-wrapped.

Example:
    >>> forward = with_remat(loss.forward, boundaries, (Remat.FULL, Remat.NONE))
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.extend.core as jcore

from autopar.core.enums import Remat
from autopar.core.errors import InvalidArgumentError
from autopar.core.graph import OpGraph, RematRegion

CONCRETE = (Remat.NONE, Remat.SELECTIVE, Remat.FULL)   # cheapest recomputation first


def choices_of(remat: Remat) -> tuple[Remat, ...]:
    """The concrete choices a method's `remat` lets the search take."""
    return CONCRETE if remat == Remat.AUTO else (remat,)


def policy_of(choice: Remat):
    """The `jax.checkpoint` policy of a concrete choice (None for FULL: save nothing)."""
    if choice == Remat.SELECTIVE:
        return jax.checkpoint_policies.dots_saveable
    if choice == Remat.FULL:
        return None
    raise InvalidArgumentError(f"no checkpoint policy for remat choice {choice!r}")


def with_remat(forward: OpGraph, boundaries: Sequence[int],
               choices: Sequence[Remat]) -> OpGraph:
    """`forward` with the nodes of layer l (`boundaries[l]` to `boundaries[l + 1]`) in a
    `RematRegion` of `choices[l]`'s policy; NONE leaves a layer as it is, and nodes already in
    the user's own remat keep it."""
    if len(choices) != len(boundaries) - 1:
        raise InvalidArgumentError(
            f"{len(choices)} remat choice(s) for {len(boundaries) - 1} layer(s): give one per "
            "layer.")
    nodes = list(forward.nodes)
    for layer, choice in enumerate(choices):
        choice = Remat.of(choice)
        if choice == Remat.AUTO:
            raise InvalidArgumentError("with_remat needs concrete choices, not 'auto'.")
        if choice == Remat.NONE:
            continue
        region = RematRegion(id=-(layer + 1), policy=policy_of(choice), prevent_cse=True)
        for i in range(boundaries[layer], boundaries[layer + 1]):
            if nodes[i].remat is None:
                nodes[i] = dataclasses.replace(nodes[i], remat=region)
    return dataclasses.replace(forward, nodes=tuple(nodes))


def run_forward(forward: OpGraph, *args):
    """Evaluate `forward` on its inputs (re-emitting its equations, remat regions under
    `jax.checkpoint`); its outputs in order."""
    from autopar.frontend.interpret import run_nodes
    env = dict(forward.const_values)
    env.update(zip(forward.inputs, args))
    run_nodes(forward, forward.nodes, env)
    return [env[t] for t in forward.outputs]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LossRemat:
    """A single-mesh step's rematerialization: the loss (the `autopar.value_and_grad` marker's
    jaxpr) cut into layers at `boundaries` (node indices of its forward graph) and a concrete
    choice per layer."""
    boundaries: tuple[int, ...]
    choices: tuple[Remat, ...]

    def to_json(self) -> dict:
        return {"layer_boundaries": list(self.boundaries),
                "layers": [c.value for c in self.choices]}

    @classmethod
    def from_json(cls, d: dict) -> LossRemat:
        return cls(boundaries=tuple(int(b) for b in d["layer_boundaries"]),
                   choices=tuple(Remat.of(c) for c in d["layers"]))


def loss_forward(jaxpr: jcore.ClosedJaxpr) -> OpGraph:
    """The forward graph of a marker's loss jaxpr (as `split_step` traces it)."""
    from autopar.frontend.tracer import trace
    return trace(jcore.jaxpr_as_fun(jaxpr),
                 [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in jaxpr.in_avals])


def remat_expand(remat: LossRemat):
    """An `expand` for `trace(..., expand=...)`: the marker's value and gradient with the
    loss's layers rematerialized as `remat` says."""
    from autopar.frontend.grad import value_and_grad_of

    def expand(*flat_args, jaxpr: jcore.ClosedJaxpr, num_diff: int, has_aux: bool):
        forward = loss_forward(jaxpr)
        if remat.boundaries[-1] != len(forward.nodes):
            raise InvalidArgumentError(
                f"the remat plan cuts a loss of {remat.boundaries[-1]} operators but this "
                f"loss has {len(forward.nodes)}: the plan was made for another step. Fix: "
                "re-plan.")
        fwd = with_remat(forward, remat.boundaries, remat.choices)
        return value_and_grad_of(functools.partial(run_forward, fwd), flat_args, num_diff)
    return expand


def candidates(num_layers: int) -> list[tuple[Remat, ...]]:
    """The single-mesh search's remat plans, from the least recomputation to the most:
    selective on the first k layers (k = 1..L), then full on the first k with the rest
    selective. Memory falls (about) monotonically along the list, so the search bisects it
    for the first plan that fits."""
    out = []
    for k in range(1, num_layers + 1):
        out.append((Remat.SELECTIVE,) * k + (Remat.NONE,) * (num_layers - k))
    for k in range(1, num_layers + 1):
        out.append((Remat.FULL,) * k + (Remat.SELECTIVE,) * (num_layers - k))
    return out
