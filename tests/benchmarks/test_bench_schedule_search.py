"""benchmarks/schedule_search.py's report: ratios from the planned rows, a layout AUTO shares
with 1F1B written as "same", a failed case says so."""

import schedule_search  # noqa: E402

BASE = {"started": "s", "finished": "f", "revision": "r", "cpu": "c", "load": [1.0]}


def test_section_rows_ratios_and_a_failed_case():
    rows = [{"layers": 4, "m": 8, "budget_x": None, "budget": None, "one_s": 2.0, "auto_s": 2.5,
             "one_step": 1.0, "auto_step": 0.9, "one_stages": "L0-3 1x8",
             "auto_stages": "L0-3 1x8", "schedule": "zb-h1", "same_layout": True},
            {"layers": 4, "m": 8, "budget_x": 1.1, "budget": 5e5, "one_s": 2.0, "auto_s": 3.0,
             "one_step": 1.0, "auto_step": 0.8, "one_stages": "L0-1 1x4; L2-3 1x4",
             "auto_stages": "L0 1x2; L1-3 1x6", "schedule": "zb-h2", "same_layout": False},
            {"layers": 8, "m": 32, "budget_x": 1.3, "error": "X: boom"},
            {"paper": "gpt-6.7B", "gpus": 16, "m": 128, "one_s": 50.0, "auto_s": 60.0,
             "one_step": 2.0, "auto_step": 1.9, "one_stages": "L0-7 1x8", "auto_stages": "x",
             "schedule": "zb-h1", "same_layout": True},
            {"paper": "gpt-39B", "gpus": 64, "m": 1024, "error": "Y: late"}]
    text = schedule_search.section({**BASE, "rows": rows}, "make bench")
    assert text.startswith("## The schedule searched with the stages")
    assert "| 4 | 8 | none | 2.0 | 2.5 | 1.25 | L0-3 1x8 | zb-h1 | same | 0.900 |" in text
    assert ("| 4 | 8 | 1.1x | 2.0 | 3.0 | 1.50 | L0-1 1x4; L2-3 1x4 | zb-h2 | L0 1x2; L1-3 1x6 "
            "| 0.800 |") in text
    assert "| 8 | 32 | 1.3x | failed: X: boom |" in text
    assert "| gpt-6.7B | 16 | 128 | 50.0 | 60.0 | 1.20 | L0-7 1x8 | zb-h1 | same | 0.950 |" in text
    assert "| gpt-39B | 64 | 1024 | failed: Y: late |" in text
