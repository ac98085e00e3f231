"""Inter-op stage choice: a stage's training graph (trace_stage), its ILP (solve_stage), and
choose_stages with Uniform / Manual / Auto stage options on a four-layer MLP; the logical views
of a submesh; the option errors; and the pipeline plan's JSON round trip and replay option."""
import jax
import pytest

import autopar
from autopar.core.graph import TensorKind
from autopar.core.plan import graph_fingerprint, solution_from_record, solution_record
from autopar.frontend.tracer import trace
from autopar.inter_op.pipeline import layer_boundaries, slice_range, split_step
from autopar.inter_op.stage_solve import solve_stage, stage_io, trace_stage
from autopar.inter_op.stages import AXIS_NAMES, choose_stages, logical_shapes
from support.stage_mlp import (  # noqa: F401 (fixtures)
    bounds,
    cluster,
    loss,
    loss_fn,
    method,
    remat_step,
    step,
)
from support.steps import BATCH, PARAMS, B, H  # four 16 x 16 layers, a batch of 8

DEVICES = tuple(range(8))


# -- logical shapes -------------------------------------------------------------------------

def test_logical_shapes():
    assert logical_shapes(8) == [(1, 8), (2, 4), (4, 2), (8, 1)]
    assert logical_shapes(6) == [(1, 6), (2, 3), (3, 2), (6, 1)]
    assert logical_shapes(8, "flat") == [(1, 8), (8, 1)]
    assert logical_shapes(1) == [(1, 1)] and logical_shapes(1, "flat") == [(1, 1)]
    assert logical_shapes(7) == [(1, 7), (7, 1)]


# -- one stage ------------------------------------------------------------------------------

def test_trace_stage_inputs_and_outputs(loss, bounds):
    last = slice_range(loss, bounds[3], bounds[4], 3)
    io = stage_io(loss, last)
    assert len(io.float_acts) == 1 and io.int_acts == ()
    assert len(io.float_outputs) == 1 and len(io.int_outputs) == 1   # the loss; the count
    g = trace_stage(loss, last)
    # inputs: params, data, float acts, int acts, cotangents of the float outputs
    shapes = [g.tensors[t].shape for t in g.inputs]
    assert shapes == [(H, H), (B, H), (B, H), ()]
    # outputs: float outs, int outs, param grads, act grads
    assert [g.tensors[t].shape for t in g.outputs] == [(), (), (H, H), (B, H)]
    assert [g.tensors[t].dtype for t in g.outputs][:2] == ["float32", "int32"]
    assert any("transpose(" in n.name_stack for n in g.nodes)        # it has a backward
    assert sum(n.primitive == "dot_general" for n in g.nodes) == 3   # fwd + 2 in bwd


def test_trace_stage_first_stage_reads_the_batch(loss, bounds):
    g = trace_stage(loss, slice_range(loss, bounds[0], bounds[1], 0))
    roles = [g.tensors[t].role.value for t in g.inputs]
    # params, batch x, cotangent of h0 (no activation inputs)
    assert roles == ["param", "batch", "param"]
    assert all(g.tensors[t].kind == TensorKind.INPUT for t in g.inputs)


@pytest.mark.parametrize("shape", [(2, 2), (1, 4), (4, 1)])
def test_solve_stage(loss, bounds, cluster, shape):
    sl = slice_range(loss, bounds[1], bounds[2], 1)
    graph = trace_stage(loss, sl)
    sub = cluster.with_(num_hosts=1, devices_per_host=4)
    sol = solve_stage(graph, sl, sub, shape, AXIS_NAMES, method(autopar.AutoStageOption()))
    assert sol.logical_shape == shape
    assert sol.latency_s == pytest.approx(sol.compute_s + sol.comm_s + sol.reshard_s)
    assert sol.compute_s > 0 and sol.peak_memory_bytes > 0
    assert (len(sol.param_specs), len(sol.data_specs), len(sol.act_specs),
            len(sol.out_specs), len(sol.grad_specs)) == (1, 0, 1, 1, 1)
    assert all(len(s) == 2 for s in (*sol.param_specs, *sol.act_specs, *sol.grad_specs))
    # tanh's output is kept for the backward: activations are stored per microbatch
    assert 0 < sol.activation_bytes <= 2 * B * H * 4
    assert 0 < sol.param_bytes <= H * H * 4


