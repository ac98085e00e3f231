"""The `autopar plan` command (see `autopar.cli`): import MODULE:FACTORY, call the factory and
plan what it returns with `autopar.plan` for a cluster preset.

Example:
    >>> from autopar.cli import main
    >>> main(["plan", "examples/cli_factory.py:make_step", "--preset", "dgx-a100",
    ...       "--hosts", "2", "--mesh", "2x8", "-o", "plan.json"])
    0
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import math
import os
import sys
from pathlib import Path

from autopar.core.enums import Schedule
from autopar.core.errors import InvalidArgumentError

METHODS = {"shard": "ShardParallel", "data": "DataParallel", "zero2": "Zero2Parallel",
            "zero3": "Zero3Parallel", "pipeshard": "PipeshardParallel"}
SCHEDULES = {s.value: s.name for s in Schedule}      # "1f1b", "zb-h1", "auto", ...


class UserCodeError(Exception):
    """The user's factory module failed to import or its factory raised (exit 3)."""


def ints(text: str, what: str, parser) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.lower().split("x"))
    except ValueError:
        parser.error(f"{what}={text!r} is not a mesh shape; write sizes joined by 'x', e.g. 2x8")
    if any(v < 1 for v in values):
        parser.error(f"{what}={text!r}: every mesh size must be >= 1")
    return values


def load_factory(target: str, parser: argparse.ArgumentParser):
    """The callable `target` ("MODULE:FACTORY") names; MODULE is a dotted module (imported with
    the current directory on the path) or a path to a .py file. A missing module, file or
    attribute is a usage error; an exception while importing is the user's (`UserCodeError`)."""
    module_name, sep, attr = target.rpartition(":")
    if not sep or not module_name or not attr:
        parser.error(f"target {target!r} must be MODULE:FACTORY, e.g. "
                     "examples/cli_factory.py:make_step or mypkg.train:make_step")
    is_path = module_name.endswith(".py") or os.sep in module_name or "/" in module_name
    try:
        if is_path:
            path = Path(module_name)
            if not path.is_file():
                parser.error(f"module file {module_name!r} does not exist (from {target!r})")
            sys.path.insert(0, str(path.resolve().parent))   # its sibling imports
            spec = importlib.util.spec_from_file_location(f"_autopar_cli_{path.stem}", path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module        # as an import would (dataclasses look there)
            spec.loader.exec_module(module)
        else:
            if os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())
            try:
                module = importlib.import_module(module_name)
            except ModuleNotFoundError as e:
                if e.name and module_name.startswith(e.name):
                    parser.error(f"no module named {e.name!r} (from {target!r}); give a dotted "
                                 "module importable from the current directory, or a .py path")
                raise
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as e:
        raise UserCodeError(f"importing {module_name!r} failed: {type(e).__name__}: {e}") from e
    factory = getattr(module, attr, None)
    if not callable(factory):
        names = sorted(n for n, v in vars(module).items()
                       if callable(v) and not n.startswith("_") and
                       getattr(v, "__module__", None) == module.__name__)
        parser.error(f"{module_name!r} has no callable {attr!r}"
                     + (f"; its functions: {', '.join(names)}" if names else ""))
    return factory


def _call_factory(factory, target: str):
    try:
        made = factory()
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as e:
        raise UserCodeError(f"{target}() raised {type(e).__name__}: {e}") from e
    if not isinstance(made, tuple) or len(made) not in (2, 3):
        raise InvalidArgumentError(
            f"{target}() returned {type(made).__name__}"
            + (f" of length {len(made)}" if isinstance(made, tuple) else "")
            + "; autopar plan needs (step, args) or (step, args, plan_kwargs). Fix: return e.g. "
              "(train_step, (jax.eval_shape(create_state), batch_spec)).")
    step, args, kwargs = (*made, {}) if len(made) == 2 else made
    if not callable(step):
        raise InvalidArgumentError(f"{target}()[0] is {type(step).__name__}, not the step "
                                   "function. Fix: return (step, args[, plan_kwargs]).")
    if not isinstance(args, (tuple, list)):
        raise InvalidArgumentError(
            f"{target}()[1] is {type(args).__name__}, not the tuple of the step's arguments. "
            "Fix: return (step, (state, batch)[, plan_kwargs]).")
    import autopar
    allowed = {n for n, p in inspect.signature(autopar.plan).parameters.items()
               if p.kind == p.KEYWORD_ONLY and n != "cluster"}
    if not isinstance(kwargs, dict) or set(kwargs) - allowed:
        bad = sorted(set(kwargs) - allowed) if isinstance(kwargs, dict) else kwargs
        raise InvalidArgumentError(
            f"{target}()[2] has {bad!r}, which autopar.plan does not take. Fix: pass a dict "
            f"with some of {sorted(allowed)} (the cluster comes from --preset/--hosts).")
    return step, tuple(args), dict(kwargs)


