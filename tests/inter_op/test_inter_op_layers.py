"""Automatic layer construction: DP against brute force, balance bound, liveness cut bytes."""
import itertools

import numpy as np
import pytest

from autopar.core.errors import InvalidArgumentError
from autopar.inter_op.layers import _solve, cluster_layers, cut_bytes_from_liveness


def brute_force(flops, cuts, num_layers, limit, floor=0.0):
    n = len(flops)
    prefix = np.concatenate([[0.0], np.cumsum(flops)])
    best = None
    for inner in itertools.combinations(range(1, n), num_layers - 1):
        bounds = (0, *inner, n)
        segs = [prefix[b] - prefix[a] for a, b in zip(bounds, bounds[1:])]
        if max(segs) > limit * (1 + 1e-12) or min(segs) < floor * (1 - 1e-12):
            continue
        key = (sum(cuts[b] for b in inner), max(segs))
        if best is None or key < best[0]:
            best = (key, bounds)
    return best


def test_docstring_example():
    res = cluster_layers(np.ones(4), np.array([0, 5, 1, 5, 0.0]), 2)
    assert res.boundaries == (0, 2, 4) and res.cut_bytes == 1.0 and res.max_imbalance == 0.0


@pytest.mark.parametrize("seed", range(40))
def test_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 10))
    layers = int(rng.integers(1, n + 1))
    flops = rng.integers(0, 10, n).astype(float)
    cuts = np.concatenate([[0.0], rng.integers(0, 20, n - 1).astype(float), [0.0]])
    res = cluster_layers(flops, cuts, layers, imbalance=0.5)
    total = flops.sum()
    mean = total / layers
    limit = 1.5 * mean if total > 0 else np.inf
    expected = brute_force(flops, cuts, layers, limit, floor=mean / 1.5)
    assert res.num_layers == layers
    assert sum(res.layer_flops) == pytest.approx(total)
    if expected is not None:       # both bounds met: same optimum, bytes then balance
        (exp_bytes, exp_peak), bounds = expected
        assert res.cut_bytes == pytest.approx(exp_bytes)
        assert max(res.layer_flops) == pytest.approx(exp_peak)
    else:                          # relaxed: still a valid partition into non-empty layers
        assert all(b > a for a, b in zip(res.boundaries, res.boundaries[1:]))
    if np.count_nonzero(flops) >= layers:     # enough operators with work for every layer
        assert min(res.layer_flops) > 0, res


@pytest.mark.parametrize("seed", range(30))
def test_dp_matches_brute_force_with_both_bounds(seed):
    rng = np.random.default_rng(100 + seed)
    n = int(rng.integers(2, 9))
    layers = int(rng.integers(1, n + 1))
    flops = rng.integers(0, 10, n).astype(float)
    cuts = np.concatenate([[0.0], rng.integers(0, 20, n - 1).astype(float), [0.0]])
    mean = flops.sum() / layers
    floor, limit = mean * rng.uniform(0, 1), mean * rng.uniform(1, 3)
    got = _solve(np.concatenate([[0.0], np.cumsum(flops)]), cuts, layers, floor, limit)
    expected = brute_force(flops, cuts, layers, limit, floor=floor)
    if expected is None:
        assert got is None
    else:
        prefix = np.concatenate([[0.0], np.cumsum(flops)])
        segs = [prefix[b] - prefix[a] for a, b in zip(got, got[1:])]
        assert (sum(cuts[b] for b in got[1:-1]), max(segs)) == pytest.approx(expected[0])


def test_a_heavy_head_does_not_leave_layers_without_work():
    # one operator (an LM head, 3.5 units) outweighs the mean layer (9.5 / 6 = 1.58): the
    # upper bound must relax to fit it, and the cheap cuts around the zero-FLOP embedding
    # and loss nodes must not become layers of their own
    flops = np.array([0.0, 1, 1, 1, 1, 1, 1, 3.5, 0])
    cuts = np.array([0.0, .01, 1, 1, 1, 1, 1, 1, .01, 0])
    res = cluster_layers(flops, cuts, 6)
    assert min(res.layer_flops) >= 1.0, res
    assert res.layer_flops[-1] == 3.5 and res.num_layers == 6
    # with more layers than operators that do work, empty layers are unavoidable, not an error
    assert cluster_layers(np.array([0.0, 1, 0, 0]), np.zeros(5), 3).num_layers == 3


def test_balance_beats_a_cheap_but_lopsided_cut():
    flops = np.array([10, 10, 10, 10.0])
    cuts = np.array([0, 0, 100, 100, 0.0])      # cutting after node 1 is free
    assert cluster_layers(flops, cuts, 2, imbalance=0.0).boundaries == (0, 2, 4)
    loose = cluster_layers(flops, np.array([0, 1, 100, 100, 0.0]), 2, imbalance=1.0)
    assert loose.boundaries == (0, 1, 4)         # 30/20 = 1.5 <= 2: the cheaper cut wins


def test_cut_bytes_from_liveness():
    # tensor 0: made by node 0, last read by node 2 -> crosses cuts 1 and 2
    # tensor 1: a graph input (defined_at -1) -> never counted
    # tensor 2: made by node 1, read by node 3 -> crosses cuts 2 and 3
    cuts = cut_bytes_from_liveness([0, -1, 1], [2, 3, 3], [4.0, 100.0, 8.0], num_nodes=4)
    assert cuts.tolist() == [0.0, 4.0, 12.0, 8.0, 0.0]


def test_bad_arguments():
    with pytest.raises(InvalidArgumentError, match="num_layers"):
        cluster_layers(np.ones(3), np.zeros(4), 5)
    with pytest.raises(InvalidArgumentError, match="cut_bytes"):
        cluster_layers(np.ones(3), np.zeros(3), 2)
    with pytest.raises(InvalidArgumentError, match="imbalance"):
        cluster_layers(np.ones(3), np.zeros(4), 2, imbalance=-1)
    with pytest.raises(InvalidArgumentError, match="node_flops"):     # the DP's window
        cluster_layers(np.array([1.0, -1.0, 2.0]), np.zeros(4), 2)