def test_solve_stage_over_budget_raises(loss, bounds, cluster):
    sl = slice_range(loss, bounds[0], bounds[1], 0)
    with pytest.raises(autopar.InfeasiblePlanError) as info:
        solve_stage(trace_stage(loss, sl), sl, cluster.with_(devices_per_host=2), (1, 2),
                    AXIS_NAMES, method(autopar.AutoStageOption(), memory_budget_bytes=64))
    assert info.value.budget_bytes == 64 and info.value.needed_bytes > 64


# -- choose_stages --------------------------------------------------------------------------

def test_uniform_stages(loss, bounds, cluster):
    res = choose_stages(loss, bounds, cluster, DEVICES,
                        method(autopar.UniformStageOption(num_stages=2)))
    assert res.boundaries == bounds
    assert [st.layers for st in res.stages] == [(0, 1), (2, 3)]
    assert [st.submesh for st in res.stages] == [(1, 4), (1, 4)]
    assert [st.device_ids for st in res.stages] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert [(st.slice.start, st.slice.stop) for st in res.stages] == \
        [(bounds[0], bounds[2]), (bounds[2], bounds[4])]
    for st in res.stages:
        assert st.solution.logical_shape in logical_shapes(4)
    # (4, 1) is (1, 4) mirrored (an axis-blind method, one host): 2 ILPs per stage, the
    # mirror's answered from the cache
    assert res.num_ilps == 2 * 2 and res.num_reused == 2
    assert res.dp_candidates == 0          # no DP for a uniform split


def test_uniform_stages_share_identical_layers(loss, bounds, cluster):
    res = choose_stages(loss, bounds, cluster, DEVICES,
                        method(autopar.UniformStageOption(num_stages=4)))
    assert [st.layers for st in res.stages] == [(0, 0), (1, 1), (2, 2), (3, 3)]
    assert [len(st.device_ids) for st in res.stages] == [2, 2, 2, 2]
    # stages 1 and 2 have the same training graph: solved once, on (1, 2); (2, 1) is its
    # mirror image (one host, an axis-blind method), answered from the cache
    assert logical_shapes(2) == [(1, 2), (2, 1)]
    assert res.num_ilps == 3
    assert res.num_reused == 4 + 1
    assert res.stages[1].solution is res.stages[2].solution


@pytest.mark.parametrize("num_stages,what", [(5, "at least 5 layers"),
                                             (3, "divisible by 3")])
def test_uniform_stage_errors(loss, bounds, cluster, num_stages, what):
    with pytest.raises(autopar.InvalidArgumentError, match=what):
        choose_stages(loss, bounds, cluster, DEVICES,
                      method(autopar.UniformStageOption(num_stages=num_stages)))


def test_manual_stages(loss, bounds, cluster):
    option = autopar.ManualStageOption(layer_spans=((0, 0), (1, 3)),
                                       submesh_shapes=((1, 2), (1, 6)),
                                       logical_shapes=((2, 1), (3, 2)))
    res = choose_stages(loss, bounds, cluster, DEVICES, method(option))
    assert [st.layers for st in res.stages] == [(0, 0), (1, 3)]
    assert [st.device_ids for st in res.stages] == [(0, 1), (2, 3, 4, 5, 6, 7)]
    assert [st.solution.logical_shape for st in res.stages] == [(2, 1), (3, 2)]
    assert [(st.slice.start, st.slice.stop) for st in res.stages] == \
        [(bounds[0], bounds[1]), (bounds[1], bounds[4])]
    assert res.num_ilps == 2
    # Given the solutions (as a saved plan records them), the stages replay without an ILP.
    records = [solution_record(st.solution, graph_fingerprint(st.graph)) for st in res.stages]
    given = tuple(solution_from_record(r) for r in records)
    assert [sol for _, sol in given] == [st.solution for st in res.stages]
    again = choose_stages(loss, bounds, cluster, DEVICES, method(option), solutions=given)
    assert (again.num_ilps, again.num_replayed) == (0, 2)
    assert [st.solution for st in again.stages] == [st.solution for st in res.stages]


