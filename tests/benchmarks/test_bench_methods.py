"""benchmarks/methods.py's report: rows come from the measured dict, a failed case says so."""


import methods  # noqa: E402

BASE = {"started": "s", "finished": "f", "revision": "r", "cpu": "c", "load": [1.0]}


def test_section_rows():
    row = {"model": "mlp", "method": "Zero2Parallel", "param_bytes": 2048,
           "compiled": {"all-reduce": [1, 2048], "all-gather": [12, 2048]},
           "predicted": {"reduce-scatter": [6, 2048], "all-gather": [12, 2048]},
           "update_flops": 1234.0, "flops": 99999.0}
    text = methods.section({**BASE, "rows": [row]}, "make bench")
    # the whole results file (benchmarks/results/methods.md): its heading first, no markers
    assert text.startswith("## Method promises\n") and "<!--" not in text
    assert ("| mlp | Zero2Parallel | all-reduce 1 (2 KiB), all-gather 12 (2 KiB) | all-gather 12 "
            "(2 KiB), reduce-scatter 6 (2 KiB) | 1.00x | 1,234 | 99,999 |") in text


def test_section_reports_a_failed_case_and_worker():
    text = methods.section({**BASE, "rows": [{"model": "gpt", "method": "DataParallel",
                                              "error": "ValueError: boom"}],
                            "error": "worker exited with status 1"}, "make bench")
    assert "| gpt | DataParallel | failed: ValueError: boom |" in text
    assert "The worker did not finish: worker exited with status 1." in text
