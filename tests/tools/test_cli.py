"""The `autopar` command line (autopar/cli.py), run in-process through `autopar.cli.main` (plus
a few subprocess runs of `python -m autopar` and of the console entry point): every
subcommand and its --help, bad flags and values (exit 2 with the message), autopar errors
(exit 1, no traceback), the user's factory failing (exit 3), a plan + dump round trip on
examples/cli_factory.py, the plan cache listing on a temporary directory, a small profile, and
`launch` (its parser, and one real 1-process run whose Gloo chatter is hidden)."""
import logging
import math
import os
import subprocess
import sys
import tomllib

import pytest

import autopar
from autopar import cli
from autopar.core.plan import ParallelPlan
from autopar.cost.profiler import DeviceProfile
from autopar.tools.plan_cache import PlanCache
from support import REPO

ROOT = REPO
FACTORY = os.path.join(ROOT, "examples", "cli_factory.py") + ":make_step"
PLAN_ARGS = [FACTORY, "--preset", "dgx-a100", "--hosts", "2", "--mesh", "2x8",
             "--axis-names", "data,model"]


def run(capsys, *argv):
    """(exit status, stdout, stderr) of `autopar ARGV`."""
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(autouse=True)
def _quiet_autopar_logger(monkeypatch):
    """--verbose sets the autopar logger's level: undo it after a test."""
    logger = logging.getLogger("autopar")
    level, handlers = logger.level, list(logger.handlers)
    monkeypatch.delenv("AUTOPAR_VERBOSE", raising=False)
    monkeypatch.setenv("COLUMNS", "200")         # help text unwrapped
    yield
    logger.setLevel(level)
    logger.handlers[:] = handlers


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "plan.json"
    assert cli.main(["plan", *PLAN_ARGS, "-o", str(path)]) == 0
    return path


# -- help, version, usage errors -------------------------------------------------------------

