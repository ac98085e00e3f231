"""How hard are autopar's intra-op ILPs? Capture them from real planning runs, then solve each
captured problem alone and report its size, LP relaxation, optimum, time and gap.

    # 1. capture (runs the planner; every ILP it solves is pickled into DIR)
    python benchmarks/ilp_hardness.py capture demo DIR        # examples/train_gpt.py's plan
    python benchmarks/ilp_hardness.py capture bench12 DIR     # make bench's 12-layer GPT
    python benchmarks/ilp_hardness.py capture gpt-39B DIR --microbatches 64 --auto-layers 16
    # 2. measure (no JAX): solve every captured problem with the current solver
    python benchmarks/ilp_hardness.py measure DIR [--lp] [--repeat 2] [--time-limit 60]

`capture` of a pipeline configuration (a key of benchmarks/paper_configs.py) plans it on the
V100 preset with `PipeshardParallel(AutoLayerOption(num_layers=...), AutoStageOption())`; the
solver's time limit during capture is `--capture-limit` seconds (the captured problem is what
matters, not how the capture run solved it). `measure` prints one line per problem: groups,
variables, constraints and memory rows of the model the solver saw, the LP relaxation's value
(`--lp`), the objective, status, time and gap, and checks that a repeated solve returns the
same choice (determinism).
"""
from __future__ import annotations

import argparse
import glob
import os
import pickle
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def _patch_capture(out_dir: str, limit_s: float | None) -> None:
    """Pickle every problem `solve_ilp` is given (solve.py imports it by name)."""
    from autopar.intra_op import solve as solve_mod
    os.makedirs(out_dir, exist_ok=True)
    orig = solve_mod.solve_ilp
    seen: set[bytes] = set()

    def capture(problem, **kw):
        if limit_s is not None:
            kw["time_limit_s"] = min(kw.get("time_limit_s", 60.0), limit_s)
        blob = pickle.dumps(problem)
        sol = orig(problem, **kw)
        import hashlib
        h = hashlib.sha1(blob).digest()
        if h not in seen:
            seen.add(h)
            name = os.path.join(out_dir, f"p{len(seen):04d}.pkl")
            with open(name, "wb") as f:
                pickle.dump({"problem": problem, "kw": {k: v for k, v in kw.items()},
                             "captured": {"status": sol.status.value, "time_s": sol.solve_time_s,
                                          "objective": sol.objective,
                                          "message": sol.message}}, f)
            print(f"captured {name}: {sol.status.value} {sol.solve_time_s:.2f} s "
                  f"{sol.num_variables} variables; {sol.message}", flush=True)
        return sol
    solve_mod.solve_ilp = capture


def _capture_demo(bench_layers: int | None) -> None:
    import jax
    import optax
    from flax.training import train_state

    import autopar
    from models.gpt import GPT, GPTConfig, gpt_loss, make_gpt_batch
    if bench_layers is None:    # examples/train_gpt.py
        cfg, batch_size = GPTConfig(vocab_size=2048, seq_len=64, num_layers=2, hidden=256,
                                    num_heads=4), 16
    else:                        # benchmarks/run_all.py
        cfg, batch_size = GPTConfig(vocab_size=8192, seq_len=128, num_layers=bench_layers,
                                    hidden=768, num_heads=12), 8
    model = GPT(cfg)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=0.01))

    def create(key):
        params = model.init(key, jax.numpy.zeros((1, cfg.seq_len), jax.numpy.int32))
        return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    def train_step(state, batch):
        def loss_fn(params):
            return gpt_loss(state.apply_fn(params, batch["tokens"]), batch["tokens"])
        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss
    state = jax.eval_shape(create, jax.random.key(0))
    batch = jax.eval_shape(lambda: make_gpt_batch(jax.random.key(1), batch_size, cfg))
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    step = autopar.parallelize(train_step, mesh=mesh, batch_argnums=(1,), donate_argnums=(0,))
    t0 = time.perf_counter()
    plan = step.get_plan(state, batch)
    print(f"planned in {time.perf_counter() - t0:.2f} s; ILP: {plan.ilp}")


