"""ILP side of loops: strategies for the pseudo-nodes that connect a loop body to the outside
(`frontend.loops`), and the per-iteration pricing of body operators.

A body operator is an ordinary ILP node (one variable set per body: a body is solved once);
its compute and communication costs, and the resharding it causes, are multiplied by the
trip count (`OpGraph.node_trips`). The carry-in is a leader over every sharding of the
carry; the carry-out is charged, per iteration, for moving into it (`loop_exit` joins the
carry-in's group). Slices and stacks follow the value they come from, keeping the iteration
dimension whole.

Example:
    >>> [s.out_specs for s in carry_rule(ctx, carry_node)][:2]
    [(((), ()),), (((0,), ()),)]
"""
from __future__ import annotations

import dataclasses

from autopar.core.spec import Spec, enumerate_specs, replicated
from autopar.frontend.loops import BRANCH_EXIT, LOOP_CARRY, LOOP_EXIT, LOOP_SLICE, LOOP_STACK
from autopar.intra_op.rules import RuleContext, Strategy


def _strategy(name: str, in_specs, out_spec: Spec) -> Strategy:
    return Strategy(name=name, in_specs=tuple(in_specs), out_specs=(out_spec,),
                    compute_s=0.0, comm_s=0.0)


def slice_rule(ctx: RuleContext, node, pos: int, spec: Spec) -> Strategy:
    """outer xs [T, ...] with `spec` -> body x: dim 0 is gathered if it was split."""
    return _strategy("slice", [((),) + spec[1:]], spec[1:])


def stack_rule(ctx: RuleContext, node, pos: int, spec: Spec) -> Strategy:
    """body y with `spec` -> outer ys [T, ...] with dim 0 whole."""
    return _strategy("stack", [spec], ((),) + spec)


def carry_rule(ctx: RuleContext, node) -> list[Strategy]:
    """Every sharding of the carry; the init is moved into it once, before the loop."""
    t = ctx.t(node.outputs[0])
    specs = [replicated(t.rank)] if t.dtype in ("key", "token") \
        else enumerate_specs(t.shape, ctx.mesh_shape)
    return [_strategy("carry", [s] * len(node.inputs), s) for s in specs]


def exit_strategies(carry_in_specs: list[Spec]) -> list[Strategy]:
    """`loop_exit` in the carry-in's group: the carry-out moves into the carry-in's sharding
    (every iteration) and the final carry has it."""
    return [_strategy("carry", [s], s) for s in carry_in_specs]


def scaled(strategies: list[Strategy], trips: int) -> list[Strategy]:
    """Strategies of an operator that runs `trips` times per step."""
    if trips == 1:
        return strategies
    return [dataclasses.replace(s, compute_s=s.compute_s * trips, comm_s=s.comm_s * trips)
            for s in strategies]


LOOP_FOLLOW_RULES = {LOOP_SLICE: slice_rule, LOOP_STACK: stack_rule}
LOOP_LEADER_RULES = {LOOP_CARRY: carry_rule, BRANCH_EXIT: carry_rule}

__all__ = ["LOOP_FOLLOW_RULES", "LOOP_LEADER_RULES", "LOOP_EXIT", "carry_rule",
           "exit_strategies", "scaled", "slice_rule", "stack_rule"]
