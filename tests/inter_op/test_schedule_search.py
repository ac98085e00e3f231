"""`Schedule.AUTO` searched with the stages (autopar.inter_op.schedule_search): each
zero-bubble schedule's own stage DP, every layout priced under every schedule."""
from __future__ import annotations

import jax
import optax
import pytest

import autopar
from autopar.core.enums import Schedule
from autopar.inter_op.schedule import make_schedule, placement_of
from autopar.inter_op.schedule_search import Tables, bubble_of, kept_of
from autopar.inter_op.task_costs import TaskSeconds
from support.steps import assert_equivalent, make_case, mesh_of, run_steps

V100 = autopar.ClusterSpec.preset("v100-p3.16xlarge")        # one host of 8: deterministic
BUDGET = 530_000.0


def _method(schedule, budget=BUDGET):
    return autopar.PipeshardParallel(num_microbatches=8, schedule=schedule,
                                     memory_budget_bytes=budget,
                                     layer_option=autopar.AutoLayerOption(num_layers=4))


def _layout(plan):
    return [(s.layers, s.submesh) for s in plan.stages]


@pytest.mark.parametrize("budget", [BUDGET, pytest.param(560_000.0, marks=pytest.mark.slow)])
def test_auto_takes_a_layout_only_a_zero_bubble_dp_finds_and_equals_jit(budget):
    """A 4-layer GPT, 8 microbatches, priced for one V100 host under a 530 kB budget. The
    1F1B search's layout fits ZB-H1 too; ZB-H1's own DP (its deferred W's in each stage's
    memory, its smaller bubble in the objective) finds another layout, which by its table is
    faster still. AUTO takes it, it is faster than every 1F1B plan the search solved, every
    stage fits the budget under the chosen table, and the plan runs equal to jax.jit.
    At 560 kB the DP's first layout, solved whole for H1's microbatches, needs a plan over 30x
    slower than its layers' sum (a leaner one, to fit): the DP is asked again without that
    span on that submesh and finds the faster layout."""
    step, state, batches = make_case("gpt", "linen", optax.adam(1e-2), num_layers=4,
                                     batch_size=32, value_and_grad=autopar.value_and_grad)
    one = autopar.plan(step, state, batches[0], cluster=V100,
                       method=_method(Schedule.ONE_F_ONE_B, budget))
    par = autopar.parallelize(step, mesh=mesh_of((1, 8)), cluster=V100,
                              method=_method(Schedule.AUTO, budget))
    plan = par.get_plan(state, batches[0])
    chosen = Schedule(plan.pipeline["schedule"])
    assert chosen in (Schedule.ZERO_BUBBLE_H1, Schedule.ZERO_BUBBLE_H2)
    assert _layout(plan) != _layout(one)
    assert plan.pipeline["predicted_latency_s"] < one.pipeline["predicted_latency_s"]
    # the 1F1B layout priced under every schedule is among the runner-ups, and slower
    layouts = [a for a in plan.alternatives if a["kind"] == "stage layout"]
    assert layouts and all(a["predicted_step_s"] is None or a["predicted_step_s"]
                           >= plan.pipeline["predicted_latency_s"] for a in layouts)
    assert all(s.peak_memory_bytes <= budget for s in plan.stages)
    ref = run_steps(jax.jit(step), state, batches)
    got = run_steps(par, state, batches)
    assert_equivalent(ref, got, compare_params=True, rtol=2e-5)
    order = par.get_executor(state, batches[0]).stats.order
    assert sorted(map(str, order)) == sorted(map(str, make_schedule(
        chosen, len(plan.stages), 8).order()))


@pytest.mark.slow
def test_a_looser_budget_keeps_the_1f1b_layout_under_the_faster_table():
    """With memory not binding the zero-bubble DPs return the 1F1B search's layout: AUTO
    runs it under the fastest table, as the post-hoc choice did."""
    step, state, batches = make_case("gpt", "linen", optax.adam(1e-2), num_layers=4,
                                     batch_size=32, value_and_grad=autopar.value_and_grad)
    one = autopar.plan(step, state, batches[0], cluster=V100,
                       method=_method(Schedule.ONE_F_ONE_B, None))
    auto = autopar.plan(step, state, batches[0], cluster=V100, method=_method(Schedule.AUTO,
                                                                              None))
    search = {c["schedule"]: c for c in auto.pipeline["schedule_search"]}
    assert auto.pipeline["predicted_latency_s"] == min(
        c["predicted_latency_s"] for c in search.values() if c["fits"])
    assert auto.pipeline["predicted_latency_s"] <= search["1f1b"]["predicted_latency_s"]
    assert search["1f1b"]["predicted_latency_s"] <= one.pipeline["predicted_latency_s"] * (
        1 + 1e-9)


