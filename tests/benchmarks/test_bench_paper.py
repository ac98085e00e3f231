"""The pure helpers of benchmarks/paper.py: the Megatron grid, stage layouts, slopes, goals."""
import os

import pytest
from paper_configs import (  # noqa: E402
    ALL,
    DEFAULT,
    FAMILIES,
    GridPoint,
    auto_microbatches,
    cluster_shape,
    manual_stage_layout,
    megatron_grid,
    submesh,
)
from paper_report import DENSE_GOAL, G39B_GOAL, MEMORY_GOAL, REMAT_GOAL, goals, memory_bound, slope  # noqa: E402


def test_grid_covers_every_factorization():
    grid = megatron_grid(4, 24, 1024)
    assert {(g.d, g.t, g.p) for g in grid} == {
        (4, 1, 1), (2, 2, 1), (1, 4, 1), (2, 1, 2), (1, 2, 2), (1, 1, 4)}
    assert all(g.d * g.t * g.p == 4 and g.m * g.d == 1024 and g.skip is None for g in grid)


def test_grid_rules():
    grid = megatron_grid(64, 48, 1024)
    assert all(g.t <= 8 and 48 % g.p == 0 for g in grid)
    assert (1, 8, 8) in {(g.d, g.t, g.p) for g in grid}
    assert not any(g.p == 32 for g in grid)              # 32 does not divide 48
    # no tensor parallelism (Wide-ResNet); 1520 / d must be whole
    wrn = megatron_grid(64, 32, 1520, tensor=False)
    assert all(g.t == 1 and 1520 % g.d == 0 for g in wrn)
    assert {g.d for g in wrn} == {16, 8, 4, 2}
    # microbatch sizes: M = batch / (d * b)
    two = megatron_grid(2, 24, 1024, microbatch_sizes=(1, 2))
    assert {(g.d, g.m) for g in two if g.t == 1 and g.p == 1} == {(2, 512), (2, 256)}


def test_grid_skips_points_whose_state_cannot_fit():
    budget = 16 * 2**30
    grid = megatron_grid(64, 48, 1024, state_bytes=12 * 39e9, budget_bytes=budget)
    for g in grid:
        assert (g.skip is not None) == (12 * 39e9 / (g.t * g.p) > budget)
    assert grid[0].t * grid[0].p == max(g.t * g.p for g in grid)   # least state first


def test_layouts_and_shapes():
    assert cluster_shape(4) == (1, 4) and cluster_shape(64) == (8, 8)
    assert submesh(16) == (2, 8) and submesh(2) == (1, 2)
    with pytest.raises(ValueError):
        submesh(12)
    k, spans, subs, shapes = manual_stage_layout(GridPoint(2, 8, 4, 512))
    assert k == 4 and spans == ((0, 0), (1, 1), (2, 2), (3, 3))
    assert subs == ((2, 8),) * 4 and shapes == ((2, 8),) * 4
    assert auto_microbatches(1024) == [1024, 512, 256]
    assert auto_microbatches(1520, 4) == [1520, 760, 380, 190]


def test_configs_are_consistent():
    assert [c.gpus for c in FAMILIES["gpt"]] == [1, 2, 4, 8, 16, 32, 64]
    assert ALL["gpt-39B"].dims["hidden"] == 8192 and ALL["gpt-39B"].batch == 1024
    # Alpa's grid searched 8 auto layers; its published 39B plan used 16
    assert ALL["gpt-39B"].auto_layers == (8, 16) and ALL["gpt-350M"].auto_layers == (1,)
    assert ALL["moe-70B"].dims["num_experts"] == 64 and ALL["wrn-13B"].batch == 1520
    for fam, names in DEFAULT.items():
        assert all(f"{fam}-{n}" in ALL for n in names)


def test_slope():
    assert slope([8, 64, 512], [1.0, 8.0, 64.0]) == pytest.approx(1.0)
    assert slope([8, 64], [2.0, 2.0]) == pytest.approx(0.0)
    assert slope([8], [1.0]) is None


def _case(key, auto, manual):
    def entry(x):
        return {"status": "ok", "tflops": x, "m": 8, "wall_s": 1.0, "d": 1, "t": 1, "p": 1} \
            if x else {"status": "infeasible", "wall_s": 1.0, "m": 8}
    return {"key": key, "auto": {"tries": [entry(auto)]}, "manual": {"points": [entry(manual)]}}


