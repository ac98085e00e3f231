"""The house in layers (DESIGN.md; autopar/__init__.py's docstring): autopar/ is a stack of
packages that import only downwards (`lint-imports`, configured in pyproject.toml), with no
import cycle (function-local imports included), no module named like a standard-library module,
a top level of the public API and the driver only, and a wheel that installs `autopar` alone."""
from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys
import zipfile

import networkx as nx
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "autopar")


def _modules() -> dict[str, str]:
    """Dotted module name -> file, for every module of autopar/."""
    out = {}
    for dirpath, dirnames, files in os.walk(PKG):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                name = os.path.relpath(path[:-3], ROOT).replace(os.sep, ".")
                out[name.removesuffix(".__init__")] = path
    return out


def import_graph() -> nx.DiGraph:
    """autopar's module import graph from the source (every import statement, at any depth:
    a function-local import is an edge like any other). `autopar` itself (the public API that
    re-exports the layers) is left out: the command line and the models import it from above."""
    mods = _modules()
    g = nx.DiGraph()
    g.add_nodes_from(m for m in mods if m != "autopar")
    for mod, path in mods.items():
        if mod == "autopar":
            continue
        pkg = mod if path.endswith("__init__.py") else mod.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, ast.ImportFrom):
                base = pkg.split(".")[:len(pkg.split(".")) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                names = [f"{target}.{a.name}" for a in node.names] + [target]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                while name and name not in mods and "." in name:
                    name = name.rsplit(".", 1)[0]
                if name in mods and name not in (mod, "autopar"):
                    g.add_edge(mod, name)
    return g


def test_the_import_graph_has_no_cycle():
    g = import_graph()
    assert g.number_of_edges() > 300                  # the graph is really read
    cycles = list(nx.simple_cycles(g, length_bound=12))
    assert not cycles, f"{len(cycles)} import cycle(s), e.g. {' -> '.join(cycles[0])}"


def test_the_cycle_check_sees_a_function_local_import(tmp_path, monkeypatch):
    """The check can fail: a cycle closed by an import inside a function is found."""
    pkg = tmp_path / "autopar"
    (pkg / "core").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "core" / "__init__.py").write_text("")
    (pkg / "core" / "a.py").write_text("from autopar.core.b import x\n")
    (pkg / "core" / "b.py").write_text("def x():\n    from . import a\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", str(tmp_path))
    monkeypatch.setattr(sys.modules[__name__], "PKG", str(pkg))
    assert list(nx.simple_cycles(import_graph())) != []


def test_lint_imports_keeps_every_contract():
    """The layers contract and the forbidden imports of pyproject.toml ([tool.importlinter])."""
    run = subprocess.run([sys.executable, "-c", "import sys; from importlinter.cli import "
                          "lint_imports; sys.exit(lint_imports(no_cache=True, no_logo=True))"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "Contracts: 4 kept, 0 broken." in run.stdout, run.stdout[-2000:]


def test_no_module_shadows_the_standard_library():
    clash = sorted(m for m in _modules() if m.rsplit(".", 1)[-1] in sys.stdlib_module_names)
    assert not clash, f"modules named like standard-library ones: {clash}"


def test_top_level_holds_the_api_and_the_driver_only_and_files_stay_small():
    top = sorted(f for f in os.listdir(PKG) if f.endswith(".py"))
    assert len(top) <= 6, top
    long = {os.path.relpath(p, ROOT): n for p in _modules().values()
            if (n := sum(1 for _ in open(p))) > 500}
    assert not long, f"files over 500 lines: {long}"


# Tests of the repository as a whole (its layers, its docs, its demo) stay at tests/.
REPOSITORY_TESTS = {"test_layers.py", "test_docs.py", "test_update_readme.py", "test_demo.py"}


def test_the_tests_mirror_the_packages():
    """tests/<package>/ for every package of autopar/ (tests/api: the driver end to end;
    tests/benchmarks: the benchmark scripts; tests/support: what tests share, no test of
    autopar), and no other test module at the top of tests/."""
    tests = os.path.join(ROOT, "tests")
    packages = {d for d in os.listdir(PKG) if os.path.isfile(os.path.join(PKG, d, "__init__.py"))}
    folders = {d for d in os.listdir(tests) if os.path.isdir(os.path.join(tests, d))
               and d != "__pycache__"}
    assert packages <= folders, f"packages without tests/<package>/: {packages - folders}"
    assert folders - packages <= {"api", "benchmarks", "support"}, folders - packages
    for d in packages | {"api"}:
        assert any(f.startswith("test_") for f in os.listdir(os.path.join(tests, d))), d
    loose = {f for f in os.listdir(tests) if f.startswith("test_") and f.endswith(".py")}
    assert loose == REPOSITORY_TESTS, loose ^ REPOSITORY_TESTS


@pytest.mark.skipif(os.environ.get("AUTOPAR_SKIP_WHEEL") == "1", reason="AUTOPAR_SKIP_WHEEL=1")
def test_the_wheel_installs_only_autopar(tmp_path):
    """What `pip install .` installs: the wheel's top-level names are `autopar` and its
    metadata (the reference models live in autopar.models, not a top-level `models`), and a
    fresh venv it is installed into gains the package `autopar` alone."""
    run = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w",
                          str(tmp_path), ROOT], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    (wheel,) = [f for f in os.listdir(tmp_path) if f.endswith(".whl")]
    with zipfile.ZipFile(tmp_path / wheel) as z:
        top = {n.split("/")[0] for n in z.namelist()}
        assert "autopar/models/gpt.py" in z.namelist()
    assert {t for t in top if not t.endswith(".dist-info")} == {"autopar"}, top
    # ... and installed into a fresh venv (without dependencies: nothing else is fetched),
    # `autopar` is the only package it adds.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = pathlib.Path(subprocess.run([python, "-c", code], capture_output=True, text=True,
                                       check=True).stdout.strip())
    before = set(os.listdir(site))
    run = subprocess.run([python, "-m", "pip", "install", "--no-deps", "-q",
                          str(tmp_path / wheel)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    added = {n for n in set(os.listdir(site)) - before
             if not n.endswith((".dist-info", ".pth")) and n != "__pycache__"}
    assert added == {"autopar"}, added
