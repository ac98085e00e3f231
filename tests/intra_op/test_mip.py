"""The MIP backend's HiGHS settings on a captured problem that used to hang."""
import os
import subprocess
import sys
import textwrap

DATA = os.path.join(os.path.dirname(__file__), "data", "gpt39b_layer_rens.npz")

# Loads the captured MIP (a GPT-39B layer on (2, 8) as (1, 16), selective recomputation, K=8,
# M=1024: 3799 columns, 1969 rows) and solves it with a 20 s limit.
_SOLVE = textwrap.dedent("""
    import sys, time
    import numpy as np
    from autopar.intra_op import mip as m
    z = np.load(sys.argv[1])
    x = m.Mip.__new__(m.Mip)
    for k in ("start", "cost", "lower", "upper", "integer", "row_lower", "row_upper", "rows",
              "cols", "vals"):
        setattr(x, k, z[k])
    x.group_cols = [tuple(map(int, g)) for g in z["group_cols"]]
    x.offset, x.scale, x.rel_gap, x.rounding = float(z["offset"]), float(z["scale"]), None, None
    r = m.solve_highs(x, 20.0)
    print(r.kind.value, float(x.cost @ r.x))
""")


def test_highs_keeps_its_time_limit_on_a_captured_layer_ilp():
    """With HiGHS's RENS heuristic on, highspy 1.16 stayed in the presolve of RENS's sub-MIP
    for more than 7 minutes on this problem, with a 60 s limit (`mip.MIP_RUN_RENS`); without
    it the MIP is solved to optimality in a few seconds. The child process is stopped at 10x
    the limit: a hang fails the test instead of the suite."""
    try:
        out = subprocess.run([sys.executable, "-c", _SOLVE, DATA], capture_output=True,
                             text=True, timeout=200)
    except subprocess.TimeoutExpired:
        raise AssertionError("HiGHS ran 10x past its 20 s time limit (a hang)") from None
    assert out.returncode == 0, out.stderr[-2000:]
    status, objective = out.stdout.split()
    assert status == "optimal"
    assert abs(float(objective) - 0.30076852464718806) <= 1e-3 * 0.30076852464718806
