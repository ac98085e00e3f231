"""The interleaved and zero-bubble schedule tables (issue 27): every table valid, within its
in-flight promise, and timed as the literature says (unit F, B and W; 1F1B's and
interleaved's B is the whole backward, 2 units; a stage chunk of v per group takes 1/v of a
whole stage's time); the checker rejects hand-broken tables. Pure Python, no JAX."""
from __future__ import annotations

import dataclasses
import itertools

import pytest

from autopar.core.errors import InvalidArgumentError
from autopar.runtime import Phase, Schedule, Task, check_schedule, make_schedule, simulate

F = lambda k, m: Task(Phase.FORWARD, k, m)    # noqa: E731
B = lambda k, m: Task(Phase.BACKWARD, k, m)   # noqa: E731
W = lambda k, m: Task(Phase.WEIGHT, k, m)     # noqa: E731
GRID = list(itertools.product(range(1, 7), range(1, 17)))    # (device groups, M)


def _tables():
    for G, M in GRID:
        for schedule in Schedule:
            if schedule is Schedule.AUTO:          # a choice of the search, not a table
                continue
            if schedule is Schedule.INTERLEAVED_1F1B:
                for v in (2, 3):
                    yield G, M, v, make_schedule(schedule, G * v, M, virtual_stages=v)
            elif schedule is Schedule.ZERO_BUBBLE_V:
                yield G, M, 2, make_schedule(schedule, 2 * G, M)
            else:
                yield G, M, 1, make_schedule(schedule, G, M)


def _span(s, v=1) -> float:
    """The makespan with unit F, B and W (a whole, unsplit backward: 2), chunks 1/v."""
    whole = lambda t: 2.0 if t.phase is Phase.BACKWARD and not s.split_backward else 1.0
    return simulate(s, lambda t: whole(t) / v).makespan


def test_every_table_is_valid_complete_and_within_its_promise():
    for G, M, v, s in _tables():
        check_schedule(s)
        tasks = s.order()
        per = len(s.phases)          # F, B (and W where split); F alone for FORWARD
        assert len(tasks) == len(set(tasks)) == per * G * v * M, (s.schedule, G, M, v)
        assert s.num_groups == G and s.num_stages == G * v
        assert all(p <= q for p, q in zip(s.group_in_flight(), s.promise))
        for g in range(G):
            assert all(s.group_of(t.stage) == g for t in s.tasks_of(g))


def test_the_forward_table_streams_each_forward_as_soon_as_its_input_is_ready():
    for S, M in GRID:
        s = make_schedule(Schedule.FORWARD, S, M)
        assert s.phases == (Phase.FORWARD,)
        assert simulate(s, lambda t: 1.0).makespan == M + S - 1 == s.num_clocks
        assert s.held() == s.in_flight() == (0,) * S        # nothing kept for a backward
        assert s.tasks_of(S - 1) == tuple(F(S - 1, m) for m in range(M))


def test_the_checker_rejects_a_backward_in_a_forward_table():
    s = make_schedule(Schedule.FORWARD, 2, 2)
    broken = dataclasses.replace(s, clocks=s.clocks + ((None, B(1, 0)),))
    with pytest.raises(InvalidArgumentError, match=r"rule 'exactly once': B\(stage=1, "
                       r"microbatch=0\) is a backward task, but Schedule.FORWARD runs "
                       r"forwards only"):
        check_schedule(broken)
    check_schedule(s)


def test_zb_h1_cuts_the_bubble_of_1f1b_to_a_third_at_its_in_flight_activations():
    for S, M in GRID:
        if M < S:
            continue
        h1, one = make_schedule(Schedule.ZERO_BUBBLE_H1, S, M), \
            make_schedule(Schedule.ONE_F_ONE_B, S, M)
        assert _span(one) == 3 * M + 3 * (S - 1)          # bubble 3(S-1) units
        assert _span(h1) == 3 * M + (S - 1), (S, M)        # a third of it
        assert h1.in_flight() == one.in_flight()
        assert max(h1.deferred_weights()) <= S


def test_zb_h2_is_never_slower_than_h1_and_keeps_about_twice_the_activations():
    for S, M in GRID:
        h1, h2 = make_schedule(Schedule.ZERO_BUBBLE_H1, S, M), \
            make_schedule(Schedule.ZERO_BUBBLE_H2, S, M)
        assert _span(h2) <= _span(h1)
        assert h2.in_flight() == tuple(min(2 * (S - k) - 1, M) for k in range(S))


def test_interleaved_divides_the_bubble_of_1f1b_by_the_chunks():
    """Megatron's claim: with M a multiple of the groups, the bubble is 1F1B's / v; never
    slower than 1F1B, at a larger in-flight count per group."""
    for G, M in GRID:
        one = _span(make_schedule(Schedule.ONE_F_ONE_B, G, M))
        for v in (2, 3):
            s = make_schedule(Schedule.INTERLEAVED_1F1B, G * v, M, virtual_stages=v)
            assert s.placement == tuple(k % G for k in range(G * v))
            assert _span(s, v) <= one + 1e-9, (G, M, v)
            if M % G == 0:
                assert _span(s, v) == pytest.approx(3 * M + 3 * (G - 1) / v), (G, M, v)


