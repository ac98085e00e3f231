"""8 simulated CPU devices for every test: set before JAX is imported.

XLA:CPU's code is compiled without LLVM's optimizations (`--xla_backend_optimization_level=0`)
unless AUTOPAR_TEST_XLA_OPT=default: the test models are tiny, so compiling is most of the
suite's time (a third less with it off), while what the tests check is decided before LLVM (the
HLO, its collectives, shardings and buffer assignment) or compared against jax.jit compiled the
same way. `make test-slow` and `make test-latest` compile at XLA's default level.
"""
import os
import shutil
import tempfile

_FLAGS = " --xla_force_host_platform_device_count=8"
if os.environ.get("AUTOPAR_TEST_XLA_OPT", "0") != "default":
    _FLAGS += " --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + _FLAGS).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One XLA compilation cache for the run, shared by the pytest-xdist workers (they inherit this
# process's environment): many tests compile the same programs (jax.jit's reference steps,
# the same model's plans). AUTOPAR_TEST_XLA_CACHE=off compiles everything afresh.
if os.environ.get("AUTOPAR_TEST_XLA_CACHE", "on") != "off" \
        and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="autopar-tests-xla-")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    _OWN_CACHE = os.environ["JAX_COMPILATION_CACHE_DIR"]
else:
    _OWN_CACHE = None
# Tests that exercise the on-disk plan cache pass their own directory; the rest must search.
os.environ.setdefault("AUTOPAR_PLAN_CACHE", "off")
# The rival methods' plans (autopar.runner_ups) cost a few ILPs per planned step; the suite
# prices them only in the tests of that pass (and of what shows them), which turn them on.
os.environ.setdefault("AUTOPAR_RUNNER_UPS", "off")


def pytest_unconfigure(config):
    """The run's compilation cache goes with the process that made it (the controller; a
    pytest-xdist worker inherited it)."""
    if _OWN_CACHE is not None and not hasattr(config, "workerinput"):
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


def pytest_terminal_summary(terminalreporter):
    """Count the code blocks of README.md and docs/ that ran (tests/test_docs.py records them
    per page), so the test output says how many ran and how many were skipped."""
    ran = skipped = pages = 0
    for report in terminalreporter.stats.get("passed", []):
        for name, value in getattr(report, "user_properties", ()):
            if name == "docs_blocks":
                pages += 1
                ran, skipped = ran + value[0], skipped + value[1]
    if pages:
        terminalreporter.write_line(f"code blocks of README.md and docs/: {ran} ran, "
                                    f"{skipped} skipped (marked), on {pages} pages")