def test_goals():
    res = {"configs": [_case("gpt-39B", 50.0, 40.0), _case("moe-10B", 30.0, 10.0),
                       _case("moe-2.4B", 20.0, 15.0), _case("gpt-1.3B", None, 5.0),
                       _case("wrn-2B", 10.0, 10.0)]}
    res["configs"][0]["auto"]["auto_layers"] = 8
    res["configs"][0]["auto"]["tries"][0]["m"] = 1024
    g = {name: (status, detail) for name, status, detail in goals(res)}
    g39 = g[G39B_GOAL]
    assert g39[0] == "not evaluable" and "K=8, M=1024: ok in 1.0 s" in g39[1]
    assert "K=8, M=128: not run here" in g39[1] and "K=16" not in g39[1]
    res["g39b"] = [{"auto_layers": 8, "m": 128, "status": "ok", "wall_s": 30.0}]
    assert goals(res)[0][1] == "met"
    res["g39b"][0]["wall_s"] = 61.0
    assert goals(res)[0][1] == "missed"
    dense = g[DENSE_GOAL]
    assert dense[0] == "missed" and "gpt-1.3B" in dense[1] and "wrn-2B 1.00x" in dense[1]
    memory = g[MEMORY_GOAL]       # moe-2.4B 1.33x, moe-10B 3x, gpt-39B 1.25x: all >= 1.2
    assert memory[0] == "met" and "moe-2.4B 1.33x" in memory[1] and "gpt-39B 1.25x" in memory[1]
    assert memory_bound("gpt-6.7B") and not memory_bound("gpt-1.3B") and memory_bound("moe-380M")
    assert not memory_bound("wrn-13B")
    assert g[REMAT_GOAL][0] == "missed"          # the cases' stages record no remat


def test_goals_report_the_remat_of_every_stage():
    res = {"configs": [_case("gpt-6.7B", 11.0, 10.0)]}
    res["configs"][0]["auto"]["tries"][0]["stages"] = [{"remat": "full"}, {"remat": "none"}]
    name, status, detail = goals(res)[3]
    assert name == REMAT_GOAL and status == "met" and "gpt-6.7B full/none" in detail
    assert goals(res)[2][1] == "missed"          # 1.2x wanted on GPT >= 6.7B


def test_plot_goes_next_to_the_report():
    from paper_report import DEFAULT_OUT, plot_path
    assert plot_path("/tmp/p.md", None) == "/tmp/p-scale.png"
    assert plot_path("/tmp/p.md", "/x/s.png") == "/x/s.png"
    assert plot_path(DEFAULT_OUT, None).endswith(os.path.join("benchmarks", "results",
                                                              "paper-scale.png"))
    assert os.path.exists(plot_path(DEFAULT_OUT, None))     # the last run's plot


def test_several_auto_layer_counts_keep_the_best_plan_and_name_its_count():
    from paper_report import _planning_table, _results_table
    r = _case("gpt-39B", 50.0, 55.0)
    r["auto"]["auto_layers"] = [8, 16]
    fast = dict(r["auto"]["tries"][0], tflops=58.0, auto_layers=16, m=1024,
                stages=[{"layers": [0, 0], "submesh": [1, 4], "logical": [1, 4]}])
    r["auto"]["tries"][0].update(auto_layers=8, m=1024, stages=[])
    r["auto"]["tries"].append(fast)
    r["auto"]["not_tried"] = [{"auto_layers": 8, "m": 512}]
    row = next(x for x in _results_table({"configs": [r]}) if x.startswith("| GPT 39B"))
    assert "| 58.0 | K=16, M=1024: L0 1x4 (1x4) |" in row and "| 1.05 |" in row
    plan = next(x for x in _planning_table({"configs": [r]}) if x.startswith("| GPT 39B"))
    assert "K=8, M=1024: ok 1.0 s; K=16, M=1024: ok 1.0 s" in plan
    assert "not tried" in plan and "K=8, M=512" in plan
    assert goals({"configs": [r]})[1][1] == "met"           # 58.0 / 55.0 >= 1.00
