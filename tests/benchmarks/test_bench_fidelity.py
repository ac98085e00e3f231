"""The statistics of `benchmarks/fidelity.py`: ranks with ties, Spearman's correlation and the
regret of autopar's choice (pure Python; no plans are run here)."""

import fidelity  # noqa: E402
import pytest


def test_ranks_share_ties():
    assert fidelity.ranks([3.0, 1.0, 2.0]) == [3.0, 1.0, 2.0]
    assert fidelity.ranks([1.0, 2.0, 2.0, 5.0]) == [1.0, 2.5, 2.5, 4.0]


def test_spearman_known_values():
    assert fidelity.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert fidelity.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # one swapped pair of 5: 1 - 6 * 2 / (5 * 24) = 0.9
    assert fidelity.spearman([1, 2, 3, 4, 5], [1, 2, 3, 5, 4]) == pytest.approx(0.9)
    assert fidelity.spearman([1, 2], [2, 1]) is None
    assert fidelity.spearman([1, 1, 1], [1, 2, 3]) is None       # no spread: undefined


def test_summary_regret_and_failed_candidates():
    cases = [
        {"case": fidelity.AUTOPAR, "kind": "shard", "predicted_step_s": 1.0,
         "measured_step_s": 1.2},
        {"case": "b", "kind": "data", "predicted_step_s": 2.0, "measured_step_s": 1.0},
        {"case": "c", "kind": "pipeline", "predicted_step_s": 3.0, "measured_step_s": 3.0},
        {"case": "d", "kind": "random", "error": "timed out"},
    ]
    s = fidelity.summary(cases)
    assert s["n"] == 3 and s["n_single_mesh"] == 2
    assert s["regret"] == pytest.approx(1.2) and s["best"] == "b"
    assert s["predicted_best"] == fidelity.AUTOPAR
    assert s["spearman"] == pytest.approx(0.5)
    # predicted / measured per candidate: 1.0 / 1.2, 2.0 / 1.0, 3.0 / 3.0
    assert s["ratio_min"] == pytest.approx(1 / 1.2) and s["ratio_max"] == pytest.approx(2.0)
    assert s["ratio_median"] == pytest.approx(1.0)


def test_section_shows_the_ratio_per_candidate():
    res = {"date": "d", "machine": "m", "command": "c", "revision": "r", "steps": 3,
           "profile": {"wall_s": 1.0, "matmul_flops_per_s": {"float32": 2e10},
                       "memory_bytes_per_s": 1.5e9},
           "models": {"mlp": [
               {"case": fidelity.AUTOPAR, "kind": "shard", "mesh": [2, 4],
                "predicted_step_s": 0.1, "measured_step_s": 0.125},
               {"case": "b", "kind": "data", "mesh": [2, 4], "predicted_step_s": 0.2,
                "measured_step_s": 0.2},
               {"case": "c", "kind": "zero2", "mesh": [2, 4], "predicted_step_s": 0.3,
                "measured_step_s": 0.25}]}}
    text = fidelity.section(res)
    assert "| 100.00 | 125.0 | 0.80 |" in text and "| 300.00 | 250.0 | 1.20 |" in text
    assert "median **1.00**, range 0.80 to 1.20" in text and "0.77 to 1.3: met" in text
    assert "1.5e+09 B/s" in text


def test_comparison_with_a_baseline_run():
    def run(pred):
        return {"date": "d0", "load_start": [1.0], "models": {"gpt": [
            {"case": fidelity.AUTOPAR, "kind": "shard", "predicted_step_s": pred[0],
             "measured_step_s": 1.0},
            {"case": "b", "kind": "data", "predicted_step_s": pred[1], "measured_step_s": 2.0},
            {"case": "c", "kind": "zero2", "predicted_step_s": pred[2],
             "measured_step_s": 3.0}]}}
    base, now = run([0.5, 0.4, 0.6]), run([1.0, 2.0, 3.0])
    lines = fidelity.comparison(now, base, "b368db5")
    assert lines[0].startswith("Against the run of b368db5 (d0 UTC")
    row = next(line for line in lines if line.startswith("| GPT"))
    # baseline: ranks (2, 1, 3) vs (1, 2, 3) -> 0.5; now: perfect, every ratio 1.0
    assert "0.500 -> **1.000**" in row and "1.00 (1.00-1.00)" in row


def test_section_appends_notes():
    res = {"date": "d", "machine": "m", "command": "c", "revision": "r", "steps": 1,
           "models": {}, "notes": "- an earlier run had load 9.\n"}
    text = fidelity.section(res)
    # the notes come before the closing paragraph, which ends the results file
    assert "- an earlier run had load 9." in text
    assert text.index("- an earlier run had load 9.") < text.index("Absolute times on simulated")
    assert text.startswith("## Cost-model fidelity") and "<!--" not in text
    assert text.endswith("the single-mesh correlation is shown for that reason.")