def test_manual_stages_must_cover_every_layer(loss, bounds, cluster):
    option = autopar.ManualStageOption(layer_spans=((0, 1), (2, 2)),
                                       submesh_shapes=((1, 4), (1, 4)),
                                       logical_shapes=((1, 4), (1, 4)))
    with pytest.raises(autopar.InvalidArgumentError, match="ends at layer 2 .* 4 layers"):
        choose_stages(loss, bounds, cluster, DEVICES, method(option))


def test_manual_submeshes_must_use_the_whole_mesh(loss, bounds, cluster):
    option = autopar.ManualStageOption(layer_spans=((0, 1), (2, 3)),
                                       submesh_shapes=((1, 2), (1, 2)),
                                       logical_shapes=((1, 2), (1, 2)))
    with pytest.raises(autopar.InvalidArgumentError, match="use 4 devices but the mesh has 8"):
        choose_stages(loss, bounds, cluster, DEVICES, method(option))


def test_stages_over_budget_are_infeasible(loss, bounds, cluster):
    option = autopar.ManualStageOption(layer_spans=((0, 1), (2, 3)),
                                       submesh_shapes=((1, 4), (1, 4)),
                                       logical_shapes=((2, 2), (2, 2)))
    with pytest.raises(autopar.InfeasiblePlanError, match="stage 0") as info:
        choose_stages(loss, bounds, cluster, DEVICES, method(option, memory_budget_bytes=64))
    assert info.value.budget_bytes == 64 and info.value.needed_bytes > 64


def test_stage_peaks_count_the_schedule_and_respect_the_budget(loss, bounds, cluster):
    """A stage's peak: its ILP's working memory, the gradient accumulator and the activations
    its schedule keeps in flight (GPipe keeps all 8 microbatches, 1F1B at most S, ZB-H1 S on
    every stage; AUTO's stages are solved for 1F1B's); a budget below it is met by another
    sharding or refused with the numbers, never exceeded."""
    uniform = autopar.UniformStageOption(num_stages=2)
    peaks = {}
    S = autopar.Schedule
    for schedule in (S.GPIPE, S.ONE_F_ONE_B, S.ZERO_BUBBLE_H1, S.ZERO_BUBBLE_H2, S.AUTO):
        res = choose_stages(loss, bounds, cluster, DEVICES,
                            method(uniform, num_microbatches=8, schedule=schedule))
        peaks[schedule] = [st.peak_bytes for st in res.stages]
        for st in res.stages:
            assert st.peak_bytes > st.solution.peak_memory_bytes   # + accumulator, in flight
    gpipe, one_f = peaks[autopar.Schedule.GPIPE], peaks[autopar.Schedule.ONE_F_ONE_B]
    assert all(g > f for g, f in zip(gpipe, one_f))
    assert peaks[S.AUTO] == one_f
    # H1: stage 0 in flight as 1F1B's, but a microbatch between its B and its W keeps W's
    # part and B's hand-off to W (the output cotangents of its matmuls); the last stage
    # defers a W while one more microbatch is in flight
    assert all(h >= f for h, f in zip(peaks[S.ZERO_BUBBLE_H1], one_f))
    assert peaks[S.ZERO_BUBBLE_H1][1] > one_f[1]
    for fraction in (0.9, 0.5):
        budget = int(max(gpipe) * fraction)
        try:
            res = choose_stages(loss, bounds, cluster, DEVICES, method(
                uniform, num_microbatches=8, schedule=autopar.Schedule.GPIPE,
                memory_budget_bytes=budget))
        except autopar.InfeasiblePlanError as e:
            assert e.budget_bytes == budget and e.needed_bytes > budget
        else:
            assert all(st.peak_bytes <= budget for st in res.stages)


