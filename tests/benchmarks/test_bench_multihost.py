"""benchmarks/multihost.py's report: the tables come from the measured dict, failures are
reported as such (no numbers invented)."""


import multihost  # noqa: E402

BASE = {"started": "s", "finished": "f", "revision": "r", "cpu": "c", "load": [1.0],
        "steps": 10}


def test_section_tables_and_ratios():
    res = {**BASE,
           "cache": {"ShardParallel": {"search": 4.0, "hit": 1.0, "lookup": 0.1}},
           "one": {"processes": 1, "ShardParallel": {"step_s": 0.5, "loss": 7.5}},
           "two": {"processes": 2, "ShardParallel": {"step_s": 0.75, "loss": 7.5}}}
    text = multihost.section(res, "make bench")
    # the whole results file (benchmarks/results/multihost.md): its heading first, no markers
    assert text.startswith("## Multi-host and plan cache\n") and "<!--" not in text
    assert "| ShardParallel | 4.00 | 1.00 | 0.10 | 4.0x |" in text
    assert "| ShardParallel | 500.0 | 750.0 | 1.50 | 7.500000 | 7.500000 |" in text


def test_section_reports_failures_without_numbers():
    res = {**BASE, "cache": {"error": "exit 1: boom"}, "one": {"error": "exit 2: x"},
           "two": {"processes": 2}}
    text = multihost.section(res, "make bench")
    assert "not measured: exit 1: boom" in text
    assert "not measured: 1 process: exit 2: x" in text
    assert "| plan |" not in text
