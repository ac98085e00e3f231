"""Tests for autopar.cost on numbers alone (no JAX)."""
from __future__ import annotations

import math
import pathlib

import pytest

from autopar.core.errors import InvalidArgumentError
from autopar.cost.cluster import LogicalMesh
from autopar.cost.model import (
    CollectiveAlgorithm,
    CostModel,
    all_gather_options_s,
    all_reduce_options_s,
    all_to_all_options_s,
    reduce_scatter_options_s,
)

ROOT = pathlib.Path(__file__).resolve().parents[2]
A_FAST, B_FAST = 1e-6, 1e-10  # axis 1 (and 2)
A_SLOW, B_SLOW = 1e-5, 1e-9   # axis 0


def make_mesh(shape=(2, 4), alpha=None, beta=None, **overrides) -> LogicalMesh:
    rank = len(shape)
    fields = dict(
        shape=tuple(shape), axis_names=tuple(f"a{i}" for i in range(rank)),
        alpha_s=alpha or (A_SLOW,) + (A_FAST,) * (rank - 1),
        beta_s_per_byte=beta or (B_SLOW,) + (B_FAST,) * (rank - 1),
        peak_flops_bf16_per_s=1e12, peak_flops_fp32_per_s=1e11,
        hbm_bandwidth_bytes_per_s=1e10, memory_bytes=2**30)
    fields.update(overrides)
    return LogicalMesh(**fields)


def model(**kw) -> CostModel:
    return CostModel(mesh=make_mesh(**kw))


def test_cost_module_does_not_import_jax():
    """The cost model and everything it imports at module level stay free of JAX, so they are
    unit-testable on numbers alone (the package __init__ imports the JAX passes, so this is
    checked on the modules' own import statements)."""
    import ast
    for rel in ("autopar/cost/model.py", "autopar/cost/cluster.py", "autopar/core/spec.py",
                "autopar/core/errors.py", "autopar/intra_op/ilp.py"):
        tree = ast.parse((ROOT / rel).read_text())
        for node in tree.body:  # module level only: cluster imports jax lazily in a method
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n == "jax" or n.startswith("jax.") for n in names), (rel, names)


# ---- formulas against hand-computed values --------------------------------------------------

def test_all_reduce_formulas():
    n, size, a, b = 8, 1e6, 1e-5, 1e-9
    got = all_reduce_options_s(n, size, a, b)
    assert got[CollectiveAlgorithm.RING] == pytest.approx(14 * a + 1.75 * size * b)
    assert got[CollectiveAlgorithm.TREE] == pytest.approx(6 * (a + size * b))
    assert got[CollectiveAlgorithm.BUTTERFLY] == pytest.approx(3 * (a + size * b))
    assert got[CollectiveAlgorithm.RECURSIVE_HALVING] == pytest.approx(6 * a + 1.75 * size * b)


def test_all_reduce_non_power_of_two_folds_into_power_of_two():
    n, size, a, b = 6, 1e6, 1e-5, 1e-9
    got = all_reduce_options_s(n, size, a, b)
    fold = 2 * (a + size * b)
    assert got[CollectiveAlgorithm.RECURSIVE_HALVING] == pytest.approx(
        2 * 2 * a + 2 * 3 / 4 * size * b + fold)
    assert got[CollectiveAlgorithm.BUTTERFLY] == pytest.approx(2 * (a + size * b) + fold)
    assert got[CollectiveAlgorithm.TREE] == pytest.approx(2 * 3 * (a + size * b))
    assert got[CollectiveAlgorithm.RING] == pytest.approx(10 * a + 10 / 6 * size * b)


def test_gather_scatter_all_to_all_formulas():
    n, size, a, b = 4, 8e6, 2e-5, 1e-9
    ring = 3 * a + 0.75 * size * b
    ag = all_gather_options_s(n, size, a, b)
    assert ag[CollectiveAlgorithm.RING] == pytest.approx(ring)
    assert ag[CollectiveAlgorithm.RECURSIVE_HALVING] == pytest.approx(2 * a + 0.75 * size * b)
    rs = reduce_scatter_options_s(n, size, a, b)
    assert rs[CollectiveAlgorithm.RING] == pytest.approx(ring)
    assert rs[CollectiveAlgorithm.RECURSIVE_HALVING] == pytest.approx(2 * a + 0.75 * size * b)
    assert all_to_all_options_s(n, size, a, b) == {CollectiveAlgorithm.RING: pytest.approx(ring)}
    # recursive halving reduce-scatter needs a power of two
    assert set(reduce_scatter_options_s(6, size, a, b)) == {CollectiveAlgorithm.RING}


