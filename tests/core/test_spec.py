"""Tests for autopar.spec: sharding specs on a logical mesh (pure Python, no devices)."""
from __future__ import annotations

import itertools
import pathlib
import subprocess
import sys

import pytest

from autopar.core.spec import (
    bytes_per_device,
    dim_shards,
    enumerate_specs,
    format_spec,
    from_names,
    is_valid,
    num_shards,
    replicated,
    shard_shape,
    to_names,
    used_axes,
    without_axes,
)

ROOT = pathlib.Path(__file__).resolve().parents[2]
NAMES = ("data", "model")


def test_spec_module_does_not_import_jax():
    # Load the file on its own: importing it through the package would run
    # autopar/__init__.py, which imports the JAX-using passes.
    code = ("import importlib.util, sys; "
            "s = importlib.util.spec_from_file_location('spec_alone', 'autopar/core/spec.py'); "
            "m = importlib.util.module_from_spec(s); s.loader.exec_module(m); "
            "assert m.num_shards(((0,),), (2,)) == 2; "
            "assert 'jax' not in sys.modules and 'numpy' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


# ------------------------------------------------------------------------------ small helpers
def test_replicated():
    assert replicated(0) == ()
    assert replicated(3) == ((), (), ())


def test_used_axes_major_to_minor():
    assert used_axes(((1,), (), (0, 2))) == (1, 0, 2)
    assert used_axes(((), ())) == ()


@pytest.mark.parametrize("spec, expected", [
    (((), ()), 1),
    (((0,), ()), 2),
    (((1,), ()), 4),
    (((0,), (1,)), 8),
    (((), (0, 1)), 8),
    ((), 1),
])
def test_num_shards(spec, expected):
    assert num_shards(spec, (2, 4)) == expected


def test_dim_shards_and_shard_shape():
    spec = ((0,), (), (1,))
    assert [dim_shards(spec, d, (2, 4)) for d in range(3)] == [2, 1, 4]
    assert shard_shape(spec, (8, 3, 16), (2, 4)) == (4, 3, 4)
    assert shard_shape(((0, 1),), (16,), (2, 4)) == (2,)


def test_bytes_per_device():
    assert bytes_per_device(((0,), (1,)), 1024, (2, 4)) == 128
    assert bytes_per_device(((), ()), 1024, (2, 4)) == 1024
    assert bytes_per_device(((1,), ()), 1000, (2, 4)) == 250


# ------------------------------------------------------------------------------------ is_valid
def test_is_valid_accepts_divisible_split():
    assert is_valid(((0,), (1,)), (8, 8), (2, 4))
    assert is_valid(((), (0, 1)), (3, 8), (2, 4))
    assert is_valid((), (), (2, 4))


def test_is_valid_rejects_rank_mismatch():
    assert not is_valid(((0,),), (8, 8), (2, 4))
    assert not is_valid(((0,), (), ()), (8, 8), (2, 4))


@pytest.mark.parametrize("spec", [((0,), (0,)), ((0, 0), ()), ((1,), (0, 1))])
def test_is_valid_rejects_reused_axis(spec):
    assert not is_valid(spec, (8, 8), (2, 4))


def test_is_valid_rejects_indivisible_split():
    assert not is_valid(((1,), ()), (6, 8), (2, 4))      # 6 % 4
    assert not is_valid(((0, 1), ()), (4, 8), (2, 4))    # 4 % 8
    assert is_valid(((0,), ()), (6, 8), (2, 4))          # 6 % 2 == 0


# ----------------------------------------------------------------------------- enumerate_specs
def test_enumerate_specs_2d_on_2d_mesh_is_complete():
    specs = enumerate_specs((8, 8), (2, 4))
    # Each of the two axes goes to dim 0, dim 1 or nowhere: 3 * 3 distinct specs.
    assert len(specs) == 9
    assert len(set(specs)) == 9
    assert specs[0] == ((), ())
    assert set(specs) == {
        ((), ()), ((0,), ()), ((1,), ()), ((), (0,)), ((), (1,)),
        ((0,), (1,)), ((1,), (0,)), ((0, 1), ()), ((), (0, 1)),
    }


def test_enumerate_specs_sorted_by_number_of_axes():
    specs = enumerate_specs((8, 8, 8), (2, 2, 2))
    counts = [len(used_axes(s)) for s in specs]
    assert counts == sorted(counts)
    assert specs[0] == replicated(3)


def test_enumerate_specs_all_valid_and_unique():
    for shape, mesh in [((8, 8), (2, 4)), ((6, 4, 2), (2, 2)), ((12,), (2, 3)),
                        ((4, 4), (2, 2, 2)), ((5, 7), (2, 4))]:
        specs = enumerate_specs(shape, mesh)
        assert len(specs) == len(set(specs)), (shape, mesh)
        assert all(is_valid(s, shape, mesh) for s in specs), (shape, mesh)


def test_enumerate_specs_matches_brute_force():
    """Every valid spec with each size>1 axis used at most once and <= 2 axes per dim."""
    shape, mesh = (4, 6, 2), (2, 3)
    rank = len(shape)
    expected = set()
    for choice in itertools.product(range(-1, rank), repeat=len(mesh)):
        dims = [[] for _ in range(rank)]
        for axis, d in enumerate(choice):
            if d >= 0:
                dims[d].append(axis)
        spec = tuple(tuple(d) for d in dims)
        if is_valid(spec, shape, mesh):
            expected.add(spec)
    assert set(enumerate_specs(shape, mesh)) == expected


def test_enumerate_specs_respects_divisibility():
    specs = enumerate_specs((3, 8), (2, 4))
    # Dim 0 (3) divides by neither axis; dim 1 takes any subset.
    assert set(specs) == {((), ()), ((), (0,)), ((), (1,)), ((), (0, 1))}
    specs = enumerate_specs((2, 8), (2, 4))
    assert ((1,), ()) not in specs        # 2 % 4
    assert ((0,), (1,)) in specs
    assert ((0, 1), ()) not in specs      # 2 % 8


def test_enumerate_specs_never_uses_size_one_axes():
    specs = enumerate_specs((8, 8), (1, 8))
    assert set(specs) == {((), ()), ((1,), ()), ((), (1,))}
    for s in enumerate_specs((8, 8, 8), (4, 1, 2)):
        assert 1 not in used_axes(s)
    assert enumerate_specs((8, 8), (1, 1)) == [((), ())]


def test_enumerate_specs_scalar_only_replicated():
    assert enumerate_specs((), (2, 4)) == [()]


def test_enumerate_specs_indivisible_tensor_only_replicated():
    assert enumerate_specs((5, 7), (2, 4)) == [((), ())]


def test_enumerate_specs_max_axes_per_dim():
    assert len(enumerate_specs((8, 8), (2, 4), max_axes_per_dim=1)) == 7
    assert ((0, 1), ()) not in enumerate_specs((8, 8), (2, 4), max_axes_per_dim=1)
    # three axes on a rank-1 tensor: all three on one dim needs max_axes_per_dim >= 3
    assert len(enumerate_specs((8,), (2, 2, 2))) == 7
    assert len(enumerate_specs((8,), (2, 2, 2), max_axes_per_dim=3)) == 8
    assert ((0, 1, 2),) in enumerate_specs((8,), (2, 2, 2), max_axes_per_dim=3)


# ------------------------------------------------------------------------------- without_axes
def test_without_axes():
    spec = ((0, 1), (), (2,))
    assert without_axes(spec, [1]) == ((0,), (), (2,))
    assert without_axes(spec, (0, 2)) == ((1,), (), ())
    assert without_axes(spec, ()) == spec
    assert without_axes(spec, (0, 1, 2)) == ((), (), ())


# ------------------------------------------------------------------------ names <-> PartitionSpec
@pytest.mark.parametrize("spec, entries", [
    (((), ()), (None, None)),
    (((0,), ()), ("data", None)),
    (((), (1,)), (None, "model")),
    (((0, 1), ()), (("data", "model"), None)),
    (((1, 0), (), ()), (("model", "data"), None, None)),
    ((), ()),
])
def test_to_names(spec, entries):
    assert to_names(spec, NAMES) == entries
    assert from_names(entries, NAMES) == spec


def test_names_round_trip_through_partition_spec():
    from jax.sharding import PartitionSpec
    for shape in [(8, 8), (8, 4, 16)]:
        for spec in enumerate_specs(shape, (2, 4)):
            pspec = PartitionSpec(*to_names(spec, NAMES))
            assert from_names(pspec, NAMES) == spec
            assert from_names(tuple(pspec), NAMES) == spec


def test_from_names_accepts_one_element_tuple():
    assert from_names((("model",), None), NAMES) == ((1,), ())


def test_from_names_unknown_axis_raises():
    with pytest.raises(KeyError):
        from_names(("batch",), NAMES)


# -------------------------------------------------------------------------------- format_spec
def test_format_spec():
    assert format_spec(((), (1,)), NAMES) == "[-, model]"
    assert format_spec(((0,), ()), NAMES) == "[data, -]"
    assert format_spec(((0, 1),), NAMES) == "[data*model]"
    assert format_spec((), NAMES) == "[]"
    assert format_spec(((), ()), NAMES) == "[-, -]"
