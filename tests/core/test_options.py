"""Tests for autopar.options (parallelization methods) and autopar.errors."""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autopar
from autopar.core.enums import SolverBackend
from autopar.core.errors import (
    AutoparError,
    InfeasiblePlanError,
    InvalidArgumentError,
    PlanMismatchError,
    UnsupportedError,
)
from autopar.core.options import (
    DataParallel,
    MethodKind,
    ShardParallel,
    Zero2Parallel,
    Zero3Parallel,
)

METHODS = [ShardParallel, DataParallel, Zero2Parallel, Zero3Parallel]
CLUSTER = autopar.ClusterSpec.preset("dgx-a100")


def _sds(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def _layer(w, x):
    return jnp.tanh(x @ w).sum()


# ------------------------------------------------------------------------------- methods
@pytest.mark.parametrize("cls, kind, value", [
    (ShardParallel, MethodKind.SHARD, "shard_parallel"),
    (DataParallel, MethodKind.DATA, "data_parallel"),
    (Zero2Parallel, MethodKind.ZERO2, "zero2"),
    (Zero3Parallel, MethodKind.ZERO3, "zero3"),
])
def test_method_kind(cls, kind, value):
    method = cls()
    assert method.kind is kind
    assert method.kind.value == value
    assert isinstance(method, ShardParallel)


def test_method_kinds_are_distinct():
    kinds = {cls().kind for cls in METHODS} | {autopar.PipeshardParallel().kind}
    assert len(kinds) == len(MethodKind) == 5


@pytest.mark.parametrize("cls", METHODS)
def test_method_defaults(cls):
    method = cls()
    assert method.memory_budget_bytes is None
    assert method.solver is SolverBackend.HIGHS
    assert method.solver_time_limit_s == 60.0


@pytest.mark.parametrize("cls", METHODS)
def test_methods_are_frozen_keyword_only_values(cls):
    method = cls(memory_budget_bytes=1 << 30, solver=SolverBackend.CBC, solver_time_limit_s=5)
    assert method.memory_budget_bytes == 1 << 30
    assert method.solver is SolverBackend.CBC
    with pytest.raises(dataclasses.FrozenInstanceError):
        method.memory_budget_bytes = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        cls(1 << 30)  # type: ignore[misc]
    assert method == cls(memory_budget_bytes=1 << 30, solver=SolverBackend.CBC,
                         solver_time_limit_s=5)
    assert hash(method) == hash(cls(memory_budget_bytes=1 << 30, solver=SolverBackend.CBC,
                                    solver_time_limit_s=5))


def test_methods_of_different_kinds_differ():
    assert ShardParallel() != DataParallel()
    assert DataParallel() != Zero2Parallel()


@pytest.mark.parametrize("cls", METHODS)
@pytest.mark.parametrize("budget", [0, -1, -(1 << 30)])
def test_invalid_memory_budget_raises(cls, budget):
    with pytest.raises(InvalidArgumentError, match="memory_budget_bytes") as info:
        cls(memory_budget_bytes=budget)
    assert repr(budget) in str(info.value)


@pytest.mark.parametrize("cls", METHODS)
@pytest.mark.parametrize("limit", [0, 0.0, -1.0, math.nan])
def test_invalid_time_limit_raises(cls, limit):
    with pytest.raises(InvalidArgumentError, match="solver_time_limit_s"):
        cls(solver_time_limit_s=limit)


@pytest.mark.parametrize("cls", METHODS)
@pytest.mark.parametrize("solver", ["highs", "cbc", None, 1])
def test_invalid_solver_raises(cls, solver):
    with pytest.raises(InvalidArgumentError, match="SolverBackend") as info:
        cls(solver=solver)
    assert repr(solver) in str(info.value)


def test_valid_edge_values():
    assert ShardParallel(memory_budget_bytes=1).memory_budget_bytes == 1
    assert ShardParallel(solver_time_limit_s=1e-3).solver_time_limit_s == 1e-3
    assert ShardParallel(solver_time_limit_s=math.inf).solver_time_limit_s == math.inf


def test_invalid_argument_error_is_value_error():
    with pytest.raises(ValueError):
        ShardParallel(memory_budget_bytes=0)


def test_public_exports():
    for name in ("ShardParallel", "DataParallel", "Zero2Parallel", "Zero3Parallel",
                 "MethodKind", "SolverBackend", "AutoparError", "InfeasiblePlanError",
                 "InvalidArgumentError", "PlanMismatchError", "UnsupportedError"):
        assert name in autopar.__all__
        assert getattr(autopar, name) is not None
    assert autopar.ShardParallel is ShardParallel
    assert autopar.SolverBackend is SolverBackend


# -------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("cls", [InvalidArgumentError, InfeasiblePlanError, PlanMismatchError,
                                 UnsupportedError])
def test_errors_subclass_autopar_error(cls):
    assert issubclass(cls, AutoparError)
    assert issubclass(cls, Exception)


def test_only_invalid_argument_is_a_value_error():
    assert issubclass(InvalidArgumentError, ValueError)
    for cls in (InfeasiblePlanError, PlanMismatchError, UnsupportedError):
        assert not issubclass(cls, ValueError)