def test_the_dp_s_bubble_and_states_come_from_the_tables():
    """`bubble_of`: 1F1B leaves all of its bubble; ZB-H1 with F = B = W a third (the paper's
    (S - 1)(F + B - W) over 1F1B's (S - 1)(F + B + W)), and so does ZB-H2: a third is the
    least a synchronous table can leave with these times (the last stage starts after S - 1
    forwards and then has M (F + B + W) of work). With W twice F and B, H1 leaves F's share,
    a quarter: that bound again.
    `kept_of`: the table's own states (H1's last stage passes through S deferred W's)."""
    even, tables = TaskSeconds(1 / 3, 1 / 3, 1 / 3, 0.0), Tables()
    assert bubble_of(Schedule.ONE_F_ONE_B, 16, even, tables)(4) == pytest.approx(1.0)
    assert bubble_of(Schedule.ZERO_BUBBLE_H1, 16, even, tables)(4) == pytest.approx(1 / 3)
    assert bubble_of(Schedule.ZERO_BUBBLE_H2, 16, even, tables)(4) == pytest.approx(1 / 3)
    heavy_w = TaskSeconds(0.25, 0.25, 0.5, 0.0)
    assert bubble_of(Schedule.ZERO_BUBBLE_H1, 16, heavy_w, tables)(4) == pytest.approx(0.25)
    assert bubble_of(Schedule.ZERO_BUBBLE_H1, 16, even, tables)(1) == 1.0
    states = kept_of(Schedule.ZERO_BUBBLE_H1, 8, tables)(4)
    assert max(d for _, d in states[-1]) == 4 and max(a for a, _ in states[0]) == 4
    assert tables(Schedule.ZERO_BUBBLE_H1, 4, 8) is tables(Schedule.ZERO_BUBBLE_H1, 4, 8)


def test_auto_places_stage_chunks_where_a_chunked_table_is_fastest():
    """An 8-layer MLP, 4 microbatches, priced for one V100 host: AUTO's chunk search (2
    chunks per group of equal devices) finds a layout of 8 chunks on 4 groups of 2 devices
    faster by its table than every layout of one stage per submesh under any schedule (the
    runner-ups name theirs). Interleaved 1F1B and ZB-V each price their own placement of the
    chunks (the same chunks on other devices were once taken for one layout, and ZB-V was
    never priced): the plan records both for its stages and runs the faster. The chunks
    share their groups' devices as its table places them; the executor runs that table; the
    plan equals jax.jit."""
    step, state, batches = make_case("mlp", "linen", optax.adam(1e-2), num_layers=8,
                                     batch_size=32, value_and_grad=autopar.value_and_grad)
    par = autopar.parallelize(step, mesh=mesh_of((1, 8)), cluster=V100,
                              method=autopar.PipeshardParallel(
                                  num_microbatches=4, schedule=Schedule.AUTO,
                                  layer_option=autopar.AutoLayerOption(num_layers=8)))
    plan = par.get_plan(state, batches[0])
    chosen = Schedule(plan.pipeline["schedule"])
    assert chosen in (Schedule.INTERLEAVED_1F1B, Schedule.ZERO_BUBBLE_V)
    assert len(plan.stages) == 8
    search = {c["schedule"]: c for c in plan.pipeline["schedule_search"]}
    assert set(search) == {"interleaved-1f1b", "zb-v"}
    assert plan.pipeline["predicted_latency_s"] == search[chosen.value]["predicted_latency_s"]
    assert all(c["predicted_latency_s"] >= plan.pipeline["predicted_latency_s"]
               for c in search.values() if c["fits"])
    groups = placement_of(chosen, 8)
    for s in plan.stages:
        assert s.device_ids == plan.stages[groups.index(groups[s.index])].device_ids
    assert len({s.device_ids for s in plan.stages}) == 4
    # per device, the plan's peak is its group's two chunks together: more than either,
    # less than their own peaks summed (they keep the most microbatches at different clocks)
    devices = plan.pipeline["device_peak_bytes"]
    assert plan.peak_memory_bytes == max(devices) <= plan.memory_budget_bytes
    for s, d in zip(plan.stages, devices):
        pair = [t.peak_memory_bytes for t in plan.stages if groups[t.index] == groups[s.index]]
        assert max(pair) < d < sum(pair)
    layouts = [a for a in plan.alternatives if a["kind"] == "stage layout"]
    assert layouts and all(" under " in a["name"] for a in layouts)
    assert all(a["predicted_step_s"] > plan.pipeline["predicted_latency_s"] for a in layouts
               if a["predicted_step_s"] is not None)
    # the dump prices both against the chosen one (no 1F1B runs these stages)
    assert f"schedules priced (Schedule.AUTO), predicted step vs {chosen.value}: " \
        f"{chosen.value} 1.000x" in autopar.dump(plan)
    ref = run_steps(jax.jit(step), state, batches)
    assert_equivalent(ref, run_steps(par, state, batches), compare_params=True, rtol=2e-5)
    # every task of the table ran, each group's in the table's order (the last stage's
    # group may run a microbatch's F and B in one call)
    order, table = par.get_executor(state, batches[0]).stats.order, make_schedule(chosen, 8, 4)
    assert sorted(map(repr, order)) == sorted(map(repr, table.order()))
    for g in range(table.num_groups):
        ran = tuple(t for t in order if table.group_of(t.stage) == g)
        assert ran == table.tasks_of(g) or g == table.group_of(7)