def test_auto_stages(loss, bounds, cluster):
    devices = DEVICES[:4]
    res = choose_stages(loss, bounds, cluster, devices, method(
        autopar.AutoStageOption(logical_shapes="flat"), num_microbatches=4))
    spans = [st.layers for st in res.stages]
    assert spans[0][0] == 0 and spans[-1][1] == 3
    assert all(b[0] == a[1] + 1 for a, b in zip(spans, spans[1:]))
    assert sorted(d for st in res.stages for d in st.device_ids) == list(devices)
    for st in res.stages:
        assert len(st.device_ids) == st.submesh[0] * st.submesh[1]
        assert st.solution.logical_shape in logical_shapes(len(st.device_ids), "flat")
    assert res.dp_candidates >= 1
    assert res.num_reused > 0               # layers 1 and 2 share their ILPs
    # the chosen layout's pipeline latency, on the scale of its runner-ups' (reranked's)
    from autopar.inter_op.stage_costs import latency
    lat = [latency(st.solution, st.zero, 4) for st in res.stages]
    assert res.chosen_latency_s == pytest.approx(sum(lat) + 3 * max(lat))
    assert all(a["kind"] == "stage layout" for a in res.runner_ups)
    assert all(a["predicted_step_s"] >= res.chosen_latency_s * (1 - 1e-9)
               for a in res.runner_ups if a["predicted_step_s"] is not None)


def test_auto_stages_capped_at_one_stage(loss, bounds, cluster):
    res = choose_stages(loss, bounds, cluster, DEVICES[:2], method(
        autopar.AutoStageOption(max_stages=1, logical_shapes="flat")))
    (st,) = res.stages
    assert st.layers == (0, 3) and st.device_ids == (0, 1)
    assert (st.slice.start, st.slice.stop) == (0, len(loss.forward.nodes))


# -- plan -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pipeline_plan():
    mesh = jax.make_mesh((2, 4), ("data", "model"), devices=jax.devices()[:8])
    par = autopar.parallelize(step, mesh=mesh, method=autopar.PipeshardParallel(
        num_microbatches=2, layer_option=autopar.ManualLayerOption(),
        stage_option=autopar.UniformStageOption(num_stages=2)))
    return par, par.get_plan(PARAMS, BATCH)


def test_pipeline_plan_json_round_trip(pipeline_plan):
    _, plan = pipeline_plan
    again = autopar.ParallelPlan.from_json(plan.to_json())
    assert again == plan
    assert [s.layers for s in again.stages] == [(0, 1), (2, 3)]
    assert [s.submesh for s in again.stages] == [(1, 4), (1, 4)]
    assert [s.device_ids for s in again.stages] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert all(isinstance(s.layers, tuple) and isinstance(s.submesh, tuple)
               for s in again.stages)
    # parameters of layers 0-1 live on stage 0, of layers 2-3 on stage 1
    stage_of = {t.path: t.stage for t in again.inputs}
    assert [stage_of[f"params['l{i}']"] for i in range(4)] == [0, 0, 1, 1]
    assert again.pipeline["num_layers"] == 4 and again.pipeline["segments"] >= 3


def test_plan_stage_option_replays_the_stages(pipeline_plan):
    par, plan = pipeline_plan
    option = plan.stage_option()
    assert isinstance(option, autopar.ManualStageOption)
    assert option.layer_spans == ((0, 1), (2, 3))
    assert option.submesh_shapes == ((1, 4), (1, 4))
    assert option.logical_shapes == tuple(s.logical_mesh_shape for s in plan.stages)
    replay = autopar.parallelize(step, mesh=par.mesh, method=autopar.PipeshardParallel(
        num_microbatches=2, layer_option=autopar.ManualLayerOption(), stage_option=option))
    again = replay.get_plan(PARAMS, BATCH)
    assert [(s.layers, s.device_ids, s.logical_mesh_shape) for s in again.stages] == \
        [(s.layers, s.device_ids, s.logical_mesh_shape) for s in plan.stages]
    assert again.pipeline["stage_option"] == "ManualStageOption"


