"""What `parallelize` does to a step and its arguments before the passes see them: keyword
arguments bound to positions, NNX objects split into state pytrees (`frontend.nnx`), NNX
states donated, `in_shardings` pinned as exact-path `sharding_rules` and `out_shardings` as
result pins (`frontend.jit_options`).

Example:
    >>> front = StepFrontend(fun=PureStep(train_step), static=(), donate=(), batch=(3,),
    ...                      pins=PinnedShardings())
    >>> with front.bind(args, kwargs) as call:
    ...     graph = trace(front.fun, call.args, donate_argnums=front.donated(call.args))
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import jax

from autopar.core.graph import OpGraph
from autopar.frontend.checks import arg_names
from autopar.frontend.jit_options import PinnedShardings
from autopar.frontend.metadata import metadata_rules
from autopar.frontend.nnx import BoundCall, NnxState, PureStep
from autopar.frontend.tracer import bind_arguments, check_argnums

if TYPE_CHECKING:      # options imports the intra-op solver, which imports back here
    from autopar.core.options import ShardParallel


@dataclass(frozen=True, slots=True, kw_only=True)
class StepFrontend:
    fun: PureStep                       # the step as a pure function of NNX states
    static: tuple[int, ...]
    donate: tuple[int, ...]
    batch: tuple[int, ...]
    pins: PinnedShardings

    def bind(self, args: tuple, kwargs: dict | None = None) -> BoundCall:
        """The call's arguments bound to positions; inside the returned context NNX objects
        are state pytrees (`call.args`) and `call.finish` writes their new state back."""
        args = bind_arguments(self.fun, args, kwargs or {})
        return BoundCall(args, static_argnums=self.static, batch_argnums=self.batch,
                         names=arg_names(self.fun, len(args)))

    def donated(self, args: tuple) -> tuple[int, ...]:
        """donate_argnums and the NNX states (replaced in place, as nnx.jit replaces them)."""
        return tuple(sorted(set(check_argnums("donate_argnums", self.donate, len(args))) | {
            i for i, a in enumerate(args) if isinstance(a, NnxState)}))

    def method(self, args: tuple, method: ShardParallel, mesh) -> ShardParallel:
        """`method` with `in_shardings` pinned as exact-path `sharding_rules`, then (with
        `annotations="pin"`) the parameters' sharding metadata (`frontend.metadata`)."""
        static = check_argnums("static_argnums", self.static, len(args))
        names = arg_names(self.fun, len(args))
        rules = self.pins.input_rules(args, static, names, mesh)
        if method.annotations.value == "pin":
            rules += metadata_rules(args, static, names, mesh)
        return dataclasses.replace(method, sharding_rules=rules + tuple(
            method.sharding_rules)) if rules else method

    def out_pins(self, graph: OpGraph, args: tuple, mesh) -> dict:
        """Result position -> pinned Spec (`out_shardings`)."""
        return self.pins.output_specs(
            graph.out_tree, [graph.tensors[t].shape for t in graph.outputs],
            sum(isinstance(a, NnxState) for a in args), mesh)

    def leaves(self, args: tuple) -> list:
        """The flat leaves of the non-static arguments."""
        return jax.tree_util.tree_leaves(tuple(a for i, a in enumerate(args)
                                               if i not in self.static))
