"""Every Python code block of README.md and docs/*.md runs.

The blocks of one page run in order in one namespace, as a reader runs them one after another,
in a fresh temporary directory (files a block writes, `plan.html` say, land there, and
`AUTOPAR_CACHE_DIR` points there), on the
suite's 8 simulated CPU devices. A block that cannot run here is marked on the line before its
fence, with the reason, and is skipped and counted:

    <!-- docs: skip (needs several processes: run it with `autopar launch`) -->
    ```python
    ...

Only ```python fences run (```bash and plain fences are not Python). The terminal summary
counts the blocks run and skipped (`pytest_terminal_summary` in conftest.py).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SKIP = re.compile(r"<!--\s*docs:\s*skip\s*\((?P<reason>.+)\)\s*-->")
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)[ \t]*$")


@dataclass(frozen=True)
class Block:
    path: str                 # relative to the repository
    line: int                 # 1-based line of the opening fence
    code: str
    skip: str | None          # the reason, for a block marked skip


def pages() -> list[str]:
    docs = os.path.join(REPO, "docs")
    return ["README.md"] + sorted(os.path.join("docs", f) for f in os.listdir(docs)
                                  if f.endswith(".md"))


def blocks(path: str) -> list[Block]:
    """The ```python blocks of the page at `path` (relative to the repository), in order."""
    return parse(open(os.path.join(REPO, path), encoding="utf-8").read(), path)


def parse(text: str, path: str) -> list[Block]:
    """The ```python blocks of `text` (the page `path`), in order."""
    lines = text.splitlines()
    found, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m or not m.group("lang"):
            i += 1
            continue
        indent, start = m.group("indent"), i
        end = next((j for j in range(i + 1, len(lines))
                    if lines[j].strip() == "```"), None)
        if end is None:
            raise AssertionError(f"{path}:{i + 1}: a ``` fence that is never closed")
        if m.group("lang") == "python":
            prev = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
            skip = SKIP.search(prev)
            code = "\n".join(line[len(indent):] if line.startswith(indent) else line
                             for line in lines[start + 1:end])
            found.append(Block(path, start + 1, code + "\n",
                               skip.group("reason") if skip else None))
        i = end + 1
    return found


def test_the_collector_reads_fences_skips_and_indented_blocks():
    text = ("x\n```python\na = 1\n```\n<!-- docs: skip (no GPU here) -->\n\n```python\nb\n```\n"
            "```bash\nmake\n```\n- item:\n\n  ```python\n  c = a + 1\n  ```\n")
    got = parse(text, "page.md")
    assert [(b.line, b.code, b.skip) for b in got] == [
        (2, "a = 1\n", None), (7, "b\n", "no GPU here"), (15, "c = a + 1\n", None)]
    with pytest.raises(AssertionError, match="page.md:2: a ``` fence that is never closed"):
        parse("x\n```python\na = 1\n", "page.md")


@pytest.mark.parametrize("path", pages())
def test_code_blocks_run(path, tmp_path, monkeypatch, record_property):
    found = blocks(path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path / "cache"))   # profiles, plan cache
    namespace: dict = {"__name__": f"docs:{path}"}
    ran = skipped = 0
    for block in found:
        if block.skip:
            skipped += 1
            continue
        try:
            exec(compile(block.code, f"{path}:{block.line}", "exec"), namespace)
        except Exception as e:
            raise AssertionError(f"the code block at {path}:{block.line} raised "
                                 f"{type(e).__name__}: {e}") from e
        ran += 1
    record_property("docs_blocks", (ran, skipped))
    if not found:
        pytest.skip(f"{path} has no python code blocks")


def test_local_links_resolve():
    """Every relative link of README.md and docs/ names a file of the repository."""
    link = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
    broken = []
    for page in pages():
        text = open(os.path.join(REPO, page), encoding="utf-8").read()
        for target in link.findall(text):
            if "://" in target:
                continue
            if not os.path.exists(os.path.join(REPO, os.path.dirname(page), target)):
                broken.append(f"{page}: {target}")
    assert not broken, broken
