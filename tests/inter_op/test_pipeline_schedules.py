"""Pipeline schedules end to end (issue 27): `Schedule.ZERO_BUBBLE_H1` and `H2` split each
stage's backward into B (input gradient) and W (weight gradient) executables,
`INTERLEAVED_1F1B` and `ZERO_BUBBLE_V` place two stage chunks on each device group, and
each runs its table's order; over 3 Adam steps the losses, gradients and trained state equal
`jax.jit` on one device, on 8 simulated CPU devices (GPT, BERT MLM, an MLP split unevenly).
`Schedule.AUTO` prices them and runs the fastest that fits."""
import jax
import optax
import pytest

import autopar
from autopar.core.enums import Schedule
from autopar.inter_op.schedule import Phase, make_schedule, placement_of
from autopar.inter_op.schedule_choice import pick
from autopar.runtime.compile_only import Role, abstract_args, compile_program, shard_bytes
from autopar.verify.pipeline_memory_check import stage_memory
from support.equivalence import ROUTING_PARAM_RTOL, assert_norm_close
from support.steps import assert_equivalent, bert_mlm_case, make_case, mesh_of, run_steps

H1, H2 = autopar.Schedule.ZERO_BUBBLE_H1, autopar.Schedule.ZERO_BUBBLE_H2
IL, ZV = autopar.Schedule.INTERLEAVED_1F1B, autopar.Schedule.ZERO_BUBBLE_V


def _method(stages, schedule, microbatches, layers=4):
    return autopar.PipeshardParallel(
        num_microbatches=microbatches, schedule=schedule,
        layer_option=autopar.AutoLayerOption(num_layers=layers),
        stage_option=autopar.UniformStageOption(num_stages=stages))


def _case(model, layers, batch_size=16):
    if model == "bert":
        return bert_mlm_case()
    return make_case(model, "linen", optax.adam(1e-2), num_layers=layers,
                     batch_size=batch_size, value_and_grad=autopar.value_and_grad)


@pytest.mark.parametrize("model,layers,stages,schedule,microbatches", [
    ("mlp", 3, 2, H1, 4),           # 3 layers on 2 stages: uneven
    ("gpt", 4, 2, H1, 2),           # M = S
    ("bert", 4, 2, H2, 4),
    ("gpt", 4, 4, IL, 4),           # 4 stage chunks on 2 groups of 4 devices
    ("mlp", 4, 4, ZV, 8),           # the V: stages 0 and 3 on group 0, 1 and 2 on group 1
    pytest.param("mlp", 4, 4, H2, 8, marks=pytest.mark.slow),
    pytest.param("mlp", 3, 2, IL, 8, marks=pytest.mark.slow),     # 2 chunks on one group
    pytest.param("bert", 4, 4, ZV, 4, marks=pytest.mark.slow),
    pytest.param("gpt", 4, 4, ZV, 16, marks=pytest.mark.slow),
    pytest.param("gpt", 4, 4, H1, 16, marks=pytest.mark.slow),
    pytest.param("bert", 4, 4, H1, 8, marks=pytest.mark.slow),
])
def test_pipeline_schedules_equal_jit(model, layers, stages, schedule, microbatches):
    step, state, batches = _case(model, layers)
    ref = run_steps(jax.jit(step), state, batches)
    par = autopar.parallelize(step, mesh=mesh_of((2, 4)),
                              method=_method(stages, schedule, microbatches, layers))
    got = run_steps(par, state, batches)
    # Adam's normalization turns rounding noise in near-zero gradients into update-sized
    # differences entry by entry: the gradients of every step entrywise, the trained state
    # by the norm over the tree (the GPT's 1F1B plan with the same stages: 5.5e-4, H1 4.3e-4)
    assert_equivalent(ref, got, compare_params=False, rtol=2e-5, smooth=model != "mlp")
    assert_norm_close(ref[0], got[0], rtol=ROUTING_PARAM_RTOL, what="trained state")
    plan = par.get_plan(state, batches[0])
    assert len(plan.stages) == stages and plan.pipeline["schedule"] == schedule.value
    table = make_schedule(schedule, stages, microbatches)
    assert plan.pipeline["in_flight"] == list(table.held())
    ex = par.get_executor(state, batches[0])
    # the executor ran every F, B and W of the table, each group in the table's order (the
    # last stage's group may run a microbatch's F, B and W in one call)
    assert sorted(map(repr, ex.stats.order)) == sorted(map(repr, table.order()))
    last = table.group_of(stages - 1)
    for g in range(table.num_groups):
        ran = tuple(t for t in ex.stats.order if table.group_of(t.stage) == g)
        assert ran == table.tasks_of(g) or g == last
    # stage chunks of one group share its devices; groups are disjoint
    devices = {}
    for st in plan.stages:
        devices.setdefault(table.group_of(st.index), set()).add(st.device_ids)
    assert all(len(d) == 1 for d in devices.values())
    assert sorted(d for ds in devices.values() for ids in ds for d in ids) == list(range(8))
    # residuals are kept from F to W: never more than the table holds
    assert all(a <= b for a, b in zip(ex.stats.max_live_microbatches, table.held()))