def _capture_paper(key: str, microbatches: int, auto_layers: int | None,
                   shapes: str) -> None:
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import autopar
    from paper import build, make_cluster
    from paper_configs import ALL
    cfg = ALL[key]
    step, state, spec, flops, params, rules, layers, dtype = build(cfg)
    cluster = make_cluster(cfg.gpus)
    method = autopar.PipeshardParallel(
        num_microbatches=microbatches, layer_option=autopar.AutoLayerOption(
            num_layers=auto_layers or cfg.auto_layers),
        stage_option=autopar.AutoStageOption(logical_shapes=shapes))
    t0 = time.perf_counter()
    try:
        p = autopar.plan(step, state, spec, cluster=cluster, method=method,
                         mesh_shape=(cluster.num_hosts, cluster.devices_per_host))
        print(f"planned in {time.perf_counter() - t0:.1f} s: {p.pipeline}")
    except autopar.AutoparError as e:
        print(f"no plan after {time.perf_counter() - t0:.1f} s: {type(e).__name__}: "
              f"{str(e)[:300]}")


def _lp_gap(problem) -> tuple[float, float] | None:
    """(LP relaxation value, MIP optimum) of the reduced model the solver sees (its objective
    is shifted and scaled, so compare the two with each other only), or None when presolve
    leaves nothing to solve."""
    import numpy as np

    from autopar.intra_op.ilp import _presolve
    from autopar.intra_op.mip import build_mip, solve_highs
    red = _presolve(problem)
    if not red.var_groups or red.infeasible:
        return None
    mip = build_mip(red)
    ip = solve_highs(mip, 600.0)
    mip.integer = np.zeros_like(mip.integer)
    lp = solve_highs(mip, 600.0)
    if lp.x is None or ip.x is None:
        return None
    return float(mip.cost @ lp.x), float(mip.cost @ ip.x)


def measure(args) -> None:
    from autopar.intra_op import mip
    from autopar.intra_op.ilp import SolverBackend, solve_ilp
    if args.gap is not None:
        mip.MIP_REL_GAP = args.gap
    files = sorted(f for d in args.dir for f in glob.glob(d if d.endswith(".pkl") else
                                                          os.path.join(d, "*.pkl")))
    print(f"{'file':>10} {'groups':>6} {'vars':>6} {'cons':>6} {'mem':>4} {'lp':>12} "
          f"{'objective':>12} {'status':>8} {'time s':>7} {'capt s':>7}  message")
    worst = 0.0
    for name in files:
        with open(name, "rb") as f:
            rec = pickle.load(f)
        problem = rec["problem"]
        sols = []
        for _ in range(args.repeat):
            sols.append(solve_ilp(problem, backend=SolverBackend(args.backend),
                                  time_limit_s=args.time_limit))
        sol = sols[0]
        same = all(s.choice == sol.choice for s in sols)
        lp = _lp_gap(problem) if args.lp else None
        worst = max(worst, max(s.solve_time_s for s in sols))
        print(f"{os.path.basename(name):>10} {len(problem.node_costs):>6} {sol.num_variables:>6} "
              f"{sol.num_constraints:>6} {len(problem.memory_points):>4} "
              f"{'' if lp is None else f'{lp[0]:.5g}/{lp[1]:.5g}':>12} {sol.objective:>12.6g} "
              f"{sol.status.value:>8} {max(s.solve_time_s for s in sols):>7.2f} "
              f"{rec['captured']['time_s']:>7.2f}  {'' if same else 'NOT DETERMINISTIC; '}"
              f"{sol.message[:120]}", flush=True)
    print(f"{len(files)} problems; slowest solve {worst:.2f} s")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("capture")
    c.add_argument("case", help="demo, bench<L> (make bench's L-layer GPT) or a paper key")
    c.add_argument("dir")
    c.add_argument("--microbatches", type=int, default=64)
    c.add_argument("--auto-layers", type=int, default=None)
    c.add_argument("--shapes", default="all")
    c.add_argument("--capture-limit", type=float, default=None)
    m = sub.add_parser("measure")
    m.add_argument("dir", nargs="+", help="folders of captured problems, or .pkl files")
    m.add_argument("--gap", type=float, default=None, help="the solver's relative gap")
    m.add_argument("--lp", action="store_true")
    m.add_argument("--repeat", type=int, default=2)
    m.add_argument("--time-limit", type=float, default=60.0)
    m.add_argument("--backend", default="highs")
    args = p.parse_args(argv)
    if args.cmd == "measure":
        measure(args)
        return 0
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["AUTOPAR_PLAN_CACHE"] = "off"     # plan, never replay a cached plan
    import logging
    logging.basicConfig(level=logging.WARNING)
    _patch_capture(args.dir, args.capture_limit)
    if args.case == "demo":
        _capture_demo(None)
    elif args.case.startswith("bench"):
        _capture_demo(int(args.case[5:]))
    else:
        _capture_paper(args.case, args.microbatches, args.auto_layers, args.shapes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