class _Rigged:
    """A stage problem whose solutions `rig(solution, shape, budget)` rewrites."""

    def __init__(self, real, shape, rig, least, calls, pipeline_least=2e6):
        self.real, self.shape, self.rig, self.least, self.calls = real, shape, rig, least, calls
        self.pipeline_least = pipeline_least

    def __getattr__(self, name):        # anything not rigged: the real problem's
        return getattr(self.real, name)

    def least_bytes(self, *, in_flight=None, opt_ratio=0.0):
        """One microbatch's least, or (with `in_flight`) the pipeline's (2 MB by default)."""
        one = in_flight is None
        self.calls.append(("least" if one else "least_fitting", id(self)))
        return self.least if one else self.pipeline_least

    def solve(self, budget=None, **held):
        self.calls.append(("fitting", held["in_flight"]) if held else ("solve", budget))
        return self.rig(self.real.solve(None), tuple(self.shape), budget, **held)


def _rig_stage_problems(monkeypatch, rig, least=1000.0, pipeline_least=2e6):
    import autopar.inter_op.stage_solver as stages_mod
    real, calls = stages_mod.stage_problem, []

    def fake(graph, sl, sub, shape, *args, **kw):
        return _Rigged(real(graph, sl, sub, shape, *args, **kw), shape, rig, least, calls,
                       pipeline_least)
    monkeypatch.setattr(stages_mod, "stage_problem", fake)
    # rigged views are not mirror images of each other: every view gets its own problem
    monkeypatch.setattr(stages_mod.StageSolver, "mirror_of", lambda self, sub, shape: None)
    return calls


def test_auto_stages_offer_every_logical_view_to_the_dp(loss, bounds, cluster, monkeypatch):
    """A view that is fastest but does not fit memory must not hide a slower one that fits:
    every (submesh, view) pair is its own option of the DP."""
    import dataclasses

    def rig(sol, shape, budget, **held):
        fast = shape == (1, 2)          # fast and far too big; (2, 1) slow and small
        return dataclasses.replace(sol, latency_s=1.0 if fast else 2.0,
                                   peak_memory_bytes=1e12 if fast else 1e3,
                                   activation_bytes=0.0, param_bytes=1e3 if not fast else 1e12)
    _rig_stage_problems(monkeypatch, rig)
    res = choose_stages(loss, bounds, cluster, DEVICES[:2], method(
        autopar.AutoStageOption(max_stages=1, logical_shapes="flat"),
        memory_budget_bytes=10**6))
    (st,) = res.stages
    assert st.solution.logical_shape == (2, 1)


def test_auto_stages_fall_back_to_memory_lean_layer_plans(loss, bounds, cluster, monkeypatch):
    """When no stage assignment of the layers' fastest plans fits, the DP is offered each
    layer's memory-lean plan (the fastest within 5% of its least memory); the chosen stage is
    then solved whole for the fastest plan that fits with its optimizer state and in-flight
    activations (`fitting`), and the error says so when none does: decided by the stage's
    least pipeline memory, without a fitting solve. Each built problem's least memory is
    computed once."""
    import dataclasses

    def rigged(fitting_fits):
        def rig(sol, shape, budget, **held):
            if held and not fitting_fits:
                raise autopar.InfeasiblePlanError("none fits", needed_bytes=2 * 10**6,
                                                  budget_bytes=10**6)
            if budget is None and not held:                # fastest: never fits
                return dataclasses.replace(sol, latency_s=1.0, peak_memory_bytes=1e12,
                                           activation_bytes=0.0, param_bytes=1e12)
            return dataclasses.replace(sol, latency_s=1.5 if held else 2.0,
                                       peak_memory_bytes=1e3, activation_bytes=0.0,
                                       param_bytes=10.0)
        return rig

    calls = _rig_stage_problems(monkeypatch, rigged(True), pipeline_least=1e3)
    res = choose_stages(loss, bounds, cluster, DEVICES[:2], method(
        autopar.AutoStageOption(max_stages=1, logical_shapes="flat"),
        memory_budget_bytes=10**6))
    (st,) = res.stages
    assert st.solution.latency_s == 1.5                      # the whole stage, fitting
    budgets = [b for kind, b in calls if kind == "solve"]
    assert None in budgets and 1050 in [int(b) for b in budgets if b]   # lean layer options
    assert ("fitting", 1) in calls                           # one stage: 1 in flight
    leasts = [problem for kind, problem in calls if kind == "least"]
    assert leasts and len(leasts) == len(set(leasts))        # once per built problem
    assert st.peak_bytes <= 10**6

    calls = _rig_stage_problems(monkeypatch, rigged(False))
    with pytest.raises(autopar.InfeasiblePlanError, match="microbatch.*in flight") as e:
        choose_stages(loss, bounds, cluster, DEVICES[:2], method(
            autopar.AutoStageOption(max_stages=1, logical_shapes="flat"),
            memory_budget_bytes=10**6))
    assert e.value.needed_bytes == 2 * 10**6       # the stage's least with its pipeline memory
    kinds = {kind for kind, _ in calls}
    assert "least_fitting" in kinds and "fitting" not in kinds   # no ILP ran to infeasibility