def test_h1_holds_each_stage_at_most_1f1b_first_stage_count_and_splits_every_backward():
    step, state, batches = _case("mlp", 4)
    par = autopar.parallelize(step, mesh=mesh_of((2, 4)), method=_method(4, H1, 8))
    par(state, batches[0])
    ex = par.get_executor(state, batches[0])
    assert ex.stats.max_live_microbatches[:3] == [4, 4, 4]     # 1F1B: [4, 3, 2]
    assert sum(t.phase is Phase.WEIGHT for t in ex.stats.order) == 4 * 8
    text = autopar.dump(par.get_plan(state, batches[0]))
    assert "schedule zb-h1, 8 microbatch(es)" in text


def test_after_b_a_microbatch_keeps_only_what_w_reads():
    """ZB-H1 on the GPT: once a microbatch's B has run, its stage keeps the residuals and
    saved activations W reads (and B's hand-off), not the whole forward's residuals; the
    executor passes through the (in flight, deferred) states the table has, and the compiled
    stage peaks count each state's mix."""
    step, state, batches = _case("gpt", 4)
    par = autopar.parallelize(step, mesh=mesh_of((2, 4)), method=_method(2, H1, 4))
    par(state, batches[0])
    program = par.get_executor(state, batches[0]).p
    leaves = jax.tree.leaves((state, batches[0]))
    calls, stats = compile_program(program, abstract_args(leaves, program.in_shardings))
    table = program.schedule
    for st in program.stages:
        fwd = next(c for c in calls if c.stage == st.index and c.role is Role.FORWARD)
        w = next(c for c in calls if c.stage == st.index and c.role is Role.WEIGHT)
        kept, whole = w.args[0][0], fwd.outs[2]
        assert len(kept) == len(st.weight_residuals)
        if st.io.float_acts:      # B computes the activation gradients: W keeps a part
            assert len(kept) < len(whole) and shard_bytes(kept) < shard_bytes(whole)
        else:                     # the first stage's B has nothing to do: W is the backward
            assert len(kept) == len(whole)
            # and B is not dispatched: W reads the cotangents directly
            assert st.backward_input is None and not any(
                c.stage == st.index and c.role is Role.BACKWARD_INPUT for c in calls)
        assert stats.kept_states[st.index] <= set(table.kept_states()[st.index])
    memory = stage_memory(program, leaves, 4)
    for m in memory:
        assert m.weight_stash > 0 and m.peak == max(
            m.held + m.data + m.accumulator + m.in_flight * m.stash
            + m.deferred * m.weight_stash + m.work, m.held + m.apply)


def _auto_plan(budget=None, schedule=autopar.Schedule.AUTO, batch_size=16):
    step, state, batches = _case("mlp", 4, batch_size)
    method = autopar.PipeshardParallel(
        num_microbatches=8, schedule=schedule, memory_budget_bytes=budget,
        layer_option=autopar.AutoLayerOption(num_layers=4),
        stage_option=autopar.UniformStageOption(num_stages=4))
    par = autopar.parallelize(step, mesh=mesh_of((2, 4)), method=method)
    return par, step, state, batches


def test_schedule_auto_prices_every_schedule_and_runs_the_fastest_that_fits():
    par, step, state, batches = _auto_plan()
    plan = par.get_plan(state, batches[0])
    search = {c["schedule"]: c for c in plan.pipeline["schedule_search"]}
    assert set(search) == {"1f1b", "zb-h1", "zb-h2", "gpipe"}
    best = min((c for c in search.values() if c["fits"]), key=lambda c: c["predicted_latency_s"])
    assert plan.pipeline["schedule"] == best["schedule"]
    assert plan.pipeline["predicted_latency_s"] == best["predicted_latency_s"]
    # by its table, H1's bubble is smaller than 1F1B's for the same stages
    assert search["zb-h1"]["predicted_latency_s"] < search["1f1b"]["predicted_latency_s"]
    assert search["zb-h1"]["peak_memory_bytes"] >= search["1f1b"]["peak_memory_bytes"]
    # the plan runs the schedule it chose, and equals jax.jit
    ref = run_steps(jax.jit(step), state, batches)
    got = run_steps(par, state, batches)
    assert_equivalent(ref, got, compare_params=False, rtol=2e-5)
    order = par.get_executor(state, batches[0]).stats.order
    chosen = autopar.Schedule(plan.pipeline["schedule"])
    assert sorted(map(str, order)) == sorted(map(str, make_schedule(chosen, 4, 8).order()))
    text = autopar.dump(plan)
    assert "schedules priced (Schedule.AUTO)" in text and "1f1b" in text
    page = autopar.report(plan)                  # the report's timeline says so too
    assert f"Schedule.AUTO chose {plan.pipeline['schedule']}; predicted step vs 1F1B" in page


