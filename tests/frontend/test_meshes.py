"""The user's mesh kept (autopar/frontend/meshes.py): tracing under it only where the code
needs it, and results re-labelled onto it without copies."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from autopar.core import _compat
from autopar.core.errors import InvalidArgumentError
from autopar.frontend.meshes import on_user_mesh, relabel, under_mesh_if_needed


def _meshes():
    explicit = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    return explicit, _compat.auto_mesh(explicit)


def test_relabel_and_on_user_mesh_do_not_copy():
    explicit, auto = _meshes()
    x = jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(auto, P("data", "model")))
    y = on_user_mesh([x], explicit)[0]
    assert y.sharding.mesh == explicit and y.sharding.spec == P("data", "model")
    assert y.aval.sharding.mesh.axis_types == (AxisType.Explicit,) * 2
    same = lambda a, b: [s.data.unsafe_buffer_pointer() for s in a.addressable_shards] == \
        [s.data.unsafe_buffer_pointer() for s in b.addressable_shards]
    assert same(x, y)
    back = relabel(y, NamedSharding(auto, P("data", "model")))
    assert back.sharding.mesh == auto and same(back, x)
    # Another layout is not re-labelled (lower.put moves it).
    other = NamedSharding(auto, P("model"))
    assert relabel(y, other) is y
    np.testing.assert_array_equal(np.asarray(y), np.arange(64.0).reshape(8, 8))
    assert on_user_mesh([x], auto)[0] is x             # an Auto user mesh: nothing to do


def test_under_mesh_if_needed_retries_under_an_explicit_mesh_only_on_failure():
    explicit, auto = _meshes()
    needs_mesh = lambda: jax.make_jaxpr(
        lambda a: jax.sharding.reshard(a, P("data")))(jnp.ones((8, 4)))
    calls = []

    def plain():
        calls.append(jax.sharding.get_abstract_mesh().empty)
        return 1

    needed = []
    assert under_mesh_if_needed(explicit, plain, needed) == 1 and calls == [True]
    assert needed == []
    assert under_mesh_if_needed(explicit, needs_mesh, needed) is not None
    assert needed == [True]                             # the caller learns the step needs it
    with pytest.raises(ValueError):     # a PartitionSpec outside a mesh context
        under_mesh_if_needed(auto, needs_mesh)          # an Auto mesh is never set

    def autopar_error():
        calls.append("again")
        raise InvalidArgumentError("x")
    with pytest.raises(InvalidArgumentError):
        under_mesh_if_needed(explicit, autopar_error)
    assert calls.count("again") == 1                    # autopar's own errors: no retry
