"""benchmarks/shared_copies.py's report: rows come from the measured dict, a failed case says
so."""


import shared_copies  # noqa: E402

BASE = {"started": "s", "finished": "f", "revision": "r", "cpu": "c", "load": [1.0]}


def test_section_rows_plain_and_shared():
    rows = [{"case": "MoE layer", "mesh": "1x4", "shared": False, "plan_s": 1.234,
             "step_s": 6.3558e-4, "note": "optimal (highs, 1 variables, 1 constraints)",
             "compiled": {"all-reduce": [3, 34820], "all-gather": [2, 65536]}},
            {"case": "MoE layer", "mesh": "1x4", "shared": True, "plan_s": 1.5,
             "step_s": 6.3167e-4, "note": "37 shared resharded copies: 3.9e-06 s faster",
             "compiled": {"all-to-all": [3, 98304], "all-reduce": [1, 2056]}}]
    text = shared_copies.section({**BASE, "rows": rows}, "make bench")
    assert text.startswith("## Shared resharded copies") and "<!--" not in text
    assert ("| MoE layer | 1x4 | plain | 1.23 | 0.6356 | optimal (highs, 1 variables, 1 "
            "constraints) | all-reduce 3 (34 KiB), all-gather 2 (64 KiB) |") in text
    assert ("| MoE layer | 1x4 | shared | 1.50 | 0.6317 | 37 shared resharded copies: 3.9e-06 "
            "s faster | all-reduce 1 (2 KiB), all-to-all 3 (96 KiB) |") in text


def test_section_reports_a_failed_case_and_worker():
    text = shared_copies.section(
        {**BASE, "rows": [{"case": "GPT", "mesh": "2x4", "shared": True, "error": "X: boom"}],
         "error": "worker stopped after 1800 s"}, "make bench")
    assert "| GPT | 2x4 | shared | failed: X: boom |" in text
    assert "The worker did not finish: worker stopped after 1800 s." in text