@pytest.mark.parametrize("schedule", [IL, ZV])
def test_the_stage_search_places_chunks_for_a_chunked_schedule(schedule):
    """A fixed chunked schedule with the stage search: layouts of 2 chunks per group of
    equal devices (the DP over one submesh size, each chunk within half the budget), the
    fastest by its table; the chunks share their groups' devices as the table places them,
    and the plan equals jax.jit."""
    step, state, batches = _case("mlp", 4)
    method = autopar.PipeshardParallel(
        num_microbatches=4, schedule=schedule, layer_option=autopar.AutoLayerOption(num_layers=4))
    par = autopar.parallelize(step, mesh=mesh_of((2, 4)), method=method)
    plan = par.get_plan(state, batches[0])
    assert plan.pipeline["schedule"] == schedule.value and len(plan.stages) == 4
    groups = placement_of(schedule, 4)
    for s in plan.stages:
        twin = plan.stages[groups.index(groups[s.index])]
        assert s.device_ids == twin.device_ids and len(s.device_ids) == 4
    assert all(s.peak_memory_bytes <= plan.memory_budget_bytes / 2 for s in plan.stages)
    ref = run_steps(jax.jit(step), state, batches)
    assert_equivalent(ref, run_steps(par, state, batches), compare_params=True, rtol=2e-5)


def test_a_chunked_schedule_on_too_few_layers_is_refused_by_name():
    step, state, batches = _case("mlp", 3)
    method = autopar.PipeshardParallel(
        num_microbatches=4, schedule=IL, layer_option=autopar.AutoLayerOption(num_layers=3))
    par = autopar.parallelize(step, mesh=mesh_of((2, 4)), method=method)
    with pytest.raises(autopar.InvalidArgumentError, match="2 stage chunks .* 3 layers"):
        par.get_plan(state, batches[0])


def test_schedule_auto_keeps_the_fastest_schedule_that_fits():
    """Where a faster table's stages would not fit memory (H1's later stages hold S
    microbatches, not S - s), the choice falls to the fastest that does; with none fitting,
    to the schedule the stages were solved for (the first)."""
    one, h1, h2 = (Schedule.ONE_F_ONE_B, 3.0, (), True), (Schedule.ZERO_BUBBLE_H1, 2.0, (),
                                                          False), (Schedule.ZERO_BUBBLE_H2,
                                                                   2.5, (), True)
    assert pick([one, h1, h2])[0] is Schedule.ZERO_BUBBLE_H2
    assert pick([one, h1])[0] is Schedule.ONE_F_ONE_B
    assert pick([(Schedule.ONE_F_ONE_B, 3.0, (), False), h1])[0] is Schedule.ONE_F_ONE_B
    tie = (Schedule.GPIPE, 3.0, (), True)
    assert pick([one, tie])[0] is Schedule.ONE_F_ONE_B


def test_a_fixed_schedule_is_priced_by_its_table():
    """The same stages under 1F1B and ZB-H1: H1's predicted step is 1F1B's scaled by the
    ratio of their tables' simulated makespans (smaller), not 1F1B's formula."""
    one, _, state, batches = _auto_plan(schedule=autopar.Schedule.ONE_F_ONE_B)
    h1, _, _, _ = _auto_plan(schedule=H1)
    p1, ph = one.get_plan(state, batches[0]), h1.get_plan(state, batches[0])
    assert [s.latency_s for s in p1.stages] == [s.latency_s for s in ph.stages]
    assert ph.pipeline["predicted_latency_s"] < p1.pipeline["predicted_latency_s"]
    lat = [s.latency_s for s in p1.stages]
    assert p1.pipeline["predicted_latency_s"] == pytest.approx(sum(lat) + 7 * max(lat))
    with pytest.raises(autopar.InvalidArgumentError, match="AUTO is a choice"):
        make_schedule(autopar.Schedule.AUTO, 4, 8)


