"""The `autopar` command line (`python -m autopar ...`, or the `autopar` console script).

    autopar plan examples/cli_factory.py:make_step --preset dgx-a100 --hosts 2 -o plan.json
    autopar dump plan.json --format markdown
    autopar dump plan.json --format html -o plan.html
    autopar cache ls
    autopar profile --mesh 2x4 -o profile.json
    autopar launch --num-processes 2 --devices-per-process 4 examples/multihost_gpt.py

`plan` imports MODULE (a dotted module name, or a path to a .py file), calls FACTORY() and plans
what it returns, `(step, args)` or `(step, args, plan_kwargs)`, with `autopar.plan` for a cluster
preset (no devices needed; the arguments may be `jax.ShapeDtypeStruct`s). `--verbose` (before
or after the subcommand) turns on the `autopar` logger's INFO lines and tracebacks.

Exit codes:
    0    success
    1    autopar error: an infeasible plan, a plan file that does not load, ... (the message is
         printed; the traceback too with --verbose)
    2    usage error: a bad flag or value (argparse)
    3    the factory module failed to import, or FACTORY() raised (its traceback is printed)
    4    internal error in autopar (traceback printed; please report it)
    130  interrupted (Ctrl-C)
    launch exits with the status of the process that failed first (128 + N: killed by signal N)
"""
from __future__ import annotations

import argparse
import datetime
import logging
import math
import os
import sys
import traceback
from pathlib import Path

from autopar.cli_plan import METHODS, SCHEDULES, UserCodeError, cmd_plan, ints, load_factory
from autopar.core._format import mesh_text
from autopar.core.errors import AutoparError, InvalidArgumentError

log = logging.getLogger(__name__)

EXIT_OK, EXIT_AUTOPAR, EXIT_USAGE, EXIT_USER_CODE, EXIT_INTERNAL, EXIT_INTERRUPTED = \
    0, 1, 2, 3, 4, 130
