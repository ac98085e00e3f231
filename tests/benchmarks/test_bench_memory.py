"""benchmarks/memory.py: the section renders both schedulers, ratios and the 15% count."""

import memory  # noqa: E402


def _row(sched, pred, comp, **kw):
    return {"model": "GPT", "mesh": [2, 4], "remat": "none", "scheduler": sched,
            "predicted": pred, "compiled": comp, "argument": 1, "output": 1,
            "temp": comp - 2, "alias": 0, **kw}


def test_section_ratios_and_band():
    res = {"started": "t0", "finished": "t1", "revision": "abc", "cpu": "cpu", "load": [],
           "rows": [_row("memory", 2**20 * 1.1, 2**20), _row("default", 2**20 * 1.1, 2**21),
                    {"model": "MoE", "mesh": [1, 8], "remat": "none", "scheduler": "memory",
                     "error": "Boom: x"}]}
    text = memory.section(res, "python benchmarks/memory.py")
    # the whole results file (benchmarks/results/memory.md): its heading first, no markers
    assert text.startswith("## Memory fidelity (predicted vs compiled peak per device)\n")
    assert "<!--" not in text
    assert "| GPT | 2x4 | none | 1.10 | 1.00 | 1.10 | 2.00 | 0.55 |" in text
    assert "failed: Boom: x" in text
    assert "1 of 1 cases" in text


def test_compiled_bytes_is_args_plus_outputs_plus_temp_minus_alias():
    class M:
        argument_size_in_bytes, output_size_in_bytes = 10, 20
        temp_size_in_bytes, alias_size_in_bytes = 30, 5

    class C:
        def memory_analysis(self):
            return M()
    assert memory.compiled_bytes(C()) == 55