def test_a_chunked_plan_replays_from_its_saved_plan():
    """`parallelize(plan=...)` (and the plan cache) replays a ZB-V plan through its
    ManualStageOption: the same chunks on the same devices, equal results."""
    step, state, batches = _case("mlp", 4)
    par = autopar.parallelize(step, mesh=mesh_of((2, 4)), method=_method(4, ZV, 4))
    plan = par.get_plan(state, batches[0])
    again = autopar.parallelize(step, mesh=mesh_of((2, 4)), method=_method(4, ZV, 4),
                                plan=plan)
    replayed = again.get_plan(state, batches[0])
    assert [s.device_ids for s in replayed.stages] == [s.device_ids for s in plan.stages]
    assert replayed.stages[0].device_ids == replayed.stages[3].device_ids
    assert_equivalent(run_steps(par, state, batches), run_steps(again, state, batches),
                      compare_params=False, rtol=1e-6)


def test_a_stage_whose_b_passes_the_cotangent_through_sends_it_back():
    """ZB-H1 with a middle stage `h + b` (its activation gradient is the output cotangent,
    with no operator to run): its B still sends the gradient back, so the first stage's
    weight gradient is not zero; gradients equal jax.jit's. Only the first stage, which has
    no activation input, skips B."""
    H = 32
    k = jax.random.split(jax.random.key(0), 5)
    params = {"w0": jax.random.normal(k[0], (H, H)) * 0.3,
              "b1": jax.random.normal(k[1], (H,)) * 0.3,
              "w2": jax.random.normal(k[2], (H, H)) * 0.3,
              "w3": jax.random.normal(k[3], (H, H)) * 0.3}
    batch = {"x": jax.random.normal(k[4], (16, H)), "y": jax.numpy.ones((16, H))}

    def loss_fn(p, b):
        h = autopar.mark_stage_boundary(jax.numpy.tanh(b["x"] @ p["w0"]))
        h = autopar.mark_stage_boundary(h + p["b1"])
        h = autopar.mark_stage_boundary(jax.numpy.tanh(h @ p["w2"]))
        return jax.numpy.mean((h @ p["w3"] - b["y"]) ** 2)

    want = jax.jit(jax.value_and_grad(loss_fn))(params, batch)
    par = autopar.parallelize(lambda p, b: autopar.value_and_grad(loss_fn)(p, b),
                              mesh=mesh_of((2, 4)), method=autopar.PipeshardParallel(
                                  num_microbatches=4, schedule=H1,
                                  layer_option=autopar.ManualLayerOption(),
                                  stage_option=autopar.UniformStageOption(num_stages=4)))
    got = par(params, batch)
    assert abs(float(got[0]) - float(want[0])) <= 1e-6 * abs(float(want[0]))
    assert_norm_close(want[1], got[1], rtol=1e-5, what="gradients")
    stages = par.get_executor(params, batch).p.stages
    assert [st.backward_input is None for st in stages] == [True, False, False, False]


@pytest.mark.slow
def test_h1_compiled_peaks_stay_within_the_1f1b_pipeline_s_peak():
    """ZB-H1's memory promise, checked on the compiled stages (`stage_memory`, from XLA's
    memory analysis): a GPT on 4 uniform stages, 8 microbatches. Its first stage, the one
    1F1B loads most (S microbatches in flight), needs within 10% of 1F1B's; every later
    stage, which holds its deferred W's on top of 1F1B's S - s in flight, stays within 10% of
    that pipeline peak. Per stage the later ones need more than under 1F1B (the schedule's
    own trade, which the stage search prices): the second to fourth stage here."""
    step, state, batches = _case("gpt", 4, batch_size=32)
    leaves = jax.tree.leaves((state, batches[0]))
    peaks = {}
    for schedule in (autopar.Schedule.ONE_F_ONE_B, H1):
        par = autopar.parallelize(step, mesh=mesh_of((2, 4)), method=_method(4, schedule, 8))
        par.get_plan(state, batches[0])
        peaks[schedule] = [m.peak for m in stage_memory(
            par.get_compiled(state, batches[0]), leaves, 8)]
    one, h1 = peaks[autopar.Schedule.ONE_F_ONE_B], peaks[H1]
    assert max(one) == one[0] and h1[0] <= 1.10 * one[0]
    assert all(p <= 1.10 * max(one) for p in h1)
    assert all(p > q for p, q in zip(h1[1:], one[1:]))
