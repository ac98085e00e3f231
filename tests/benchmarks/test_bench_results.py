"""benchmarks/results/: one report per benchmark, each rewritten whole by its script, and
BENCHMARKS.md, their index, linking every one (pure Python; nothing is run)."""
import os
import re

import common

from support import REPO as ROOT

LINK = re.compile(r"\]\(([^)#\s]+)")        # [text](target): local targets only, see below


def test_write_result_rewrites_the_whole_file(tmp_path):
    path = str(tmp_path / "new" / "x.md")        # the folder is made
    common.write_result("## A\n\nold\n\n", path)
    common.write_result("## B\n\nnew", path)
    assert open(path).read() == "## B\n\nnew\n"


def test_default_paths_and_heads():
    assert common.result_path("methods") == os.path.join(ROOT, "benchmarks", "results",
                                                         "methods.md")
    res = {"started": "s", "finished": "f", "revision": "r", "cpu": "c", "load": [1.0]}
    head = common.section_head("Title", res, "make bench")
    assert head[0] == "## Title" and "Command: `make bench`; s to f" in head[2]
    assert common.section_tail(head, {**res, "error": "boom"}).endswith(
        "The worker did not finish: boom.")


def test_every_report_exists_and_is_indexed():
    index = open(common.INDEX).read()
    for key in common.RESULT_KEYS:
        path = common.result_path(key)
        assert os.path.exists(path), path
        with open(path) as f:
            text = f.read()
        assert text.startswith("## ") and "<!--" not in text, key
        assert f"(benchmarks/results/{key}.md)" in index, key
    listed = set(re.findall(r"\(benchmarks/results/(\w+)\.md\)", index))
    assert listed == set(common.RESULT_KEYS)


def test_local_links_resolve():
    files = [common.INDEX] + [common.result_path(k) for k in common.RESULT_KEYS]
    for path in files:
        with open(path) as f:
            text = f.read()
        for target in LINK.findall(text):
            if "://" in target:
                continue
            full = os.path.normpath(os.path.join(os.path.dirname(path), target))
            assert os.path.exists(full), f"{path}: {target}"
