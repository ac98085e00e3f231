"""Tests for autopar.intra_op.copies: a resharded copy that several reads share is paid once."""
from __future__ import annotations

import itertools

import numpy as np

from autopar.intra_op.copies import (
    PRESENT,
    Read,
    duplicate_moves_s,
    settled,
    with_shared_copies,
)
from autopar.intra_op.ilp import IlpEdge, IlpProblem, brute_force, evaluate, solve_ilp

# Layouts of a 1-D value on 4 devices: whole, split, and a third one; moving costs by pair.
WHOLE, SPLIT, OTHER = ((),), ((1,),), ((0,),)
MOVE = {(SPLIT, WHOLE): 3.0, (OTHER, WHOLE): 3.0, (WHOLE, SPLIT): 0.0, (WHOLE, OTHER): 0.0,
        (SPLIT, OTHER): 1.0, (OTHER, SPLIT): 1.0}


def _mover(table):
    return lambda tid, src, dst: 0.0 if dst is None or src == dst else table[(src, dst)]


_MOVE = _mover(MOVE)


def _model(reader_wants, move=_MOVE, reader_costs=None):
    """A value (group 0, three layouts) read by one node per entry of `reader_wants` (group
    1 + i, option a wanting `reader_wants[i][a]`): the plain ILP (every read charged its move,
    as the builder makes it), its shared ILP, the copies, the layouts and the reads."""
    specs = [WHOLE, SPLIT, OTHER]
    costs = [np.array([0.5, 0.0, 0.2])]
    edges, reads = [], []
    for i, wanted in enumerate(reader_wants):
        costs.append(np.asarray(reader_costs[i], float) if reader_costs
                     else np.linspace(0.0, 0.3, len(wanted)))
        edges.append(IlpEdge(u=0, v=1 + i, cost=np.array([[move(0, s, w) for w in wanted]
                                                          for s in specs])))
        reads.append(Read(tensor=0, group=1 + i, node=1 + i, wanted=tuple(wanted)))
    plain = IlpProblem(node_costs=tuple(costs), edges=tuple(edges))
    shared, copies = with_shared_copies(plain, reads, [0], [specs], move)
    return plain, shared, copies, specs, reads


def _true_cost(plain, choice, reader_wants, specs, move=_MOVE):
    """Node costs plus each distinct (value, layout) moved once, as XLA runs it."""
    moved = {reader_wants[i][choice[1 + i]] for i in range(len(reader_wants))}
    return (sum(c[choice[g]] for g, c in enumerate(plain.node_costs))
            + sum(move(0, specs[choice[0]], w) for w in moved))


def test_a_layout_two_reads_want_gets_one_copy_group_after_the_plain_groups():
    wants = [[WHOLE, SPLIT], [WHOLE, OTHER], [OTHER]]
    plain, shared, copies, _, _ = _model(wants)
    by_spec = {c.spec: c for c in copies}
    # WHOLE: wanted by two reads and moving into it costs; OTHER likewise; SPLIT by one read.
    assert set(by_spec) == {WHOLE, OTHER}
    assert by_spec[WHOLE].nodes == (1, 2) and by_spec[OTHER].nodes == (2, 3)
    assert by_spec[WHOLE].readers == ((1, (0,)), (2, (0,)))
    assert [c.group for c in copies] == [4, 5]
    assert shared.num_strategies == (*plain.num_strategies, 2, 2)
    assert with_shared_copies(plain, [], [0], [[WHOLE, SPLIT, OTHER]], _mover(MOVE)) \
        == (plain, ())


def test_the_shared_objective_pays_each_layout_once_for_every_plan():
    """For every choice of the value and its readers, the copy groups as `settled` sets them
    (and the best copy choice) give exactly the cost of moving each wanted layout once."""
    wants = [[WHOLE, SPLIT], [WHOLE, OTHER], [OTHER, WHOLE]]
    plain, shared, copies, specs, reads = _model(wants)
    for base in itertools.product(*(range(k) for k in plain.num_strategies)):
        best = min(evaluate(shared, (*base, *extra))
                   for extra in itertools.product((0, PRESENT), repeat=len(copies)))
        true = _true_cost(plain, base, wants, specs)
        assert np.isclose(best, true) and np.isclose(evaluate(shared, settled(copies, base)),
                                                     true), base
        assert np.isclose(evaluate(plain, base) - duplicate_moves_s(
            reads, [0], [specs], base, _MOVE), true), base     # the plan's accounting
    sol, ref = solve_ilp(shared), brute_force(shared)
    assert np.isclose(sol.objective, ref.objective)
    assert np.isclose(sol.objective, min(
        _true_cost(plain, c, wants, specs)
        for c in itertools.product(*(range(k) for k in plain.num_strategies))))


def test_sharing_finds_the_plan_that_charging_every_read_misses():
    """The value is cheapest split, both readers cheapest reading it whole, and moving it
    whole costs 0.4: one shared copy (0.4 in all) beats keeping the value whole (0.5), which
    is the best plan when each read pays its own move (0.8 for the split value)."""
    move = _mover({**MOVE, (SPLIT, WHOLE): 0.4})
    wants = [[WHOLE, SPLIT], [WHOLE, SPLIT]]
    plain, shared, copies, _, _ = _model(wants, move, reader_costs=[[0.0, 0.35], [0.0, 0.35]])
    per_read = solve_ilp(plain)
    assert per_read.choice == (0, 0, 0) and np.isclose(per_read.objective, 0.5)
    sol = solve_ilp(shared, hint=settled(copies, per_read.choice))   # as solve.py starts it
    assert sol.choice[:3] == (1, 0, 0) and np.isclose(sol.objective, 0.4)


def test_the_plan_search_uses_the_shared_plan_only_where_it_is_proven(monkeypatch):
    """`solve._shared`: the shared ILP's plan where it is optimal and faster; the plain plan,
    said so, where the shared ILP stops unproven within its time."""
    import dataclasses
    from types import SimpleNamespace

    import autopar
    from autopar.intra_op import solve
    from autopar.intra_op.ilp import SolveStatus

    move = _mover({**MOVE, (SPLIT, WHOLE): 0.4})
    plain, _, _, specs, reads = _model([[WHOLE, SPLIT], [WHOLE, SPLIT]], move,
                                       reader_costs=[[0.0, 0.35], [0.0, 0.35]])
    built = SimpleNamespace(problem=plain, reads=reads, tensor_group=[0], tensor_specs=[specs],
                            group_size=list(plain.num_strategies))
    first = solve_ilp(plain)
    got = solve._shared(built, first, autopar.ShardParallel(), 1e12, move)
    assert got.choice == (1, 0, 0) and "2 shared resharded copies: 0.1 s faster" in got.message

    exact = solve.solve_ilp
    monkeypatch.setattr(solve, "solve_ilp", lambda p, **kw: dataclasses.replace(
        exact(p, **kw), status=SolveStatus.FEASIBLE))
    got = solve._shared(built, first, autopar.ShardParallel(), 1e12, move)
    assert got.choice == first.choice and got.status == SolveStatus.OPTIMAL
    assert "not proven within 1 s (feasible), the plan that charges every read kept" \
        in got.message