def test_a_zero_bubble_layout_is_solved_whole_only_where_its_dp_price_is_faster():
    """`_schedule_layouts` asks the DP only for layouts whose price with the schedule's bubble
    beats the best layout priced so far (`incumbent=`) and whose bubble-free M t_max beats it
    by `MIN_GAIN` (`t_max_below=`), and solves what it answers (each stage's ILP, the costly
    part): a layout the DP itself prices slower is never solved (an 8-layer GPT under a tight
    budget spent 14 s on one). The stand-in DP keeps `solve_stage_dp`'s contract: None where
    its layout is not wanted."""
    from types import SimpleNamespace

    from autopar.inter_op.schedule_search import MIN_GAIN, _schedule_layouts
    from autopar.inter_op.stage_dp import StageAssignment, pipeline_time

    times, m = (1.0, 2.0), 8
    asked, kwargs = [], []

    def layout(best, bubble):
        choice = StageAssignment(layer_spans=((0, 0), (1, 1)), submeshes=(0, 0),
                                 stage_latency_s=times,
                                 total_latency_s=pipeline_time(times, m, bubble),
                                 num_candidates=1, num_pruned=0, search_time_s=0.0)

        def dp(options, **kw):
            kwargs.append(kw)
            return None if choice.total_latency_s >= kw["incumbent"] or max(
                times) >= kw["t_max_below"] else choice

        def solved(c, schedule):
            asked.append(c)
            return [SimpleNamespace(solution=SimpleNamespace(latency_s=t)) for t in times]
        return list(_schedule_layouts(Schedule.ZERO_BUBBLE_H1, dp, [], 1e9, solved, [0], None,
                                      None, [], lambda: best, m))

    # priced 16 + b: a best of 16.5 is beaten where b = 1/3, not where b = 1
    assert len(layout(16.5, 1 / 3)) == 1 and len(asked) == 1
    assert kwargs[-1]["incumbent"] == 16.5
    assert kwargs[-1]["t_max_below"] == pytest.approx(16.5 * (1 - MIN_GAIN) / m)
    assert layout(16.5, 1.0) == [] and len(asked) == 1
    # bubble-free, 16 must be MIN_GAIN below the best as well
    assert layout(16.0 / (1 - MIN_GAIN) * 0.999, 0.0) == [] and len(asked) == 1
    assert len(layout(16.0 / (1 - MIN_GAIN) * 1.001, 0.0)) == 1 and len(asked) == 2


@pytest.mark.parametrize("schedule", [Schedule.ZERO_BUBBLE_H1, Schedule.ZERO_BUBBLE_H2,
                                      Schedule.INTERLEAVED_1F1B, Schedule.ZERO_BUBBLE_V])
def test_the_dp_s_tables_of_many_microbatches_come_from_their_steady_pattern(schedule):
    """`kept_of` and `bubble_of` build S-stage tables of `steady_microbatches` (at most 2S + G
    microbatches, not M = 1024: GPT-39B's 16-layer search took 2.5x longer building them):
    the same states per stage and the same time beyond M microbatches' work as the full
    table, for equal and unequal F, B and W times."""
    from autopar.inter_op.schedule_search import steady_microbatches
    from autopar.inter_op.task_costs import schedule_seconds

    chunks = 2 if schedule in (Schedule.INTERLEAVED_1F1B, Schedule.ZERO_BUBBLE_V) else 1
    shares = [TaskSeconds(1 / 3, 1 / 3, 1 / 3, 0.0), TaskSeconds(0.2, 0.4, 0.4, 0.0),
              TaskSeconds(0.5, 0.3, 0.2, 0.0)]
    for s in (2, 4, 6, 8, 12):
        for m in (2 * s + 1, 3 * s + 1, 5 * s + 3, 61):
            few = steady_microbatches(schedule, s, m)
            assert few <= 2 * s + s // chunks and (m - few) % (s // chunks) == 0
            full, short = make_schedule(schedule, s, m), make_schedule(schedule, s, few)
            assert full.kept_states() == short.kept_states(), (s, m, few)
            for share in shares:
                assert schedule_seconds(full, [share] * s) - chunks * m == pytest.approx(
                    schedule_seconds(short, [share] * s) - chunks * few, abs=1e-9)
            tables = Tables()
            assert kept_of(schedule, m, tables)(s) == full.kept_states()
            got = bubble_of(schedule, m, shares[1], tables, chunks=chunks)(s)
            want = (schedule_seconds(full, [shares[1]] * s) / chunks - m) / (s - 1)
            assert got == pytest.approx(min(max(want, 0.0), 1.0))
