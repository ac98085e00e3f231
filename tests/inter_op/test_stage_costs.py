"""The stage search's costs (`inter_op.stage_costs`): the reshards between consecutive layers
of a stage, and the re-ranking of the DP's best layouts by whole-stage solves."""
import autopar
from autopar.cost.cluster import ClusterSpec
from autopar.inter_op.pipeline import slice_range
from autopar.inter_op.stage_solve import solve_stage, trace_stage
from autopar.inter_op.stages import AXIS_NAMES
from support.stage_mlp import bounds, cluster, loss, method  # noqa: F401  (fixtures: a four-layer MLP loss)

# -- the DP prices what it builds: boundary reshards, and re-ranking by whole-stage solves ---

def test_boundary_costs_price_layers_that_disagree_on_the_handed_over_tensor(loss, bounds,
                                                                              cluster):
    import dataclasses

    from autopar.cost.model import CostModel
    from autopar.inter_op.stage_costs import boundary_costs
    shape = (1, 8)
    sols = [[solve_stage(trace_stage(loss, sl), sl, cluster, shape, AXIS_NAMES,
                         autopar.ShardParallel())]
            for sl in (slice_range(loss, bounds[l], bounds[l + 1], l) for l in range(4))]
    meshes = [CostModel(mesh=cluster.logical_mesh(shape, AXIS_NAMES))]
    agree = [[dataclasses.replace(s, out_specs=tuple(((), ()) for _ in s.out_specs),
                                  act_specs=tuple(((), ()) for _ in s.act_specs))]
             for (s,) in sols]
    assert (boundary_costs(loss, bounds, agree, meshes) == 0).all()
    # Layer 1 takes its input split on the feature dimension where layer 0 hands it over
    # replicated: free forward (each device slices), an all-gather for the cotangent.
    differ = [row[:] for row in agree]
    (s1,) = differ[1]
    differ[1] = [dataclasses.replace(s1, act_specs=tuple(((), (1,))
                                                         for _ in s1.act_specs))]
    cost = boundary_costs(loss, bounds, differ, meshes)
    assert cost[0, 0] > 0 and cost[1:].sum() == 0 and cost[-1, 0] == 0


def test_rerank_takes_the_layout_whose_whole_stage_solves_are_fastest():
    from types import SimpleNamespace as NS

    from autopar.inter_op.stage_costs import reranked
    two = NS(layer_spans=((0, 0), (1, 1)), submeshes=(0, 0), total_latency_s=1.0, num_stages=2)
    one = NS(layer_spans=((0, 1),), submeshes=(1,), total_latency_s=1.1, num_stages=1)
    stage = lambda t: NS(solution=NS(latency_s=t, zero_gather_s=0.0), zero=False)
    dp = lambda options, budget, max_stages, within=None: one if max_stages == 1 else two
    whole = {2: [stage(0.3), stage(0.3)], 1: [stage(0.35)]}   # per stage count, solved whole
    got = reranked(two, dp, [], 1.0, lambda c: whole[c.num_stages], 4)
    assert len(got) == 1                     # 4 x 0.35 beats 0.6 + 3 x 0.3
    whole[1] = [stage(0.5)]                  # now the DP's choice is right after all
    assert len(reranked(two, dp, [], 1.0, lambda c: whole[c.num_stages], 4)) == 2

    def infeasible(c):
        if c.num_stages == 2:
            raise autopar.InfeasiblePlanError("no", needed_bytes=2, budget_bytes=1)
        return whole[1]
    assert len(reranked(two, dp, [], 1.0, infeasible, 4)) == 1


def test_span_memory_counts_every_layers_parameters_and_gradients(loss, bounds):
    """On one device (one plan per stage), the DP's memory of a span of layers (their held
    and resident bytes summed, their working memory's largest, their activations summed)
    covers the span's own plan: every layer's parameters and gradients are live at the
    span's first backward. Counting only the largest layer's peak, as before, misses them.
    The DP's retry price (`span_static_bytes` with the layers' deferred bytes) adds what a
    later layer's weight-gradient tail keeps live through the earlier layers' backward."""
    import numpy as np

    from autopar.inter_op.stage_costs import (
        held_bytes,
        resident_bytes,
        span_held_bytes,
        span_static_bytes,
        static_bytes,
        working_bytes,
    )
    from autopar.inter_op.stage_solver import StageSolver
    one = ClusterSpec.preset("v100-p3.16xlarge").with_(devices_per_host=1)
    solver = StageSolver(loss, one, method(autopar.AutoStageOption()), tuple(bounds))
    opt = solver.opt_ratio
    layers = [solver.solve(slice_range(loss, bounds[l], bounds[l + 1], l), (1, 1), (1, 1))
              for l in range(4)]
    whole = solver.solve(slice_range(loss, bounds[0], bounds[4], 0), (1, 1), (1, 1))
    for s in (*layers, whole):
        assert s.grad_bytes > 0 and resident_bytes(s) == s.param_bytes + s.grad_bytes
        assert np.isclose(static_bytes(s, opt), s.peak_memory_bytes - s.activation_bytes
                          + held_bytes(s, opt))
    acts = sum(s.activation_bytes for s in layers)
    span = span_static_bytes(np.array([span_held_bytes(s, opt) for s in layers]),
                             np.array([working_bytes(s) for s in layers]),
                             np.array([s.deferred_bytes for s in layers]))[-1] + acts
    without = (sum(span_held_bytes(s, opt) for s in layers) + max(map(working_bytes, layers))
               + acts)
    before = (sum(held_bytes(s, opt) for s in layers)
              + max(s.peak_memory_bytes - s.activation_bytes for s in layers) + acts)
    own = static_bytes(whole, opt) + whole.activation_bytes
    assert without >= own * (1 - 1e-9) and before < own
    # Each layer's weight gradient reads its activation input, which in the span is a
    # temporary made by the layer before: live until the stage's weight-gradient tail.
    assert all(s.deferred_bytes > 0 for s in layers)
    assert whole.deferred_bytes >= sum(s.deferred_bytes for s in layers[1:])
    assert without < span <= without + sum(s.deferred_bytes for s in layers[1:])


