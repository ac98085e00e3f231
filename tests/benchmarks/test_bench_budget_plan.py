"""benchmarks/budget_plan.py's report: rows come from the measured dict (sizes in MB), a
failed case says so."""


import budget_plan  # noqa: E402

BASE = {"started": "s", "finished": "f", "revision": "r", "cpu": "c", "load": [1.0]}


def test_section_rows_and_a_failed_case():
    rows = [{"api": "jax.value_and_grad", "budget": 22_250_000, "plan_s": 98.04, "searches": 1,
             "remat": "selective/none", "predicted": 21_080_000, "search_peak": 21_130_000,
             "compiled": 21_930_000, "check_rounds": 0},
            {"api": "small GPT at 1.05x its free peak", "small": True, "budget": 747_948,
             "plan_s": 53.3, "searches": 2, "remat": "none", "predicted": 618_124,
             "search_peak": 849_784, "compiled": 598_692, "check_rounds": 0, "vs_free": 1.1571},
            {"api": "autopar.value_and_grad", "error": "X: boom"}]
    text = budget_plan.section({**BASE, "rows": rows, "error": "worker exited with status 1"},
                               "make bench")
    assert text.startswith("## Planning under a binding memory budget")
    assert ("| jax.value_and_grad | 22.25 | 98.0 | 1 | selective/none | 21.08 | 21.13 | 21.93 "
            "| 0 | - |") in text
    assert "| small GPT at 1.05x its free peak | 0.75 | 53.3 | 2 | none | 0.62 | 0.85 | 0.60 | 0 " \
           "| 1.157 |" in text
    assert "| autopar.value_and_grad | failed: X: boom |" in text
    assert "The worker did not finish: worker exited with status 1." in text