def test_zb_v_is_near_zero_bubble_at_the_activations_of_1f1b():
    """A V of 2 chunks per group (stage k and 2G-1-k on group k): a bubble of (G-1)/2 units
    (1F1B's: 3(G-1)), holding at most 2G chunk-microbatches (G whole-stage ones, 1F1B's
    stage 0)."""
    for G, M in GRID:
        s = make_schedule(Schedule.ZERO_BUBBLE_V, 2 * G, M)
        assert s.placement == (*range(G), *reversed(range(G)))
        assert max(s.group_in_flight()) <= 2 * G
        if M >= G:
            assert _span(s, 2) == pytest.approx(3 * M + (G - 1) / 2), (G, M)


def test_the_runtime_order_is_the_table_in_clock_order():
    s = make_schedule(Schedule.ZERO_BUBBLE_H1, 2, 3)
    assert [str(t) for t in s.tasks_of(1)] == "F0 B0 F1 B1 W0 F2 B2 W1 W2".split()
    assert s.order()[:3] == (F(0, 0), F(0, 1), F(1, 0))
    assert s.deferred_weights() == (1, 2)


def _broken(s, edit):
    rows = [list(r) for r in s.clocks]
    edit(rows)
    return dataclasses.replace(s, clocks=tuple(tuple(r) for r in rows))


def _where(s, task):
    return next((c, g) for c, row in enumerate(s.clocks) for g, t in enumerate(row)
                if t == task)


def _swap(s, a, b):
    (ca, ga), (cb, gb) = _where(s, a), _where(s, b)

    def edit(rows):
        rows[ca][ga], rows[cb][gb] = rows[cb][gb], rows[ca][ga]
    return _broken(s, edit)


def test_the_checker_rejects_a_w_before_its_b():
    s = make_schedule(Schedule.ZERO_BUBBLE_H1, 2, 3)
    check_schedule(s)
    bad = _swap(s, B(1, 1), W(1, 1))
    with pytest.raises(InvalidArgumentError, match=r"W\(s, m\) after B\(s, m\).*W\(stage=1"):
        check_schedule(bad)


def test_the_checker_rejects_an_f_that_skips_a_stage():
    s = make_schedule(Schedule.INTERLEAVED_1F1B, 4, 4, virtual_stages=2)
    bad = _swap(s, F(0, 0), F(2, 0))   # group 0 runs chunk 1 first, before stage 1 ran
    with pytest.raises(InvalidArgumentError,
                       match=r"F\(s, m\) after F\(s-1, m\).*F\(stage=2, microbatch=0\)"):
        check_schedule(bad)


def test_the_checker_rejects_w_tasks_where_b_holds_them_and_their_absence_where_split():
    one = make_schedule(Schedule.ONE_F_ONE_B, 2, 2)
    with pytest.raises(InvalidArgumentError, match="weight-gradient task"):
        check_schedule(_broken(one, lambda rows: rows.append([W(0, 0), None])))
    h1 = make_schedule(Schedule.ZERO_BUBBLE_H1, 2, 2)
    c, g = _where(h1, W(0, 1))
    with pytest.raises(InvalidArgumentError, match=r"exactly once.*W\(stage=0, microbatch=1\)"):
        check_schedule(_broken(h1, lambda rows: rows[c].__setitem__(g, None)))


def test_the_checker_holds_a_table_to_its_in_flight_promise():
    s = make_schedule(Schedule.ONE_F_ONE_B, 2, 4)
    tight = dataclasses.replace(s, promise=(1, 1))
    with pytest.raises(InvalidArgumentError, match="in-flight promise.*group 0 holds 2"):
        check_schedule(tight)


def test_the_checker_rejects_a_task_off_its_group_and_a_bad_placement():
    s = make_schedule(Schedule.ZERO_BUBBLE_V, 4, 2)
    c, g = _where(s, F(3, 0))          # stage 3 lives on group 0 in the V
    assert g == 0
    with pytest.raises(InvalidArgumentError, match="task in its group's column"):
        check_schedule(_broken(s, lambda rows: (rows[c].__setitem__(0, None),
                                                rows[c].__setitem__(1, F(3, 0)))))
    with pytest.raises(InvalidArgumentError, match="placement"):
        check_schedule(dataclasses.replace(s, placement=(0, 2, 2, 0)))


@pytest.mark.parametrize("schedule, stages, kw, match", [
    (Schedule.ZERO_BUBBLE_V, 3, {}, "multiple of 2"),
    (Schedule.ZERO_BUBBLE_V, 4, {"virtual_stages": 3}, "exactly 2 stage chunks"),
    (Schedule.INTERLEAVED_1F1B, 6, {"virtual_stages": 4}, "multiple of 4"),
    (Schedule.ONE_F_ONE_B, 4, {"virtual_stages": 2}, "one stage per device group"),
    (Schedule.INTERLEAVED_1F1B, 4, {"virtual_stages": 0}, "virtual_stages"),
])
def test_bad_chunk_arguments_are_named(schedule, stages, kw, match):
    with pytest.raises(InvalidArgumentError, match=match):
        make_schedule(schedule, stages, 4, **kw)
