"""benchmarks/schedules.py's report: ratios to 1F1B from the measured dict, a failed case says
so."""


import schedules  # noqa: E402

BASE = {"started": "s", "finished": "f", "revision": "r", "cpu": "c", "load": [1.0]}


def _row(name, chosen, pred, v100, times, losses):
    return {"schedule": name, "chosen": chosen, "chosen_v100": chosen, "predicted_s": pred,
            "predicted_v100_s": v100, "times": times, "losses": losses, "plan_s": 2.0 * pred,
            "stage_peaks": [2**20 * pred, 2**21], "predicted_profiled_s": 3.0 * pred,
            "chosen_profiled": chosen, "call_overhead_s": 1.5e-4}


def test_section_rows_are_ratios_to_1f1b_in_the_same_run():
    rows = [_row("1f1b", "1f1b", 2.0, 4.0, [0.2, 0.1, 0.3], [1.0, 0.5]),
            _row("zb-h1", "zb-h1", 1.7, 3.2, [0.25, 0.2, 0.3], [1.0, 0.5001])]
    text = schedules.section({**BASE, "rows": rows}, "make bench")
    assert text.startswith("## Pipeline schedules") and "<!--" not in text
    assert ("| 1f1b | 1f1b | 4.0 (1.00) | 1.000 | 1.000 | 1.000 | 1f1b | 200.0 ms | 1.000 "
            "| 0.0e+00 | 2.00 MiB (1.00), 2.00 MiB (1.00) |" in text)
    assert ("| zb-h1 | zb-h1 | 3.4 (0.85) | 0.850 | 0.850 | 0.800 | zb-h1 | 250.0 ms | 1.250 "
            "| 2.0e-04 | 1.70 MiB (0.85), 2.00 MiB (1.00) |" in text)
    assert "call overhead: 150 us per executable call" in text


def test_section_reports_a_failed_case_and_worker():
    rows = [_row("1f1b", "1f1b", 2.0, 4.0, [0.2], [1.0]),
            {"schedule": "zb-h2", "error": "X: boom"}]
    text = schedules.section({**BASE, "rows": rows, "error": "stopped"}, "make bench")
    assert "| zb-h2 | failed: X: boom |" in text
    assert "The worker did not finish: stopped." in text


def test_the_eval_row_compares_the_forward_pipeline_with_jit_and_training_peaks():
    rows = [_row("1f1b", "1f1b", 2.0, 4.0, [0.2], [1.0]),
            {"schedule": "eval", "chosen": "forward", "plan_s": 1.5, "diff": 3e-7,
             "pipeline_times": [0.04, 0.05, 0.06], "jit_times": [0.01, 0.02, 0.03],
             "stage_peaks": [2**19, 2**20]}]
    text = schedules.section({**BASE, "rows": rows}, "make bench")
    assert "| eval | 1.5 | 50.0 ms | 20.0 ms | 2.50 | 3.0e-07 | 0.50 MiB (0.25), " \
           "1.00 MiB (0.50) |" in text
    assert "| eval | forward |" not in text        # not a row of the schedules' table
    failed = schedules.section({**BASE, "rows": [rows[0], {"schedule": "eval",
                                                          "error": "X: boom"}]}, "make bench")
    assert "| eval | failed: X: boom |" in failed
