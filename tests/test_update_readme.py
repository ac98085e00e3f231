"""examples/update_readme.py: the marked README blocks it rewrites (the rewrite itself runs the
demo, so it is `make readme`, not a test)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples"))
import update_readme  # noqa: E402


def test_replace_block_rewrites_only_between_its_markers():
    text = "a\n<!-- x:start -->\nold\n<!-- x:end -->\nb\n"
    got = update_readme.replace_block(text, "x", "new 1\nnew 2\n")
    assert got == "a\n<!-- x:start -->\n```\nnew 1\nnew 2\n```\n<!-- x:end -->\nb\n"
    assert update_readme.replace_block(got, "x", "new 1\nnew 2") == got      # idempotent


def test_a_missing_marker_names_it_and_the_fix():
    with pytest.raises(SystemExit, match="no page has a `<!-- y:start -->`.*Fix"):
        update_readme.replace_block("text", "y", "body")


def test_the_readme_and_docs_have_every_block():
    assert update_readme.main(["--check"]) == 0
    pages = update_readme.pages()
    assert pages[0] == "README.md" and "docs/cli-and-report.md" in pages


def test_demo_output_is_cut_into_the_excerpts():
    out = ("jax ...\nautopar plan  method=x\nmesh: ...\n(concise: ...)\nmore\n"
           "step       autopar  jax.jit\n   0  1.0  1.0  0.0\nautopar matches\n")
    err = "autopar: train_step: trace: 0.1 s\nsomething else\n"
    parts = update_readme.demo_parts(out, err)
    assert parts["demo-dump"] == "autopar plan  method=x\nmesh: ...\n(concise: ...)"
    assert parts["demo-tail"].startswith("step       autopar") and "matches" in parts["demo-tail"]
    assert parts["demo-progress"] == "autopar: train_step: trace: 0.1 s"