def test_all_reduce_is_reduce_scatter_plus_all_gather_for_ring():
    n, size, a, b = 8, 3e6, 7e-6, 2e-10
    ar = all_reduce_options_s(n, size, a, b)[CollectiveAlgorithm.RING]
    rs = reduce_scatter_options_s(n, size, a, b)[CollectiveAlgorithm.RING]
    ag = all_gather_options_s(n, size, a, b)[CollectiveAlgorithm.RING]
    assert ar == pytest.approx(rs + ag)


def test_cost_model_takes_the_cheapest_algorithm():
    cm = model(shape=(2, 4))
    size = 1e6
    assert cm.all_reduce_s(size, [1]) == min(all_reduce_options_s(4, size, A_FAST, B_FAST).values())
    assert cm.all_gather_s(size, [1]) == pytest.approx(2 * A_FAST + 0.75 * size * B_FAST)
    assert cm.reduce_scatter_s(size, [1]) == pytest.approx(2 * A_FAST + 0.75 * size * B_FAST)
    assert cm.all_to_all_s(size, [1]) == pytest.approx(3 * A_FAST + 0.75 * size * B_FAST)
    assert cm.all_gather_s(size, [0]) == pytest.approx(A_SLOW + 0.5 * size * B_SLOW)


def test_big_message_is_bandwidth_bound_and_ring_wins_off_powers_of_two():
    size = 1e10
    got = all_reduce_options_s(6, size, 1e-5, 1e-9)
    best = min(got, key=got.get)
    assert best is CollectiveAlgorithm.RING
    assert got[best] == pytest.approx(2 * 5 / 6 * size * 1e-9, rel=1e-4)
    # power of two: bandwidth-optimal (ring / recursive halving), not tree or butterfly
    got = all_reduce_options_s(8, size, 1e-5, 1e-9)
    assert min(got.values()) == pytest.approx(2 * 7 / 8 * size * 1e-9, rel=1e-4)
    assert got[CollectiveAlgorithm.TREE] > 3 * min(got.values())


def test_tiny_message_on_many_devices_prefers_log_latency():
    got = all_reduce_options_s(256, 8.0, 1e-5, 1e-9)
    best = min(got, key=got.get)
    assert best in (CollectiveAlgorithm.BUTTERFLY, CollectiveAlgorithm.RECURSIVE_HALVING)
    assert got[best] < got[CollectiveAlgorithm.RING] / 10
    cm = CostModel(mesh=make_mesh(shape=(256,), alpha=(1e-5,), beta=(1e-9,)))
    assert cm.all_reduce_s(8.0, [0]) == pytest.approx(got[best])
    assert cm.all_gather_s(8.0, [0]) == pytest.approx(8 * 1e-5 + 255 / 256 * 8 * 1e-9)


def test_the_priced_all_reduce_algorithm_is_named():
    cm = CostModel(mesh=make_mesh(shape=(6,), alpha=(1e-5,), beta=(1e-9,)))
    for size in (8.0, 1e4, 1e10):
        got = all_reduce_options_s(6, size, 1e-5, 1e-9)
        algorithm = cm.all_reduce_algorithm(size, [0])
        assert got[algorithm] == min(got.values()) == cm.all_reduce_s(size, [0])
    assert cm.all_reduce_algorithm(1e10, [0]) is CollectiveAlgorithm.RING   # bandwidth-bound
    assert cm.all_reduce_algorithm(8.0, [0]) is not CollectiveAlgorithm.RING  # latency-bound


def test_single_device_groups_cost_nothing():
    cm = model(shape=(1, 8))
    for fn in (cm.all_reduce_s, cm.all_gather_s, cm.reduce_scatter_s, cm.all_to_all_s):
        assert fn(1e9, [0]) == 0.0
        assert fn(1e9, []) == 0.0
        assert fn(1e9, [0, 1]) == fn(1e9, [1]) > 0.0  # size-1 axes are ignored
    for options in (all_reduce_options_s, all_gather_options_s, reduce_scatter_options_s,
                    all_to_all_options_s):
        assert set(options(1, 1e9, 1.0, 1.0).values()) == {0.0}


