"""benchmarks/loops.py's report: rows come from the measured dict, a failed case says so."""


import loops  # noqa: E402

BASE = {"started": "s", "finished": "f", "revision": "r", "cpu": "c", "load": [1.0]}


def test_section_rows_compiled_and_plan_only():
    rows = [{"layers": 4, "scan": True, "plan_s": 2.94, "ilp_groups": 319, "ilp_vars": 18601,
             "temp": 3 * 2**20, "temp_one_device": 12 * 2**20,
             "compiled": {"all-reduce": [5, 1024], "all-gather": [19, 2048]},
             "in_loops": {"all-reduce": [3, 512]}},
            {"layers": 48, "scan": False, "plan_s": 56.4, "ilp_groups": 9857,
             "ilp_vars": 31437}]
    text = loops.section({**BASE, "rows": rows}, "make bench")
    # the whole results file (benchmarks/results/loops.md): its heading first, no markers
    assert text.startswith("## Loops (scanned vs unrolled GPT)\n") and "<!--" not in text
    assert ("| 4 | scan | 2.9 | 319 | 18601 | 3.00 MiB | 0.25 | all-reduce 5, all-gather 19 "
            "| all-reduce 3 |") in text
    assert "| 48 | unrolled | 56.4 | 9857 | 31437 | not compiled (plan only) |" in text


def test_section_reports_a_failed_case_and_worker():
    text = loops.section({**BASE, "rows": [{"layers": 12, "scan": True, "error": "X: boom"}],
                          "error": "worker stopped after 1800 s"}, "make bench")
    assert "| 12 | scan | failed: X: boom |" in text
    assert "The worker did not finish: worker stopped after 1800 s." in text