_EXIT_TABLE = __doc__[__doc__.index("Exit codes:"):].rstrip()


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown (unless None / False, or the help text already says it), descriptions
    and epilogs kept as written."""

    def _get_help_string(self, action):
        if action.default in (None, False) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


# -- dump ----------------------------------------------------------------------------------

def load_plan(path: str):
    """The plan in `path`; a file that cannot be read or is not a plan raises
    `InvalidArgumentError` naming the file and the reason (exit 1)."""
    from autopar.core.plan import ParallelPlan
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidArgumentError(f"cannot read plan file {path!r}: {e}") from None
    try:
        return ParallelPlan.from_json(text)
    except AutoparError as e:       # InvalidArgumentError, PlanMismatchError: name the file
        try:
            named = type(e)(f"plan file {path!r} does not load: {e}")
        except TypeError:           # a subclass with other constructor arguments
            raise e from None
        raise named from None
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise InvalidArgumentError(
            f"plan file {path!r} does not load: {type(e).__name__}: {e}. Fix: point at a file "
            "written by `autopar plan -o` or `ParallelPlan.to_json()`.") from None


def _render_text(plan, ns) -> str:
    from autopar.tools.dump import dump
    return dump(plan, style=ns.format, full=ns.full, stage=ns.stage)


def cmd_dump(ns, parser) -> int:
    if ns.stage is not None and ns.format not in ("text", "markdown"):
        parser.error(f"--stage applies to --format text or markdown, not {ns.format}")
    if ns.full and ns.format not in ("text", "markdown"):
        parser.error(f"--full applies to --format text or markdown, not {ns.format}")
    plan = load_plan(ns.plan)
    if ns.stage is not None and not 0 <= ns.stage < len(plan.stages):
        n = len(plan.stages)
        parser.error(f"--stage {ns.stage} is out of range: {ns.plan} has {n} stage"
                     + (f"s (0..{n - 1})" if n != 1 else " (0)"))
    if ns.format == "json":
        text = plan.to_json()
    elif ns.format == "html":
        from autopar.tools.report import report
        text = report(plan)
    else:
        text = _render_text(plan, ns)
    if ns.output:
        Path(ns.output).write_text(text if text.endswith("\n") else text + "\n")
        print(f"wrote {ns.output}")
    else:
        print(text)
    return EXIT_OK


# -- cache, profile, launch -------------------------------------------------------------------

def _cache(ns):
    from autopar.tools.plan_cache import PlanCache, env_setting
    if ns.dir:
        return PlanCache(ns.dir), ""
    env, off = env_setting()
    if off:
        return PlanCache(), f" (AUTOPAR_PLAN_CACHE={env}: parallelize does not use it now)"
    return PlanCache(env or None), ""


def cmd_cache(ns, parser) -> int:
    from autopar.core._format import format_bytes
    from autopar.tools.plan_cache import library_versions
    cache, note = _cache(ns)
    if ns.action == "clear":
        print(f"removed {cache.clear()} file(s) from {cache.directory}{note}")
        return EXIT_OK
    entries = cache.describe()
    if ns.action == "info":
        usable = [e for e in entries if not e.problem]
        found = sorted({", ".join(f"{k} {v}" for k, v in e.versions if k != "autopar_source")
                        for e in entries if e.versions})
        print(f"directory: {cache.directory}{note}")
        print(f"entries: {len(entries)} ({len(usable)} usable by this autopar, "
              f"{len(entries) - len(usable)} stale or bad), "
              f"{format_bytes(sum(e.size_bytes for e in entries))}")
        print("this autopar: " + ", ".join(f"{k} {v}" for k, v in library_versions().items()))
        for text in found:
            print(f"written by: {text}")
    elif not entries:
        print(f"no plans cached in {cache.directory}{note}")
    else:
        rows = [("key", "size", "written", "method", "mesh", "searched at", "status")]
        for e in entries:
            when = datetime.datetime.fromtimestamp(e.modified).strftime("%Y-%m-%d %H:%M")
            rows.append((e.key[:12], format_bytes(e.size_bytes), when, e.method or "?",
                         e.mesh or "?", e.searched_at or "-", e.problem or "ok"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
        for r in rows:
            print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])
        print(f"{len(entries)} entr{'y' if len(entries) == 1 else 'ies'} in "
              f"{cache.directory}{note}")
    return EXIT_OK


def cmd_profile(ns, parser) -> int:
    import jax
    import jax.numpy as jnp

    import autopar
    from autopar.core._format import format_bytes, format_time
    try:
        sizes = tuple(int(v) for v in ns.sizes.split(","))
    except ValueError:
        sizes = ()
    if len(sizes) < 2 or min(sizes) < 1:
        parser.error(f"--sizes={ns.sizes!r} needs 2 or more positive byte counts, comma-"
                     "separated (a line needs 2 points)")
    dtypes = tuple(d.strip() for d in ns.dtypes.split(","))
    for d in dtypes:
        try:
            jnp.dtype(d)
        except TypeError:
            parser.error(f"--dtypes: {d!r} is not a dtype name (e.g. float32,bfloat16)")
    for flag in ("repeats", "matmul_size", "memory_size"):
        value = getattr(ns, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag.replace('_', '-')}={value} must be >= 1")
    devices = jax.devices()
    hosts = jax.process_count()
    shape = (ints(ns.mesh, "--mesh", parser) if ns.mesh else
             (hosts, len(devices) // hosts) if hosts > 1 else (len(devices),))
    if math.prod(shape) != len(devices):
        parser.error(f"--mesh {ns.mesh} has {math.prod(shape)} devices; this machine has "
                     f"{len(devices)} (CPU: set XLA_FLAGS=--xla_force_host_platform_device_"
                     "count=N for more)")
    names = (tuple(n.strip() for n in ns.axis_names.split(",")) if ns.axis_names else
             ("data", "model", "z", "w")[:len(shape)])
    if len(names) != len(shape) or len(set(names)) != len(names):
        parser.error(f"--axis-names {ns.axis_names!r} must be {len(shape)} distinct names")
    mesh = jax.make_mesh(shape, names)
    prof = autopar.profile(mesh, sizes=sizes, dtypes=dtypes, matmul_size=ns.matmul_size,
                           memory_size=ns.memory_size, repeats=ns.repeats,
                           cache_dir=ns.cache_dir, refresh=ns.refresh,
                           use_cache=not ns.no_cache)
    prof.save(ns.output)
    print(f"{prof.device_kind} ({prof.platform}), mesh "
          + mesh_text([a.name for a in prof.axes], [a.size for a in prof.axes])
          + f", {prof.num_hosts} host(s)")
    print("matmul: " + ", ".join(f"{d} {v / 1e9:.1f} GFLOP/s"
                                 for d, v in prof.matmul_flops_per_s.items())
          + f"; memory {format_bytes(prof.memory_bytes_per_s)}/s; call overhead "
          f"{format_time(prof.call_overhead_s)}")
    for a in prof.axes:
        if a.size > 1:
            print(f"axis {a.name} ({a.size}): alpha {format_time(a.alpha_s)}, bandwidth "
                  f"{format_bytes(1 / a.beta_s_per_byte)}/s")
    print(f"wrote {ns.output}")
    return EXIT_OK


def cmd_launch(ns, parser) -> int:
    from autopar.runtime import launch
    return launch.run(ns, parser, verbose=ns.verbose)


# -- the parser ----------------------------------------------------------------------------

def _version() -> str:
    from autopar.tools.plan_cache import library_versions
    v = library_versions()
    return f"autopar {v['autopar']} (source {v['autopar_source']}), jax {v['jax']}, " \
           f"jaxlib {v['jaxlib']}"


def build_parser() -> argparse.ArgumentParser:
    """The `autopar` parser: one subparser per command, each with its handler in `func`."""
    parser = argparse.ArgumentParser(
        prog="autopar", formatter_class=_Formatter, epilog=_EXIT_TABLE,
        description="Plan, inspect and run autopar parallelizations from the shell.")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log the autopar logger's INFO lines (progress); show tracebacks")
    parser.add_argument("--version", action="version", version=_version())
    # each subcommand takes --verbose too; SUPPRESS keeps the top-level value when it is absent
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                        help="same as autopar --verbose")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def command(name, func, help_, description=None, parents=(common,)):
        p = sub.add_parser(name, help=help_, description=description or help_,
                           formatter_class=_Formatter, epilog=_EXIT_TABLE, parents=parents)
        p.set_defaults(func=func, parser=p)
        return p

    p = command("plan", cmd_plan, "plan a step for a cluster preset; write the plan JSON",
                "Import MODULE, call FACTORY() -> (step, args) or (step, args, plan_kwargs), "
                "plan it with autopar.plan for --preset x --hosts (no devices needed), print "
                "autopar.summary(plan) and write the plan JSON.\n\nExample:\n  autopar plan "
                "examples/cli_factory.py:make_step --preset dgx-a100 --hosts 2 --mesh 2x8")
    p.add_argument("target", metavar="MODULE:FACTORY",
                   help="a dotted module or a path to a .py file, and the factory in it")
    p.add_argument("--preset", required=True,
                   help="cluster preset: " + ", ".join(_preset_names()))
    p.add_argument("--hosts", type=int, default=1, help="number of hosts of the preset")
    p.add_argument("--mesh", default=None,
                   help="logical mesh shape, e.g. 2x8 (default: hosts x devices per host); "
                        "it must multiply to hosts x devices per host")
    p.add_argument("--axis-names", default=None,
                   help="comma-separated mesh axis names (default: data,model,...)")
    p.add_argument("--method", choices=tuple(METHODS), default=None,
                   help="parallelization method: " + ", ".join(
                       f"{k} = {v}" for k, v in METHODS.items()) + " (default: the factory's "
                        "plan_kwargs['method'], else shard)")
    p.add_argument("--microbatches", type=int, default=None,
                   help="microbatches (pipeshard: through the pipeline; otherwise gradient "
                        "accumulation); default: the method's (1)")
    p.add_argument("--stages", type=int, default=None,
                   help="pipeshard: this many equal stages (default: searched)")
    p.add_argument("--layers", type=int, default=None,
                   help="pipeshard: cut the loss into this many layers (default: the "
                        "method's, 4)")
    p.add_argument("--schedule", choices=tuple(SCHEDULES), default=None,
                   help="pipeshard: the pipeline schedule (default: 1f1b; zb-h1, zb-h2, zb-v: "
                   "zero-bubble)")
    p.add_argument("-o", "--output", default="plan.json", help="where to write the plan")

    p = command("dump", cmd_dump, "print or convert a saved plan (text, markdown, json, html)")
    p.add_argument("plan", help="a plan JSON file (autopar plan -o, ParallelPlan.to_json)")
    p.add_argument("--format", choices=("text", "markdown", "json", "html"), default="text",
                   help="text / markdown: autopar.dump; json: the plan; html: autopar.report")
    p.add_argument("--stage", type=int, default=None,
                   help="only this pipeline stage (text and markdown)")
    p.add_argument("--full", action="store_true",
                   help="every row and operator, not the concise dump (text and markdown)")
    p.add_argument("-o", "--output", default=None, help="write here instead of stdout")

    p = command("cache", cmd_cache, "list, describe or clear the on-disk plan cache",
                "The plan cache parallelize(plan_cache=True) uses: $AUTOPAR_PLAN_CACHE if it "
                "is a directory, else $AUTOPAR_CACHE_DIR, else ~/.cache/autopar/plans.")
    where = argparse.ArgumentParser(add_help=False)
    where.add_argument("--dir", default=None,
                       help="the cache directory (default: the one parallelize uses)")
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    for name, text in (("ls", "one line per entry: key, size, date, method, mesh, searched at"),
                       ("info", "the directory, entries and bytes, library versions"),
                       ("clear", "delete every entry (other files are left alone)")):
        actions.add_parser(name, help=text, description=text, parents=(common, where),
                           formatter_class=_Formatter)

    p = command("profile", cmd_profile, "measure this machine's devices; write the profile",
                "Run autopar.profile on this machine's devices (matmul flop/s, memory "
                "bandwidth, call overhead, per-axis collective alpha/beta) and write the "
                "DeviceProfile JSON (ClusterSpec.from_profile reads it).")
    p.add_argument("--mesh", default=None,
                   help="mesh shape over this machine's devices, e.g. 2x4 (default: all "
                        "devices on one axis; hosts x devices per host in a multi-host job)")
    p.add_argument("--axis-names", default=None, help="comma-separated mesh axis names")
    p.add_argument("--sizes", default="4096,32768,262144,2097152",
                   help="comma-separated collective sizes in bytes (2 or more)")
    p.add_argument("--dtypes", default="float32,bfloat16", help="matmul dtypes to measure")
    p.add_argument("--matmul-size", type=int, default=1024, help="n of the n^3 matmul")
    p.add_argument("--memory-size", type=int, default=None,
                   help="bytes per device of the bandwidth kernel (default: 16 MiB on CPU, "
                        "256 MiB on accelerators)")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per measurement")
    p.add_argument("--cache-dir", default=None,
                   help="profile cache directory (default: autopar's profile cache)")
    p.add_argument("--refresh", action="store_true", help="measure even if a profile is cached")
    p.add_argument("--no-cache", action="store_true", help="neither read nor write the cache")
    p.add_argument("-o", "--output", default="profile.json", help="where to write the profile")

    from autopar.runtime import launch
    p = command("launch", cmd_launch, "run a script as N local processes of one JAX job",
                launch.__doc__.split("\n\n")[1])
    launch.add_arguments(p)
    return parser


def _preset_names() -> tuple[str, ...]:
    from autopar.cost.cluster import ClusterSpec
    return ClusterSpec.preset_names()


def _set_verbose() -> None:
    logger = logging.getLogger("autopar")
    logger.setLevel(logging.INFO)
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)


def main(argv: list[str] | None = None) -> int:
    """Run the `autopar` command line on `argv` (default: sys.argv[1:]); returns the exit
    status (see the module docstring), including argparse's (0 for --help, 2 for bad usage).

    Example:
        >>> main(["dump", "plan.json", "--format", "markdown"])
        0
    """
    parser = build_parser()
    try:
        ns = parser.parse_args(argv)
    except SystemExit as e:
        return _status(e)
    if ns.verbose:
        _set_verbose()
    where = f"autopar {ns.command}"
    try:
        return ns.func(ns, ns.parser)
    except SystemExit as e:                   # parser.error inside a command
        return _status(e)
    except BrokenPipeError:                   # `autopar dump plan.json | head`
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return EXIT_OK
    except KeyboardInterrupt:
        print(f"{where}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except AutoparError as e:
        if ns.verbose:
            traceback.print_exc()
        print(f"{where}: error: {e}", file=sys.stderr)
        return EXIT_AUTOPAR
    except OSError as e:                      # -o into a missing directory, a full disk, ...
        if ns.verbose:
            traceback.print_exc()
        print(f"{where}: error: {e.strerror or e} ({e.filename or 'a file'}). Fix: check the "
              "path and its directory's permissions.", file=sys.stderr)
        return EXIT_AUTOPAR
    except UserCodeError as e:
        traceback.print_exception(e.__cause__)
        print(f"{where}: error in your code: {e}", file=sys.stderr)
        return EXIT_USER_CODE
    except Exception as e:                    # noqa: BLE001  (a bug: say so)
        traceback.print_exc()
        print(f"{where}: internal error ({type(e).__name__}: {e}); this is a bug in autopar, "
              "please report it with the traceback above", file=sys.stderr)
        return EXIT_INTERNAL


def _status(e: SystemExit) -> int:
    if e.code is None:
        return EXIT_OK
    return e.code if isinstance(e.code, int) else EXIT_AUTOPAR


__all__ = ["main", "build_parser", "load_factory", "load_plan"]
