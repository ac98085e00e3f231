"""`make demo` (examples/train_gpt.py) as a user sees it: a progress line per planning phase
with its time, the concise dump, the plan written as a page whose path it prints, and the
losses matching single-device training (exit status 0)."""
import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_demo_prints_progress_the_concise_dump_and_the_report_path(tmp_path):
    env = {**os.environ, "AUTOPAR_PLAN_CACHE": "off", "PYTHONPATH": REPO}
    env.pop("AUTOPAR_RUNNER_UPS", None)              # as a user runs it
    env.pop("XLA_FLAGS", None)                       # the demo sets its 8 devices itself
    got = subprocess.run([sys.executable, os.path.join(REPO, "examples", "train_gpt.py")],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert got.returncode == 0, got.stdout[-3000:] + got.stderr[-3000:]
    assert "autopar matches single-device training" in got.stdout
    # a line per phase, each with its time (off a terminal: the autopar.progress records)
    for phase in ("trace", "intra-op ILP", "runner-ups", "lowering", "XLA compile"):
        assert re.search(rf"^autopar: train_step: {phase}: \d+\.\d+ (s|ms|us)", got.stderr,
                         re.M), (phase, got.stderr[-2000:])
    lines = got.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("autopar plan "))
    end = next(i for i, line in enumerate(lines) if line.startswith("(concise:"))
    assert end - start + 1 <= 60
    assert any(line.lstrip().startswith("why this plan") for line in lines[start:end])
    path = next(line.split(": ", 1)[1] for line in lines if "the plan as a page" in line)
    assert path == str(tmp_path / "plan.html")
    page = (tmp_path / "plan.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and 'id="runner-ups"' in page
