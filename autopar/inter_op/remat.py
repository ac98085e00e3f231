"""Rematerialization as a search dimension: per layer, keep every activation (`none`), keep
the matmul outputs and recompute the cheap elementwise work (`selective`, JAX's
`dots_saveable`), or keep only the layer's input (`full`).

A choice is applied to a loss's forward `OpGraph`: the nodes of a rematerialized layer get a
`RematRegion` with the choice's policy, so that whatever differentiates the graph (a pipeline
stage's `jax.vjp`) runs them under `jax.checkpoint`. (A single-mesh step is rewritten
instead: `step_remat`.) Tracing that gradient gives a graph whose
residuals, recomputation and barriers are the real ones: the ILP prices their memory and
FLOPs like any other operator, and lowering emits what XLA keeps (the barrier of issue 7). A
user's own `jax.checkpoint` is kept as given: its nodes are never re-wrapped.

Example:
    >>> forward = with_remat(loss.forward, boundaries, (Remat.FULL, Remat.NONE))
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax

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


def candidates(num_layers: int) -> list[tuple[Remat, ...]]:
    """The remat plans a search tries, from the least recomputation to the most:
    selective on the first k layers (k = 1..L), then full on the first k with the rest
    selective. Memory falls (about) monotonically along the list, so the search bisects it
    for the first plan that fits."""
    out = []
    for k in range(1, num_layers + 1):
        out.append((Remat.SELECTIVE,) * k + (Remat.NONE,) * (num_layers - k))
    for k in range(1, num_layers + 1):
        out.append((Remat.FULL,) * k + (Remat.SELECTIVE,) * (num_layers - k))
    return out