def test_infeasible_plan_error_carries_bytes():
    err = InfeasiblePlanError("does not fit", needed_bytes=1.5e9, budget_bytes=np.int64(1 << 30))
    assert str(err) == "does not fit"
    assert err.needed_bytes == 1_500_000_000 and type(err.needed_bytes) is int
    assert err.budget_bytes == 1 << 30 and type(err.budget_bytes) is int
    with pytest.raises(TypeError):
        InfeasiblePlanError("missing bytes")  # type: ignore[call-arg]
    with pytest.raises(AutoparError):
        raise err


def test_infeasible_plan_from_a_tiny_budget():
    with pytest.raises(InfeasiblePlanError) as info:
        autopar.plan(_layer, _sds(64, 64), _sds(32, 64), cluster=CLUSTER, mesh_shape=(2, 4),
                     method=ShardParallel(memory_budget_bytes=100))
    err = info.value
    assert err.budget_bytes == 100
    assert err.needed_bytes > err.budget_bytes
    assert "100 bytes" in str(err) and f"{err.needed_bytes:,}" in str(err)
    assert "Fix:" in str(err)
    # the reported minimum is achievable: a budget of exactly that much is feasible
    plan = autopar.plan(_layer, _sds(64, 64), _sds(32, 64), cluster=CLUSTER, mesh_shape=(2, 4),
                        method=ShardParallel(memory_budget_bytes=err.needed_bytes))
    assert plan.peak_memory_bytes <= err.needed_bytes
    assert plan.memory_budget_bytes == err.needed_bytes


def test_memory_budget_is_recorded_in_the_plan():
    plan = autopar.plan(_layer, _sds(64, 64), _sds(32, 64), cluster=CLUSTER, mesh_shape=(2, 4),
                        method=ShardParallel(memory_budget_bytes=10**6))
    assert plan.memory_budget_bytes == 10**6
    assert plan.peak_memory_bytes <= 10**6


def test_cbc_backend_is_used_when_asked():
    plan = autopar.plan(_layer, _sds(64, 64), _sds(32, 64), cluster=CLUSTER, mesh_shape=(2, 4),
                        method=ShardParallel(solver=SolverBackend.CBC))
    assert plan.ilp["backend"] == "cbc"
    highs = autopar.plan(_layer, _sds(64, 64), _sds(32, 64), cluster=CLUSTER, mesh_shape=(2, 4))
    assert highs.ilp["backend"] == "highs"
    assert plan.ilp["objective_s"] == pytest.approx(highs.ilp["objective_s"], rel=1e-6)


def test_data_parallel_batch_must_divide_devices():
    with pytest.raises(InvalidArgumentError, match="not divisible by 8"):
        autopar.plan(_layer, _sds(64, 64), _sds(30, 64), cluster=CLUSTER, mesh_shape=(2, 4),
                     method=DataParallel())


# --------------------------------------------------------------------------- parallelize
@pytest.mark.parametrize("method", [MethodKind.SHARD, "shard_parallel", ShardParallel, 1])
def test_parallelize_rejects_non_methods(method):
    with pytest.raises(InvalidArgumentError, match="method=") as info:
        autopar.parallelize(_layer, method=method)
    assert "ShardParallel()" in str(info.value)            # says how to fix it


@pytest.mark.parametrize("mesh", ["data", (2, 4), lambda: None])
def test_parallelize_rejects_non_meshes(mesh):
    with pytest.raises(InvalidArgumentError, match="jax.sharding.Mesh"):
        autopar.parallelize(_layer, mesh=mesh)


def test_parallelize_rejects_device_array_as_mesh():
    devices = np.array(jax.devices()).reshape(2, 4)
    with pytest.raises(InvalidArgumentError):
        autopar.parallelize(_layer, mesh=devices)


def test_parallelize_decorator_form_validates_when_applied():
    decorator = autopar.parallelize(method="zero3")
    with pytest.raises(InvalidArgumentError):
        decorator(_layer)


def test_parallelize_accepts_every_method():
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    for cls in METHODS:
        fn = autopar.parallelize(_layer, mesh=mesh, method=cls())
        assert isinstance(fn, autopar.ParallelizedFunction)
        assert fn.mesh is mesh


def test_sharding_rules_are_validated_and_normalized():
    m = autopar.ShardParallel(sharding_rules=[("kernel", [None, "model"]), ("bias", ["model"])])
    assert m.sharding_rules == (("kernel", (None, "model")), ("bias", ("model",)))
    hash(m)                                  # methods stay hashable cache keys
    spec = jax.sharding.PartitionSpec(("data", "model"), None)
    assert autopar.ShardParallel(sharding_rules=(("x", spec),)).sharding_rules == (
        ("x", (("data", "model"), None)),)
    with pytest.raises(autopar.InvalidArgumentError, match="not a regular expression"):
        autopar.ShardParallel(sharding_rules=(("[unclosed", ()),))
    with pytest.raises(autopar.InvalidArgumentError, match=r"\(regex, spec\) pair"):
        autopar.ShardParallel(sharding_rules=(("kernel",),))
    with pytest.raises(autopar.InvalidArgumentError, match="spec entry 3"):
        autopar.ShardParallel(sharding_rules=(("kernel", (3,)),))