def test_lean_fallback_skips_solves_it_does_not_need(loss, bounds, cluster, monkeypatch):
    """A layer whose least memory is over the budget gets no lean solve (and the error names
    what it needs); a layer whose fastest plan is already within 5% of its least memory is
    its own lean plan (no second solve); only the leanest plans solve at the least."""
    import dataclasses

    def rig(sol, shape, budget, **held):
        return dataclasses.replace(sol, peak_memory_bytes=1e3, activation_bytes=0.0,
                                   param_bytes=1e12)      # static bytes never fit
    calls = _rig_stage_problems(monkeypatch, rig, least=2e6)
    with pytest.raises(autopar.InfeasiblePlanError) as e:
        choose_stages(loss, bounds, cluster, DEVICES[:2], method(
            autopar.AutoStageOption(max_stages=1, logical_shapes="flat"),
            memory_budget_bytes=10**6))
    assert all(b is None for kind, b in calls if kind == "solve")   # no budgeted solve
    assert e.value.needed_bytes > 10**6
    calls = _rig_stage_problems(monkeypatch, rig, least=990.0)
    with pytest.raises(autopar.InfeasiblePlanError):
        choose_stages(loss, bounds, cluster, DEVICES[:2], method(
            autopar.AutoStageOption(max_stages=1, logical_shapes="flat"),
            memory_budget_bytes=10**6))
    assert any(kind == "least" for kind, _ in calls)
    from autopar.inter_op.stage_solver import LEANEST_SLACK
    # the fast plan was lean (no solve at 5% above the least); only the leanest round, the
    # DP's last resort, solves at the least memory
    budgets = [b for kind, b in calls if kind == "solve" and b is not None]
    assert budgets and all(b == pytest.approx(990.0 * LEANEST_SLACK) for b in budgets)


def test_stage_problem_fits_the_pipeline_peak(loss, bounds, cluster):
    """StageProblem.solve(opt_ratio=, in_flight=) gives the fastest plan whose pipeline peak
    (the stage DP's formula: one microbatch's peak, a gradient accumulator, the parameters'
    optimizer state, and the activations of the other microbatches in flight) fits."""
    from autopar.inter_op.stage_costs import static_bytes
    from autopar.inter_op.stage_solve import stage_problem
    sl = slice_range(loss, bounds[0], bounds[4], 0)
    prob = stage_problem(trace_stage(loss, sl), sl, cluster.with_(
        num_hosts=1, devices_per_host=2), (1, 2), AXIS_NAMES, method(
        autopar.AutoStageOption()), points_above=0.0)
    q, opt = 3, 2.0

    def dp(s):
        return static_bytes(s, opt) + q * s.activation_bytes
    fast, lean = prob.solve(), prob.solve(prob.least_bytes())
    assert dp(lean) < dp(fast)
    budget = (dp(fast) + dp(lean)) / 2
    fit = prob.solve(budget, opt_ratio=opt, in_flight=q)
    assert dp(fit) <= budget * (1 + 1e-9)
    tol = 1e-9 * lean.latency_s
    assert fast.latency_s - tol <= fit.latency_s <= lean.latency_s + tol
    assert prob.solve(budget).latency_s <= fit.latency_s + tol     # the ILP peak alone: looser
    with pytest.raises(autopar.InfeasiblePlanError):
        prob.solve(1.0, opt_ratio=opt, in_flight=q)