def test_help_lists_commands_and_exit_codes(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == 0
    for name in ("plan", "dump", "cache", "profile", "launch", "Exit codes:", "130"):
        assert name in out


@pytest.mark.parametrize("argv,shown", [
    (["plan"], ["MODULE:FACTORY", "--preset", "dgx-a100", "--mesh", "else shard)",
                "(default: plan.json)"]),
    (["dump"], ["--format", "markdown", "html", "--stage", "--full", "(default: text)"]),
    (["cache"], ["ls", "info", "clear"]),
    (["cache", "ls"], ["--dir"]),
    (["profile"], ["--mesh", "--sizes", "(default: 5)", "(default: profile.json)"]),
    (["launch"], ["--num-processes", "--devices-per-process", "(default: 4)", "script"]),
])
def test_every_command_has_help_with_defaults(capsys, argv, shown):
    code, out, _ = run(capsys, *argv, "--help")
    assert code == 0
    assert out.startswith(f"usage: autopar {' '.join(argv)}")
    for text in shown:
        assert text in out, text


def test_version_names_autopar_and_jax(capsys):
    import jax
    code, out, _ = run(capsys, "--version")
    assert code == 0
    assert "autopar 0.1.0" in out and f"jax {jax.__version__}" in out


@pytest.mark.parametrize("argv,message", [
    (["--bogus", "cache", "ls"], "unrecognized arguments: --bogus"),
    (["plan", FACTORY, "--preset", "cpu", "--bogus"], "unrecognized arguments: --bogus"),
    (["plan", FACTORY], "the following arguments are required: --preset"),
    (["plan", FACTORY, "--preset", "cpu", "--method", "fsdp"], "invalid choice: 'fsdp'"),
    (["dump", "p.json", "--format", "pdf"], "invalid choice: 'pdf'"),
    (["cache"], "required: ACTION"),
    (["nosuch"], "invalid choice: 'nosuch'"),
])
def test_bad_flags_exit_2_with_the_message(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert message in err and "usage: autopar" in err


@pytest.mark.parametrize("extra,message", [
    (["--preset", "dgx-a101"], "unknown --preset 'dgx-a101'; the presets are: "
                               "v100-p3.16xlarge, dgx-a100"),
    (["--preset", "cpu", "--mesh", "3x3"], "--mesh 3x3 has 9 devices, but --preset cpu with "
                                           "--hosts 1 has 8"),
    (["--preset", "dgx-a100", "--hosts", "2", "--mesh", "4x8"], "has 32 devices, but --preset "
                                                                "dgx-a100 with --hosts 2 has 16"),
    (["--preset", "cpu", "--mesh", "2xfour"], "is not a mesh shape"),
    (["--preset", "cpu", "--hosts", "0"], "--hosts=0 must be >= 1"),
    (["--preset", "cpu", "--axis-names", "a,b,c"], "must be 2 distinct names"),
    (["--preset", "cpu", "--stages", "2"], "--stages applies to --method pipeshard"),
    (["--preset", "cpu", "--microbatches", "0"], "--microbatches=0 must be >= 1"),
])
def test_bad_plan_values_are_parser_errors(capsys, extra, message):
    code, _, err = run(capsys, "plan", FACTORY, *extra)
    assert code == 2
    assert message in err


@pytest.mark.parametrize("target,message", [
    ("no_colon", "must be MODULE:FACTORY"),
    ("missing_file.py:f", "module file 'missing_file.py' does not exist"),
    ("no_such_module_xyz:f", "no module named 'no_such_module_xyz'"),
    (FACTORY.replace("make_step", "nope"), "has no callable 'nope'; its functions: MLP, "
                                           "create_state, make_step"),
])
def test_bad_targets_are_parser_errors(capsys, target, message):
    code, _, err = run(capsys, "plan", target, "--preset", "cpu")
    assert code == 2
    assert message in err


# -- plan ------------------------------------------------------------------------------------

def test_plan_writes_the_plan_and_prints_the_summary(plan_file, capsys, tmp_path):
    code, out, err = run(capsys, "plan", *PLAN_ARGS, "-o", str(tmp_path / "p.json"))
    assert code == 0, err
    assert out.splitlines()[0].startswith("shard_parallel on data=2 x model=8 (16 devices")
    assert f"wrote {tmp_path / 'p.json'}" in out
    plan = ParallelPlan.from_json(plan_file.read_text())
    assert plan.mesh_shape == (2, 8) and plan.axis_names == ("data", "model")
    assert plan.cluster == "dgx-a100" and plan.searched_at
    # the same plan as autopar.plan on the factory's arguments (timings aside)
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        import cli_factory
    finally:
        sys.path.pop(0)
    step, args, kw = cli_factory.make_step()
    direct = autopar.plan(step, *args, cluster=autopar.ClusterSpec.preset("dgx-a100",
                                                                           num_hosts=2),
                          mesh_shape=(2, 8), axis_names=("data", "model"), **kw)
    assert [t.spec for t in plan.inputs] == [t.spec for t in direct.inputs]
    assert plan.graph_fingerprint == direct.graph_fingerprint
    assert plan.predicted_step_s == pytest.approx(direct.predicted_step_s)


def test_plan_from_a_dotted_module_with_a_two_tuple(capsys, tmp_path, monkeypatch):
    (tmp_path / "my_steps.py").write_text(
        "import jax, jax.numpy as jnp\n"
        "def step(w, x):\n    return jnp.tanh(x @ w).sum()\n"
        "def make():\n    return step, (jax.ShapeDtypeStruct((64, 32), jnp.float32),\n"
        "                        jax.ShapeDtypeStruct((128, 64), jnp.float32))\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "my_steps", raising=False)
    code, out, err = run(capsys, "plan", "my_steps:make", "--preset", "cpu", "--method", "data",
                         "-o", "out.json")
    assert code == 0, err
    plan = ParallelPlan.from_json((tmp_path / "out.json").read_text())
    assert plan.method == "data_parallel" and plan.mesh_shape == (1, 8)
    batch_axes = plan.inputs[1].spec[0]            # the default batch_argnums=(1,) is split
    assert math.prod(plan.mesh_shape[a] for a in batch_axes) == 8


def test_pipeshard_plan_and_stage_range(capsys, tmp_path):
    path = tmp_path / "pipe.json"
    code, out, err = run(capsys, "plan", FACTORY, "--preset", "cpu", "--method", "pipeshard",
                         "--microbatches", "4", "--stages", "2", "--schedule", "gpipe",
                         "-o", str(path))
    assert code == 0, err
    assert "2-stage pipeline" in out
    plan = ParallelPlan.from_json(path.read_text())
    assert len(plan.stages) == 2 and plan.pipeline["schedule"] == "gpipe"
    code, _, err = run(capsys, "dump", str(path), "--stage", "2")
    assert code == 2
    assert "--stage 2 is out of range" in err and "has 2 stages (0..1)" in err
    code, out, err = run(capsys, "dump", str(path), "--stage", "1")
    assert code == 0, err
    assert out.strip()


def test_autopar_errors_exit_1_without_traceback(capsys):
    code, out, err = run(capsys, "plan", FACTORY, "--preset", "cpu", "--microbatches", "3")
    assert code == 1
    assert err.startswith("autopar plan: error: num_microbatches=3") and "Fix:" in err
    assert "Traceback" not in err


def test_verbose_logs_info_and_shows_tracebacks(capsys, caplog, tmp_path):
    caplog.set_level(logging.INFO, logger="autopar")
    code, _, err = run(capsys, "--verbose", "plan", FACTORY, "--preset", "cpu", "-o",
                       str(tmp_path / "p.json"))
    assert code == 0, err
    assert "AUTOPAR_VERBOSE" not in os.environ        # no process-wide side effect
    assert logging.getLogger("autopar").getEffectiveLevel() == logging.INFO
    assert any("autopar: traced" in r.getMessage() for r in caplog.records)
    assert any(r.name == "autopar.core.progress" and getattr(r, "autopar_phase", "") == "trace"
               for r in caplog.records)                 # progress, through autopar.plan
    code, _, err = run(capsys, "plan", FACTORY, "--preset", "cpu", "--microbatches", "3",
                       "--verbose")                      # after the subcommand too
    assert code == 1 and "Traceback" in err


@pytest.mark.parametrize("body,code,message", [
    ("raise RuntimeError('boom')", 3, "make() raised RuntimeError: boom"),
    ("return 42", 1, "make() returned int; autopar plan needs (step, args)"),
    ("return (print, (1,), {'mesh': 1})", 1, "has ['mesh'], which autopar.plan does not take"),
    ("return (print, 1)", 1, "make()[1] is int, not the tuple of the step's arguments"),
])
def test_factory_mistakes(capsys, tmp_path, body, code, message):
    (tmp_path / "bad.py").write_text(f"def make():\n    {body}\n")
    got, _, err = run(capsys, "plan", f"{tmp_path / 'bad.py'}:make", "--preset", "cpu")
    assert got == code
    assert message in err
    assert ("Traceback" in err) == (code == 3)     # the user's own traceback, not autopar's


def test_method_from_the_factory_unless_a_flag_sets_one(capsys, tmp_path):
    (tmp_path / "zero.py").write_text(
        "import autopar\n"
        "from cli_factory import make_step\n"           # a sibling import of the examples
        "def make():\n"
        "    step, args, kw = make_step()\n"
        "    return step, args, {**kw, 'method': autopar.Zero3Parallel()}\n")
    (tmp_path / "cli_factory.py").write_text(open(FACTORY.split(":")[0]).read())
    target = f"{tmp_path / 'zero.py'}:make"
    code, out, err = run(capsys, "plan", target, "--preset", "cpu", "-o", str(tmp_path / "a"))
    assert code == 0, err
    assert out.startswith("zero3 on ")
    code, out, err = run(capsys, "plan", target, "--preset", "cpu", "--microbatches", "2",
                         "-o", str(tmp_path / "b"))
    assert code == 0, err
    assert out.startswith("shard_parallel on ")


def test_import_error_in_the_module_exits_3(capsys, tmp_path):
    (tmp_path / "broken.py").write_text("import no_such_package_xyz\n")
    code, _, err = run(capsys, "plan", f"{tmp_path / 'broken.py'}:make", "--preset", "cpu")
    assert code == 3
    assert "importing" in err and "no_such_package_xyz" in err


# -- dump ------------------------------------------------------------------------------------

def test_dump_text_names_the_mesh(plan_file, capsys):
    code, out, err = run(capsys, "dump", str(plan_file))
    assert code == 0, err
    assert "mesh: data=2 x model=8" in out and "method=shard_parallel" in out


def test_dump_json_round_trips_and_writes_files(plan_file, capsys, tmp_path):
    code, out, _ = run(capsys, "dump", str(plan_file), "--format", "json")
    assert code == 0
    assert ParallelPlan.from_json(out) == ParallelPlan.from_json(plan_file.read_text())
    target = tmp_path / "dump.txt"
    code, out, _ = run(capsys, "dump", str(plan_file), "-o", str(target))
    assert code == 0 and out.strip() == f"wrote {target}"
    assert "mesh: data=2 x model=8" in target.read_text()


@pytest.mark.parametrize("flag", [["--stage", "0"], ["--full"]])
def test_dump_flags_that_need_text(plan_file, capsys, flag):
    code, _, err = run(capsys, "dump", str(plan_file), "--format", "json", *flag)
    assert code == 2
    assert f"{flag[0]} applies to --format text or markdown, not json" in err


def test_dump_markdown_and_full(plan_file, capsys):
    code, md, err = run(capsys, "dump", str(plan_file), "--format", "markdown")
    assert code == 0, err
    assert "|" in md and "data=2" in md
    code, full, _ = run(capsys, "dump", str(plan_file), "--full")
    code2, short, _ = run(capsys, "dump", str(plan_file))
    assert code == code2 == 0 and len(full.splitlines()) > len(short.splitlines())


def test_dump_html(plan_file, capsys, tmp_path):
    target = tmp_path / "plan.html"
    code, out, err = run(capsys, "dump", str(plan_file), "--format", "html", "-o", str(target))
    assert code == 0, err
    html = target.read_text()
    assert "<html" in html.lower() and "data" in html


@pytest.mark.parametrize("content,reason", [
    ('{"version": 1, "method": ', "does not load"),
    ('[1, 2]', "does not load"),
    ('{"version": 1}', "does not load"),
    (None, "cannot read plan file"),
])
def test_dump_of_a_bad_file_exits_1_naming_it(capsys, tmp_path, content, reason):
    path = tmp_path / "bad.json"
    if content is not None:
        path.write_text(content)
    code, _, err = run(capsys, "dump", str(path))
    assert code == 1
    assert repr(str(path)) in err and reason in err and "Traceback" not in err


# -- cache -----------------------------------------------------------------------------------

def test_cache_ls_info_clear(plan_file, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_PLAN_CACHE", str(tmp_path))
    plan = ParallelPlan.from_json(plan_file.read_text())
    PlanCache(tmp_path).put("a" * 64, plan)
    (tmp_path / ("plan-" + "b" * 64 + ".json")).write_text("{truncated")
    (tmp_path / "unrelated.txt").write_text("keep me")
    code, out, _ = run(capsys, "cache", "ls")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["key", "size", "written", "method", "mesh", "searched", "at",
                                "status"]
    good = next(line for line in lines if line.startswith("a" * 12 + " "))
    assert "shard_parallel" in good and "data=2 x model=8" in good
    assert plan.searched_at in good and good.endswith("ok")
    bad = next(line for line in lines if line.startswith("b" * 12 + " "))
    assert "not valid JSON" in bad
    assert lines[-1] == f"2 entries in {tmp_path}"
    code, out, _ = run(capsys, "cache", "info")
    assert code == 0
    assert f"directory: {tmp_path}" in out
    assert "entries: 2 (1 usable by this autopar, 1 stale or bad)" in out
    assert "this autopar: autopar 0.1.0" in out and "written by: autopar 0.1.0" in out
    code, out, _ = run(capsys, "cache", "clear")
    assert code == 0 and out.strip() == f"removed 2 file(s) from {tmp_path}"
    assert (tmp_path / "unrelated.txt").exists()
    code, out, _ = run(capsys, "cache", "ls", "--dir", str(tmp_path))
    assert out.strip() == f"no plans cached in {tmp_path}"


def test_cache_off_still_lists_the_default_directory(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_PLAN_CACHE", "off")
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path))
    code, out, _ = run(capsys, "cache", "ls")
    assert code == 0
    assert out.strip() == (f"no plans cached in {tmp_path} (AUTOPAR_PLAN_CACHE=off: "
                           "parallelize does not use it now)")


# -- profile ---------------------------------------------------------------------------------

def test_profile_writes_a_device_profile(capsys, tmp_path):
    out_file = tmp_path / "prof.json"
    code, out, err = run(capsys, "profile", "--mesh", "2x4", "--sizes", "4096,8192",
                         "--dtypes", "float32", "--matmul-size", "32", "--memory-size", "4096",
                         "--repeats", "1", "--no-cache", "-o", str(out_file))
    assert code == 0, err
    prof = DeviceProfile.load(str(out_file))
    assert prof.mesh_shape == (2, 4) and set(prof.matmul_flops_per_s) == {"float32"}
    assert [a.name for a in prof.axes] == ["data", "model"]
    assert "mesh data=2 x model=4" in out and "axis model (4): alpha" in out
    assert f"wrote {out_file}" in out


@pytest.mark.parametrize("argv,message", [
    (["--mesh", "3x3"], "--mesh 3x3 has 9 devices; this machine has 8"),
    (["--sizes", "4096"], "needs 2 or more positive byte counts"),
    (["--sizes", "4096,big"], "needs 2 or more positive byte counts"),
    (["--dtypes", "float32,float99"], "'float99' is not a dtype name"),
    (["--repeats", "0"], "--repeats=0 must be >= 1"),
    (["--axis-names", "a,a"], "must be 1 distinct names"),
])
def test_profile_bad_values(capsys, argv, message):
    code, _, err = run(capsys, "profile", *argv)
    assert code == 2
    assert message in err


# -- launch ----------------------------------------------------------------------------------

def test_chatter_filter_on_sample_lines():
    from autopar.runtime.launch import is_chatter
    assert is_chatter("[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of "
                      "connected peer ranks is : 1\n")
    assert is_chatter("[Gloo] Rank 13 is connected to 15 peer ranks. Expected number of "
                      "connected peer ranks is : 15")
    for line in ("[host 0/2] step 0  loss 7.486211", "WARNING:absl:Given directory is read "
                 "only=/tmp/x", "Traceback (most recent call last):",
                 "RuntimeError: Gloo connection refused", "a [Gloo] Rank 0 is connected"):
        assert not is_chatter(line), line


def test_pump_hides_and_counts_chatter():
    import io

    from autopar.runtime.launch import _pump
    data = (b"[Gloo] Rank 1 is connected to 1 peer ranks. Expected number of connected peer "
            b"ranks is : 1\nloss 1.0\n")
    out, hidden = io.StringIO(), []
    _pump(io.BytesIO(data), "[process 0] ", out, hidden)
    assert out.getvalue() == "[process 0] loss 1.0\n" and len(hidden) == 1
    out = io.StringIO()
    _pump(io.BytesIO(data), "[process 1] ", out, None)           # --verbose
    assert out.getvalue().count("[process 1] ") == 2 and "[Gloo]" in out.getvalue()


@pytest.mark.parametrize("argv,message", [
    (["--num-processes", "0", "x.py"], "--num-processes=0 must be >= 1"),
    (["--num-processes", "2", "--devices-per-process", "0", "x.py"],
     "--devices-per-process=0 must be >= 1"),
    (["--num-processes", "2", "--timeout", "-1", "x.py"], "--timeout=-1.0 must be a positive"),
    (["--num-processes", "2", "no_such_script.py"], "script 'no_such_script.py' does not exist"),
    (["x.py"], "required: --num-processes"),
])
def test_launch_bad_values(capsys, argv, message):
    code, _, err = run(capsys, "launch", *argv)
    assert code == 2
    assert message in err


def test_launch_runs_the_script_and_hides_chatter(capsys, tmp_path, monkeypatch):
    script = tmp_path / "hello.py"
    script.write_text(
        "import sys, jax\n"
        "print('[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer "
        "ranks is : 1')\n"
        "print('hello from', jax.process_index(), 'of', jax.process_count(), sys.argv[1:])\n")
    monkeypatch.setenv("PYTHONPATH", ROOT)
    code, out, _ = run(capsys, "launch", "--num-processes", "1", "--devices-per-process", "1",
                       "--timeout", "120", str(script), "--flag", "x")
    assert code == 0, out
    assert "[process 0] hello from 0 of 1 ['--flag', 'x']" in out
    assert "[Gloo]" not in out
    assert ("autopar launch: all 1 processes finished (1 Gloo connection lines hidden; "
            "--verbose shows them)") in out


def test_python_m_autopar_launch_keeps_its_parser(capsys):
    from autopar.runtime import launch
    with pytest.raises(SystemExit) as e:
        launch.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m autopar launch") and "--verbose" in out
    with pytest.raises(SystemExit) as e:
        launch.main(["--num-processes", "0", "x.py"])
    assert e.value.code == 2


# -- the real entry points --------------------------------------------------------------------

def _subprocess(*argv):
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, *argv], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_python_m_autopar_help():
    r = _subprocess("-m", "autopar", "--help")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: autopar") and "Exit codes:" in r.stdout


def test_console_script_entry_point():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        target = tomllib.load(f)["project"]["scripts"]["autopar"]
    module, func = target.split(":")
    assert (module, func) == ("autopar.cli", "main")
    r = _subprocess("-c", f"import sys; from {module} import {func}; sys.exit({func}())",
                    "dump", "--format", "pdf", "x.json")
    assert r.returncode == 2 and "invalid choice: 'pdf'" in r.stderr


def test_an_unwritable_output_is_an_error_not_a_crash(plan_file, capsys, tmp_path):
    code, _, err = run(capsys, "dump", str(plan_file), "-o", str(tmp_path / "no" / "x.txt"))
    assert code == 1 and "No such file or directory" in err and "Fix:" in err
    assert "internal error" not in err