def test_span_static_bytes_adds_the_later_layers_deferred_bytes():
    import numpy as np

    from autopar.inter_op.stage_costs import span_static_bytes
    held, work, deferred = np.array([1.0, 2.0, 4.0]), np.array([5.0, 1.0, 3.0]), np.ones(3)
    # span 0..j: held summed + max over l <= j of work[l] + deferred of the layers after l
    assert span_static_bytes(held, work, deferred).tolist() == [6.0, 9.0, 14.0]
    assert span_static_bytes(held, work, 0 * deferred).tolist() == [6.0, 8.0, 12.0]


def test_dp_retry_prices_the_deferred_bytes():
    """`run_dp(deferred=True)` (the DP asked again after a layout's stage did not fit whole)
    prices a span's later layers' deferred bytes: a 2-layer stage that fits by its layers'
    largest working memory no longer does, a 1-layer stage costs the same."""
    import numpy as np

    from autopar.inter_op.stage_costs import run_dp
    from autopar.inter_op.stage_dp import SubmeshShape
    subs = (SubmeshShape(num_hosts=1, devices_per_host=1),
            SubmeshShape(num_hosts=1, devices_per_host=2))
    lat = np.array([[1.0, 0.4], [1.0, 0.4]])            # 2 layers x 2 pairs
    zeros = np.zeros_like(lat)
    kind = (lat, zeros, zeros, zeros, np.full_like(lat, 0.6), np.full_like(lat, 0.5),
            zeros.astype(bool), zeros)
    m = autopar.PipeshardParallel(num_microbatches=4)
    dp = lambda **kw: run_dp([kind], submeshes=subs, ks=np.array([0, 1]), device_ids=(0, 1),
                             method=m, option=autopar.AutoStageOption(), budget=1.0, **kw)
    assert dp().layer_spans == ((0, 1),) and dp().submeshes == (1,)   # 0.6 fits
    again = dp(deferred=True)                            # 0.6 + 0.5 does not
    assert again.layer_spans == ((0, 0), (1, 1)) and again.submeshes == (0, 0)


def test_dp_prices_a_schedules_deferred_weight_gradients():
    """`run_dp(kept=...)`: a deferred W keeps 0.6 bytes per layer on 1 device, 0.3 on 2
    (the summed weight array). Under 1F1B two 1-layer stages on 1 device each win (4 + 1 s
    against 4 x 1.6 s). Under ZB-H1 the last of them defers 2 W's (1.2 bytes > 1), while the
    one 2-layer stage on both devices defers 1 (0.6 bytes): the DP takes that one."""
    import numpy as np

    from autopar.core.enums import Schedule
    from autopar.inter_op.schedule_search import Tables, kept_of
    from autopar.inter_op.stage_costs import run_dp
    from autopar.inter_op.stage_dp import SubmeshShape
    subs = (SubmeshShape(num_hosts=1, devices_per_host=1),
            SubmeshShape(num_hosts=1, devices_per_host=2))
    lat = np.array([[1.0, 0.8], [1.0, 0.8]])
    zeros = np.zeros_like(lat)
    kind = (lat, zeros, np.full_like(lat, 0.1), zeros, zeros, zeros, zeros.astype(bool),
            np.array([[0.6, 0.3], [0.6, 0.3]]))
    m = autopar.PipeshardParallel(num_microbatches=4)
    dp = lambda **kw: run_dp([kind], submeshes=subs, ks=np.array([0, 1]), device_ids=(0, 1),
                             method=m, option=autopar.AutoStageOption(), budget=1.0, **kw)
    assert dp().layer_spans == ((0, 0), (1, 1))
    h1 = dp(kept=kept_of(Schedule.ZERO_BUBBLE_H1, 4, Tables()))
    assert h1.layer_spans == ((0, 1),) and h1.submeshes == (1,)


def test_dp_asked_again_without_a_banned_span():
    """`run_dp(banned=...)` offers no span holding the banned layers on that (submesh, view)
    pair, under any kind of layer plan: the search's answer to a stage that did not fit when
    solved whole."""
    import numpy as np

    from autopar.inter_op.stage_costs import run_dp
    from autopar.inter_op.stage_dp import SubmeshShape
    subs = (SubmeshShape(num_hosts=1, devices_per_host=1),
            SubmeshShape(num_hosts=1, devices_per_host=2))
    lat = np.array([[1.0, 0.4], [1.0, 0.4]])            # 2 layers x 2 pairs
    kind = (lat, *(np.zeros_like(lat) for _ in range(7)))
    m = autopar.PipeshardParallel(num_microbatches=4)
    dp = lambda **kw: run_dp([kind, kind], submeshes=subs, ks=np.array([0, 1]),
                             device_ids=(0, 1), method=m, option=autopar.AutoStageOption(),
                             budget=1.0, **kw)
    assert dp().layer_spans == ((0, 1),) and dp().submeshes[0] % 2 == 1   # both on 2 devices
    again = dp(banned=((1, 1, 1),))                       # layer 1 never on the 2 devices
    assert all(not (i <= 1 <= j and p % 2 == 1)
               for (i, j), p in zip(again.layer_spans, again.submeshes))
