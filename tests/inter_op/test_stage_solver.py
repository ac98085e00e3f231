"""The stage search's solver (inter_op/stage_solver.py): identical layers share one trace
(`slice_key`), and a logical view whose ILP is another's with the mesh axes swapped is solved
as that view's mirror image, which gives the same plan costs and trains like jax.jit."""
import jax

import autopar
from autopar.core.spec import is_valid
from autopar.cost.cluster import ClusterSpec
from autopar.inter_op.pipeline import slice_range
from autopar.inter_op.stage_solve import stage_problem, trace_stage
from autopar.inter_op.stage_solver import AXIS_NAMES, StageSolver, slice_key
from support.stage_mlp import bounds, cluster, loss, method  # noqa: F401 (fixtures)
from support.steps import assert_equivalent, make_case, mesh_of, run_steps, sgd_momentum_clip


def test_slice_key_names_identical_layers(loss, bounds):
    """Layers 1 and 2 of the four-layer MLP are identical: one key, one trace in the search;
    every two slices with one key trace to one training graph."""
    solver = StageSolver(loss, None, method(autopar.AutoStageOption()), tuple(bounds))
    slices = [slice_range(loss, bounds[i], bounds[j + 1], i) for i in range(4)
              for j in range(i, 4)]
    keys = [slice_key(loss, sl) for sl in slices]
    singles = [slice_key(loss, slice_range(loss, bounds[i], bounds[i + 1], i))
               for i in range(4)]
    assert singles[1] == singles[2] and len(set(singles)) == 3
    assert keys == [slice_key(loss, sl) for sl in slices]             # the same every time
    fps = [solver.graph(sl)[1] for sl in slices]
    for a in range(len(slices)):
        for b in range(len(slices)):
            assert (keys[a] == keys[b]) <= (fps[a] == fps[b])
    sl1, sl2 = (slice_range(loss, bounds[i], bounds[i + 1], i) for i in (1, 2))
    assert solver.search_graph(sl2)[0] is solver.search_graph(sl1)[0]  # traced once
    assert solver.graph(sl2)[0] is not solver.graph(sl1)[0]           # a stage's own trace


def test_mirror_view_is_the_same_problem(loss, bounds, cluster):
    """(2, 1) on one host is (1, 2) with the axes swapped: solved once, and its mirrored plan
    costs what (2, 1)'s own ILP gives; ZeRO's fields follow the data axis."""
    m = method(autopar.AutoStageOption())
    solver = StageSolver(loss, cluster, m, tuple(bounds))
    sl = slice_range(loss, bounds[0], bounds[4], 0)
    sub = (1, 2)
    assert solver.mirror_of(sub, (2, 1)) == (1, 2) and solver.mirror_of(sub, (1, 2)) is None
    mirrored, own = solver.solve(sl, sub, (2, 1)), solver.solve(sl, sub, (1, 2))
    assert solver.num_ilps == 1 and mirrored.logical_shape == (2, 1)
    direct = stage_problem(trace_stage(loss, sl), sl, cluster.with_(
        num_hosts=1, devices_per_host=2), (2, 1), AXIS_NAMES, m, points_above=0.0).solve()
    for field in ("latency_s", "peak_memory_bytes", "activation_bytes", "param_bytes"):
        a, b = getattr(mirrored, field), getattr(direct, field)
        assert abs(a - b) <= 1e-9 * max(abs(b), 1e-30), field
    graph = solver.graph(sl)[0]
    for t, spec in zip(graph.inputs, mirrored.param_specs):
        assert is_valid(spec, graph.tensors[t].shape, (2, 1))
    assert own.zero_split_bytes == 0.0 and mirrored.zero_split_bytes > 0.0   # axis 0: 1 vs 2


def test_mirror_only_where_the_axes_cost_the_same(loss, bounds):
    """Two hosts of four: the flat views mirror each other (both spread over the hosts), the
    2-D views do not (the host axis is axis 0 in both); a method that names axes never
    mirrors."""
    two_hosts = ClusterSpec.preset("v100-p3.16xlarge", num_hosts=2).with_(devices_per_host=4)
    solver = StageSolver(loss, two_hosts, method(autopar.AutoStageOption()), tuple(bounds))
    assert solver.mirror_of((2, 4), (8, 1)) == (1, 8)
    assert solver.mirror_of((2, 4), (4, 2)) is None
    pinned = StageSolver(loss, two_hosts, method(autopar.AutoStageOption(),
                                                 batch_axis="data"), tuple(bounds))
    assert pinned.mirror_of((2, 4), (8, 1)) is None