def test_a_stage_asked_twice_with_the_same_held_tensors_adds_their_bytes_once(
        loss, bounds, cluster, monkeypatch):
    """The least pipeline memory and the plan that fits it hold the same tensors: their
    bytes go into the stage's memory points once (`IntraOpProblem.held_problem`; a whole
    stage of GPT-39B has millions of terms), and other held tensors are added anew."""
    import autopar.intra_op.solve as solve_mod
    from autopar.inter_op.stage_solve import stage_problem
    calls = []
    real = solve_mod.with_extra_bytes
    monkeypatch.setattr(solve_mod, "with_extra_bytes",
                        lambda problem, extra: calls.append(1) or real(problem, extra))
    sl = slice_range(loss, bounds[0], bounds[2], 0)
    prob = stage_problem(trace_stage(loss, sl), sl, cluster.with_(
        num_hosts=1, devices_per_host=2), (1, 2), AXIS_NAMES, method(
        autopar.AutoStageOption()), points_above=0.0)
    least = prob.least_bytes(in_flight=3, opt_ratio=2.0)
    assert len(calls) <= 1            # none where `lean_least` needs no held points
    fit = prob.solve(1.01 * least, in_flight=3, opt_ratio=2.0)
    assert len(calls) == 1
    prob.solve(2 * least, in_flight=2, opt_ratio=2.0)
    assert len(calls) == 2
    again = prob.solve(1.01 * least, in_flight=3, opt_ratio=2.0)      # recomputed, the same
    assert len(calls) == 3 and again.latency_s == fit.latency_s


def test_least_pipeline_memory_without_the_held_points_is_their_least(loss, bounds, cluster,
                                                                      monkeypatch):
    """`least_bytes` with held tensors gives the least peak of the points with their bytes
    added (`min_peak_memory` of `held_problem`), whether or not it had to build those points
    (`lean_least`); on this MLP stage it need not."""
    import autopar.intra_op.solve as solve_mod
    from autopar.inter_op.stage_solve import stage_problem
    from autopar.intra_op.ilp import min_peak_memory
    sl = slice_range(loss, bounds[0], bounds[2], 0)
    prob = stage_problem(trace_stage(loss, sl), sl, cluster.with_(
        num_hosts=1, devices_per_host=2), (1, 2), AXIS_NAMES, method(
        autopar.AutoStageOption()), points_above=0.0)
    calls = []
    real = solve_mod.with_extra_bytes
    monkeypatch.setattr(solve_mod, "with_extra_bytes",
                        lambda problem, extra: calls.append(1) or real(problem, extra))
    for in_flight in (1, 3):
        least = prob.least_bytes(in_flight=in_flight, opt_ratio=2.0)
        assert not calls
        held = prob.ilp.held_problem(prob._held(in_flight, 2.0))
        assert least == pytest.approx(min_peak_memory(held)[0], rel=1e-12)
        calls.clear()


@pytest.mark.parametrize("policy", [None, jax.checkpoint_policies.dots_saveable])
def test_stage_graph_keeps_the_users_remat(policy):
    """The loss's forward graph remembers each `jax.checkpoint` region; a stage's training
    graph differentiates it under `jax.checkpoint` with the user's policy, so each remat'd
    block of the stage has its optimization barrier (one group) as under jax.jit."""
    graph = trace(remat_step(policy), (PARAMS, BATCH), batch_argnums=(1,), keep_grad=True)
    loss = split_step(graph, graph, 1)
    assert len({n.remat.id for n in loss.forward.nodes if n.remat is not None}) == 4
    b = layer_boundaries(loss.forward, autopar.ManualLayerOption())
    for first, last, blocks in [(0, 2, 2), (2, 4, 2), (0, 4, 4)]:
        g = trace_stage(loss, slice_range(loss, b[first], b[last], 0))
        assert len({n.barrier for n in g.nodes if n.barrier is not None}) == blocks


