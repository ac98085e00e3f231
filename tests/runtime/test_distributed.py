"""`autopar.distributed` in one process (the multi-process behaviour is tested end to end in
test_launch.py): no job to join is a single process, bad environment values are named, and
the sharing helpers degrade to plain calls."""
import jax
import numpy as np
import pytest

import autopar
from autopar.runtime import distributed as dist


def test_no_job_to_join_runs_as_one_process(monkeypatch):
    for name in (dist.ENV_COORDINATOR, dist.ENV_NUM_PROCESSES, dist.ENV_PROCESS_ID,
                 *dist._CLUSTER_ENVS):
        monkeypatch.delenv(name, raising=False)
    info = autopar.init_distributed()
    assert (info.process_id, info.num_processes, info.coordinator_address) == (0, 1, None)


def test_bad_environment_value_is_named(monkeypatch):
    monkeypatch.setenv(dist.ENV_NUM_PROCESSES, "two")
    with pytest.raises(autopar.InvalidArgumentError, match="AUTOPAR_NUM_PROCESSES='two'"):
        autopar.init_distributed()


def test_to_host_and_sharing_in_one_process():
    x = jax.device_put(np.arange(8.0), jax.sharding.NamedSharding(
        jax.make_mesh((8,), ("d",)), jax.sharding.PartitionSpec("d")))
    got = autopar.to_host({"x": x, "n": 3})
    np.testing.assert_array_equal(got["x"], np.arange(8.0))
    assert got["n"] == 3
    assert dist.share_from_first("k", lambda: "text") == ("text", True)
    dist.check_agreement("k", "anything", "layouts")     # one process: nothing to compare


def test_free_port_is_bindable():
    import socket
    port = dist.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
