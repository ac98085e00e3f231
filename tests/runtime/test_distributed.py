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


class _Store:
    """The coordination service's key-value store, as process 0 sees it (the other process's
    writes are made by the test)."""

    def __init__(self):
        self.values = {}

    def key_value_set(self, key, value, allow_overwrite=False):
        self.values[key] = value

    def blocking_key_value_get(self, key, timeout_ms):
        if key not in self.values:
            raise TimeoutError(f"waited for {key}")
        return self.values[key]


def test_an_agreement_never_reads_an_earlier_rounds_values(monkeypatch):
    """Two pipelines of one step (one graph fingerprint) in a 2-process job: the second check
    must wait for process 1's new digest, not compare with the one it left for the first
    (found by the 2-process GPipe-then-accumulation run: a false mismatch)."""
    import collections
    store = _Store()
    monkeypatch.setattr(dist, "_client", lambda: store)
    monkeypatch.setattr(dist, "_ROUNDS", collections.Counter())
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "process_index", lambda: 0)

    def as_process_1(text_of_0):
        """Process 1 writes what process 0 wrote last (the same digest) under its own key."""
        key = max(k for k in store.values if k.endswith("/0"))
        store.values[key[:-1] + "1"] = store.values[key] if text_of_0 else "other"

    store.values.clear()
    with pytest.raises(TimeoutError):               # round 1: process 1 has not written yet
        dist.check_agreement("fp", "layouts A", "pipeline layouts")
    as_process_1(True)
    monkeypatch.setattr(dist, "_ROUNDS", collections.Counter())
    dist.check_agreement("fp", "layouts A", "pipeline layouts")     # round 1 again: agreed
    with pytest.raises(TimeoutError, match="/2/1"):  # round 2 waits for process 1's new value
        dist.check_agreement("fp", "layouts B", "pipeline layouts")
    as_process_1(False)
    monkeypatch.setattr(dist, "_ROUNDS", collections.Counter({"autopar/agree/fp": 1}))
    with pytest.raises(autopar.PlanMismatchError, match="pipeline layouts"):
        dist.check_agreement("fp", "layouts B", "pipeline layouts")