def _method(ns, parser, factory_method):
    """The method the flags ask for; the factory's `plan_kwargs["method"]` when no method flag
    is given (None: autopar.plan's default, ShardParallel)."""
    import autopar
    flags = (ns.microbatches, ns.stages, ns.layers, ns.schedule)
    if ns.method is None and all(v is None for v in flags):
        return factory_method
    name = ns.method or "shard"
    pipe = name == "pipeshard"
    for flag, value in (("--stages", ns.stages), ("--layers", ns.layers),
                        ("--schedule", ns.schedule)):
        if value is not None and not pipe:
            parser.error(f"{flag} applies to --method pipeshard, not --method {name}")
    for flag, value in (("--microbatches", ns.microbatches), ("--stages", ns.stages),
                        ("--layers", ns.layers)):
        if value is not None and value < 1:
            parser.error(f"{flag}={value} must be >= 1")
    kw = {} if ns.microbatches is None else {"num_microbatches": ns.microbatches}
    if pipe:
        if ns.layers is not None:
            kw["layer_option"] = autopar.AutoLayerOption(num_layers=ns.layers)
        if ns.stages is not None:
            kw["stage_option"] = autopar.UniformStageOption(num_stages=ns.stages)
        if ns.schedule is not None:
            kw["schedule"] = getattr(autopar.Schedule, SCHEDULES[ns.schedule])
    return getattr(autopar, METHODS[name])(**kw)


def cmd_plan(ns, parser) -> int:
    import autopar
    presets = autopar.ClusterSpec.preset_names()
    if ns.preset not in presets:
        parser.error(f"unknown --preset {ns.preset!r}; the presets are: {', '.join(presets)}")
    if ns.hosts < 1:
        parser.error(f"--hosts={ns.hosts} must be >= 1")
    cluster = autopar.ClusterSpec.preset(ns.preset, num_hosts=ns.hosts)
    mesh = None
    if ns.mesh is not None:
        mesh = ints(ns.mesh, "--mesh", parser)
        if math.prod(mesh) != cluster.num_devices:
            parser.error(f"--mesh {ns.mesh} has {math.prod(mesh)} devices, but --preset "
                         f"{ns.preset} with --hosts {ns.hosts} has {cluster.num_devices} "
                         f"({ns.hosts} host(s) x {cluster.devices_per_host} devices per host)")
    names = None
    if ns.axis_names is not None:
        names = tuple(n.strip() for n in ns.axis_names.split(","))
        dims = len(mesh) if mesh else 2
        if len(names) != dims or not all(names) or len(set(names)) != len(names):
            parser.error(f"--axis-names {ns.axis_names!r} must be {dims} distinct names, one "
                         f"per mesh dimension ({ns.mesh or 'hosts x devices per host'})")
    step, args, kwargs = _call_factory(load_factory(ns.target, parser), ns.target)
    method = _method(ns, parser, kwargs.get("method"))
    kwargs.update({k: v for k, v in (("method", method), ("mesh_shape", mesh),
                                     ("axis_names", names)) if v is not None})
    plan = autopar.plan(step, *args, cluster=cluster, verbose=ns.verbose or None, **kwargs)
    Path(ns.output).write_text(plan.to_json())
    print(autopar.summary(plan))
    print(f"wrote {ns.output}")
    return 0