def test_multi_axis_group_uses_product_and_slowest_link():
    cm = model(shape=(2, 4))
    expected = min(all_reduce_options_s(8, 1e6, A_SLOW, B_SLOW).values())
    assert cm.all_reduce_s(1e6, [0, 1]) == pytest.approx(expected)
    assert cm.all_reduce_s(1e6, [1, 0]) == pytest.approx(expected)


def test_bigger_beta_costs_more():
    fast = model(beta=(1e-10, 1e-10))
    slow = model(beta=(1e-9, 1e-9))
    for name in ("all_reduce_s", "all_gather_s", "reduce_scatter_s", "all_to_all_s"):
        assert getattr(slow, name)(1e6, [1]) > getattr(fast, name)(1e6, [1])
    assert slow.reshard_s((8, 8), 4, ((0,), ()), ((), ())) > \
        fast.reshard_s((8, 8), 4, ((0,), ()), ((), ()))


def test_bad_axes_and_sizes_are_rejected():
    cm = model()
    with pytest.raises(InvalidArgumentError, match="axis 2"):
        cm.all_reduce_s(1.0, [2])
    with pytest.raises(InvalidArgumentError, match="repeat"):
        cm.all_reduce_s(1.0, [1, 1])
    with pytest.raises(InvalidArgumentError, match="nbytes"):
        cm.all_gather_s(-1.0, [1])
    with pytest.raises(InvalidArgumentError, match="LogicalMesh"):
        CostModel(mesh=(2, 4))  # type: ignore[arg-type]


# ---- compute --------------------------------------------------------------------------------

def test_compute_roofline_both_regimes():
    cm = model()  # bf16 1e12, fp32 1e11 flop/s; HBM 1e10 B/s
    # compute bound: 1e12 flops over 1e6 bytes
    assert cm.compute_s(1e12, 1e6, "float32") == pytest.approx(10.0)
    assert cm.compute_s(1e12, 1e6, "bfloat16") == pytest.approx(1.0)
    # memory bound: elementwise op, 1e6 flops over 1e9 bytes
    assert cm.compute_s(1e6, 1e9, "float32") == pytest.approx(0.1)
    assert cm.compute_s(0, 0, "float32") == 0.0
    with pytest.raises(InvalidArgumentError, match="flops"):
        cm.compute_s(-1, 0, "float32")


# ---- resharding -----------------------------------------------------------------------------

SHAPE, ITEM = (16, 32), 4
TOTAL = 16 * 32 * 4


def test_reshard_identical_specs_is_free():
    cm = model()
    for spec in [((), ()), ((0,), (1,)), ((0, 1), ()), ((), (1, 0))]:
        assert cm.reshard_s(SHAPE, ITEM, spec, spec) == 0.0
    assert cm.reshard_s((), ITEM, (), ()) == 0.0


def test_reshard_replicated_to_sharded_is_a_local_slice():
    cm = model()
    assert cm.reshard_s(SHAPE, ITEM, ((), ()), ((0,), (1,))) == 0.0
    assert cm.reshard_s(SHAPE, ITEM, ((0,), ()), ((0, 1), ())) == 0.0


def test_reshard_sharded_to_replicated_is_an_all_gather():
    cm = model()
    assert cm.reshard_s(SHAPE, ITEM, ((1,), ()), ((), ())) == pytest.approx(
        cm.all_gather_s(TOTAL, [1]))
    assert cm.reshard_s(SHAPE, ITEM, ((0,), (1,)), ((0,), ())) == pytest.approx(
        cm.all_gather_s(TOTAL / 2, [1]))  # result is still split 2 ways by axis 0


def test_reshard_gathering_two_axes_runs_them_in_the_cheapest_order():
    cm = model()
    slow_first = cm.all_gather_s(TOTAL / 4, [0]) + cm.all_gather_s(TOTAL, [1])
    fast_first = cm.all_gather_s(TOTAL / 2, [1]) + cm.all_gather_s(TOTAL, [0])
    assert cm.reshard_s(SHAPE, ITEM, ((0,), (1,)), ((), ())) == pytest.approx(
        min(slow_first, fast_first))