# -- ZeRO per stage -------------------------------------------------------------------------

def _zero_case():
    from support.steps import make_case, sgd_momentum_clip
    return make_case("mlp", "linen", sgd_momentum_clip(), value_and_grad=autopar.value_and_grad,
                     num_layers=4, hidden=64, batch_size=16)


def _pipe(stage_option, budget=None):
    return autopar.PipeshardParallel(num_microbatches=2, stage_option=stage_option,
                                     layer_option=autopar.AutoLayerOption(num_layers=2),
                                     memory_budget_bytes=budget, remat="none")


def _manual(zero=()):
    return autopar.ManualStageOption(
        layer_spans=((0, 0), (1, 1)), submesh_shapes=((1, 4), (1, 4)),
        logical_shapes=((4, 1), (4, 1)), zero=zero)


def test_zero_stage_splits_its_optimizer_state_and_trains_like_jit():
    import jax

    from support.steps import assert_equivalent, mesh_of, run_steps
    step, state, batches = _zero_case()
    plain = autopar.parallelize(step, mesh=mesh_of((2, 4)), method=_pipe(_manual((False,) * 2)))
    zero = autopar.parallelize(step, mesh=mesh_of((2, 4)), method=_pipe(_manual((True,) * 2)))
    p0, p1 = plain.get_plan(state, batches[0]), zero.get_plan(state, batches[0])
    assert [s.zero for s in p1.stages] == [True, True] and p1.stage_option().zero == (True,) * 2
    for a, b in zip(p0.stages, p1.stages):
        assert b.peak_memory_bytes < a.peak_memory_bytes          # the state is split 4 ways
    momentum = [t for t in p1.inputs if t.role == "opt_state" and len(t.shape) == 2]
    assert momentum and all(any(0 in dim for dim in t.spec) for t in momentum)
    assert not any(any(0 in dim for dim in t.spec) for t in p0.inputs if t.role == "opt_state")
    ref = run_steps(jax.jit(step), state, batches)
    assert_equivalent(ref, run_steps(zero, state, batches), compare_params=True, rtol=2e-5)


def test_stage_search_takes_zero_exactly_where_memory_needs_it(monkeypatch):
    from autopar.verify import pipeline_memory_check
    from support.steps import mesh_of
    step, state, batches = _zero_case()
    # The search's choice under the memory model: the compiled check (which re-plans where
    # XLA needs more than predicted; tests/verify/test_pipeline_memory_check.py) is off here and
    # checked on at the end.
    monkeypatch.setattr(pipeline_memory_check, "binding", lambda plan: False)
    peaks = {z: autopar.parallelize(step, mesh=mesh_of((2, 4)), method=_pipe(_manual(
        (z, z)))).get_plan(state, batches[0]).peak_memory_bytes for z in (False, True)}
    free = autopar.parallelize(step, mesh=mesh_of((2, 4)), method=_pipe(_manual())).get_plan(
        state, batches[0])
    assert not any(s.zero for s in free.stages)              # no memory pressure: no ZeRO
    budget = int((peaks[False] + peaks[True]) / 2)
    tight = autopar.parallelize(step, mesh=mesh_of((2, 4)), method=_pipe(
        _manual(), budget)).get_plan(state, batches[0])
    assert tight.peak_memory_bytes <= budget and any(s.zero for s in tight.stages)
    monkeypatch.undo()
    checked = autopar.parallelize(step, mesh=mesh_of((2, 4)), method=_pipe(
        _manual(), budget)).get_plan(state, batches[0])
    assert max(checked.measured["compiled_stage_bytes"]) <= budget