def test_mirrored_stages_train_like_jax_jit():
    """A pipeline whose stages run on (4, 1) views (mirrors of the (1, 4) ILPs) matches
    single-device training."""
    step, state, batches = make_case("mlp", "linen", sgd_momentum_clip(), batch_size=16,
                                     value_and_grad=autopar.value_and_grad, num_layers=4)
    ref = run_steps(jax.jit(step), state, batches)
    par = autopar.parallelize(step, mesh=mesh_of((2, 4)), method=autopar.PipeshardParallel(
        num_microbatches=2, layer_option=autopar.AutoLayerOption(num_layers=4),
        stage_option=autopar.ManualStageOption(
            layer_spans=((0, 1), (2, 3)), submesh_shapes=((1, 4), (1, 4)),
            logical_shapes=((4, 1), (4, 1)))))
    got = run_steps(par, state, batches)
    assert_equivalent(ref, got, compare_params=True, rtol=2e-5)
    assert [s.logical_mesh_shape for s in par.get_plan(state, batches[0]).stages] == \
        [(4, 1), (4, 1)]


def test_a_view_that_splits_no_parameter_is_rejected_before_building(loss, bounds):
    """The floor of a view counts each parameter split as far as that view can split it: the
    16 x 16 weights split 8 ways on (1, 8) but not at all on (1, 3), so under a budget between
    the two floors the (1, 3) view is answered without building its ILP."""
    sl = slice_range(loss, bounds[0], bounds[1], 0)
    solver = StageSolver(loss, None, method(autopar.AutoStageOption(),
                                            memory_budget_bytes=512), tuple(bounds))
    whole = 16 * 16 * 4 * (1 + solver.opt_ratio)
    assert solver.floor(sl, (1, 3), (1, 3)) == whole
    assert solver.floor(sl, (1, 8), (1, 8)) == whole / 8 == solver.floor(sl, (1, 8))
    assert solver.floor(sl, (1, 8), (2, 4)) == whole / 8
    assert solver.solve(sl, (1, 3), (1, 3)) is None and solver.lean(sl, (1, 3), (3, 1)) is None
    assert not solver.problems and solver.num_ilps == 0
    assert solver.needed[(bounds[0], bounds[1])] == whole


def test_leanest_plan_takes_the_least_memory(loss, bounds, cluster):
    """`lean` with the leanest slack gives a plan at the stage's least memory; the default
    slack allows 5% more."""
    from autopar.inter_op.stage_solver import LEANEST_SLACK
    sl = slice_range(loss, bounds[0], bounds[4], 0)
    solver = StageSolver(loss, cluster, method(autopar.AutoStageOption()), tuple(bounds))
    prob, key = solver.problem(sl, (1, 8), (2, 4))
    least = solver.least_of(prob, key)
    leanest = solver.lean(sl, (1, 8), (2, 4), slack=LEANEST_SLACK)
    lean = solver.lean(sl, (1, 8), (2, 4))
    assert leanest.peak_memory_bytes <= least * LEANEST_SLACK
    assert lean.peak_memory_bytes <= least * 1.05 and lean.latency_s <= leanest.latency_s


def test_lean_solves_only_at_the_lean_budget(loss, bounds, cluster):
    """`lean` does not solve the fastest plan to see whether it is lean (where memory binds,
    that is the costly solve): one ILP, at the lean budget. A fastest plan solved already
    and within the slack is the answer, with no ILP."""
    sl = slice_range(loss, bounds[0], bounds[4], 0)
    solver = StageSolver(loss, cluster, method(autopar.AutoStageOption()), tuple(bounds))
    prob, key = solver.problem(sl, (1, 8), (2, 4))
    least = solver.least_of(prob, key)
    lean = solver.lean(sl, (1, 8), (2, 4))
    assert solver.num_ilps == 1 and (key, None) not in solver.cache
    assert lean.peak_memory_bytes <= least * 1.05
    fast = solver.solve(sl, (1, 8), (2, 4))
    assert solver.num_ilps == 2 and fast.latency_s <= lean.latency_s
    assert fast.peak_memory_bytes > least * 1.05      # memory binds the lean plan here
    loose = fast.peak_memory_bytes / least
    assert solver.lean(sl, (1, 8), (2, 4), slack=loose) is fast and solver.num_ilps == 2