def test_reshard_axis_moved_between_dims_is_an_all_to_all():
    cm = model()
    assert cm.reshard_s(SHAPE, ITEM, ((1,), ()), ((), (1,))) == pytest.approx(
        cm.all_to_all_s(TOTAL / 4, [1]))



def test_reshard_moved_axis_with_another_change_replicates_then_partitions():
    """XLA makes an all-to-all only of a lone moved axis; otherwise it gathers everything
    ("involuntary full rematerialization") and slices, which is what this costs."""
    cm = model()
    src = ((1,), (0,))
    full_gather = cm.reshard_s(SHAPE, ITEM, src, ((), ()))
    assert cm.reshard_s(SHAPE, ITEM, src, ((), (1,))) == pytest.approx(full_gather)
    old_estimate = cm.all_to_all_s(TOTAL / 8, [1]) + cm.all_gather_s(TOTAL / 4, [0])
    assert full_gather != pytest.approx(old_estimate)


def test_reshard_reordered_axes_within_a_dim_replicates_then_partitions():
    cm = model()
    got = cm.reshard_s(SHAPE, ITEM, ((0, 1), ()), ((1, 0), ()))
    assert got == pytest.approx(cm.reshard_s(SHAPE, ITEM, ((0, 1), ()), ((), ())))
    assert got > 0.0


def test_reshard_ignores_size_one_axes():
    cm = model(shape=(1, 8))
    assert cm.reshard_s(SHAPE, ITEM, ((0,), ()), ((), ())) == 0.0


def test_reshard_rejects_rank_mismatch_and_bad_axes():
    cm = model()
    with pytest.raises(InvalidArgumentError, match="rank"):
        cm.reshard_s(SHAPE, ITEM, ((),), ((), ()))
    with pytest.raises(InvalidArgumentError, match="mesh axis 3"):
        cm.reshard_s(SHAPE, ITEM, ((3,), ()), ((), ()))


def test_reshard_scales_with_tensor_size():
    cm = model()
    small = cm.reshard_s((16, 32), 4, ((0,), ()), ((), ()))
    big = cm.reshard_s((1024, 1024), 4, ((0,), ()), ((), ()))
    assert big > small > 0 and math.isfinite(big)


def test_backend_algorithms_restrict_the_choice():
    """A backend that implements only ring and tree (NCCL, the GPU presets) is priced with
    them alone: tree for small messages, ring for large; the others are never named."""
    from autopar.cost.cluster import ClusterSpec
    nccl = CostModel(mesh=ClusterSpec.preset("dgx-a100").logical_mesh((1, 8)))
    any_alg = CostModel(mesh=make_mesh(shape=(1, 8), alpha=(6e-6,) * 2,
                                       beta=(nccl.mesh.beta_s_per_byte[1],) * 2))
    assert nccl.mesh.collective_algorithms == ("ring", "tree")
    for size in (8.0, 1e3, 1e6, 1e9):
        got = all_reduce_options_s(8, size, *nccl._group([1])[1:])
        algorithm = nccl.all_reduce_algorithm(size, [1])
        assert algorithm in (CollectiveAlgorithm.RING, CollectiveAlgorithm.TREE)
        assert nccl.all_reduce_s(size, [1]) == min(got[CollectiveAlgorithm.RING],
                                                   got[CollectiveAlgorithm.TREE])
        assert any_alg.all_reduce_s(size, [1]) <= nccl.all_reduce_s(size, [1])
    assert nccl.all_reduce_algorithm(1e3, [1]) is CollectiveAlgorithm.TREE
    assert nccl.all_reduce_algorithm(1e9, [1]) is CollectiveAlgorithm.RING
    with pytest.raises(InvalidArgumentError, match="collective_algorithms"):
        make_mesh(collective_algorithms=("nvls",))


def test_collective_permute_is_one_step_of_the_whole_shard():
    cm = model(shape=(2, 4))
    alpha, beta = cm.mesh.alpha_s[1], cm.mesh.beta_s_per_byte[1]
    assert cm.collective_permute_s(1e6, [1]) == pytest.approx(alpha + 1e6 * beta)
    assert cm.collective_permute_s(1e6, [1]) < cm.all_gather_s(4e6, [1])
    assert model(shape=(1, 8)).collective_permute_s(1e6, [0]) == 0.0
