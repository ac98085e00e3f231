"""Multi-process runs: `init_distributed`, and the agreement every process needs on its plan.

autopar runs one controller process per host on JAX's own multi-process runtime
(`jax.distributed`): every process runs the same script, sees every device of the job
(`jax.devices()`), and plans and runs the same program; stages and transfers span processes
where the plan puts them.

`init_distributed()` is a thin wrapper over `jax.distributed.initialize` that
- reads the environment `python -m autopar launch` sets (`AUTOPAR_COORDINATOR_ADDRESS`,
  `AUTOPAR_NUM_PROCESSES`, `AUTOPAR_PROCESS_ID`, `AUTOPAR_TRANSFER_ADDRESS`), else JAX's own
  (`JAX_COORDINATOR_ADDRESS`, and SLURM / Open MPI / Kubernetes / Cloud TPU auto-detection),
  else runs as a single process;
- enables cross-process device-to-device transfers on CPU (JAX needs a socket address for them
  where the backend has no transport of its own);
- bounds every wait: a process that never joins, or one that dies later, stops the others
  with an error that names it (exit status `EXIT_JOIN_TIMEOUT` / `EXIT_PEER_LOST`) instead of
  hanging.

Example (run the same script on every host, or with `python -m autopar launch`):
    >>> import autopar
    >>> info = autopar.init_distributed()          # before any other JAX call
    >>> info.process_id, info.num_processes
    (0, 2)
"""
from __future__ import annotations

import atexit
import collections
import hashlib
import itertools
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from autopar.core.errors import InvalidArgumentError, PlanMismatchError

log = logging.getLogger(__name__)

EXIT_JOIN_TIMEOUT = 75    # a process did not join in time
EXIT_PEER_LOST = 76       # another process of the job died or stopped answering

ENV_COORDINATOR = "AUTOPAR_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "AUTOPAR_NUM_PROCESSES"
ENV_PROCESS_ID = "AUTOPAR_PROCESS_ID"
ENV_TRANSFER = "AUTOPAR_TRANSFER_ADDRESS"
ENV_JOIN_TIMEOUT = "AUTOPAR_JOIN_TIMEOUT_S"
ENV_HEARTBEAT = "AUTOPAR_HEARTBEAT_TIMEOUT_S"
_CLUSTER_ENVS = ("JAX_COORDINATOR_ADDRESS", "SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE",
                 "KUBERNETES_SERVICE_HOST", "TPU_WORKER_HOSTNAMES")
_TO_HOST_CALLS = itertools.count()   # the job's to_host calls, numbered alike on every process
_PLAN_WAIT_S = 24 * 3600   # process 0 may search for long; a dead one is caught by the watchdog


@dataclass(frozen=True, slots=True, kw_only=True)
class DistributedInfo:
    """What `init_distributed` set up."""
    process_id: int
    num_processes: int
    coordinator_address: str | None
    transfer_address: str | None        # the socket for cross-process transfers, if set here


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise InvalidArgumentError(f"environment variable {name}={value!r} is not an integer. "
                                   f"Fix: set it to e.g. {name}=2, or unset it.") from None


def _env_float(name: str, default: float) -> float:
    value = os.environ.get(name)
    try:
        return float(value) if value else default
    except ValueError:
        raise InvalidArgumentError(f"environment variable {name}={value!r} is not a number of "
                                   f"seconds. Fix: e.g. {name}=30.") from None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _client():
    from autopar.core._compat import distributed_client
    return distributed_client()


def is_initialized() -> bool:
    return _client() is not None


def _info() -> DistributedInfo:
    import jax

    from autopar.core._compat import coordinator_address
    return DistributedInfo(process_id=jax.process_index(), num_processes=jax.process_count(),
                           coordinator_address=coordinator_address(),
                           transfer_address=jax.config.values.get(
                               "jax_cross_host_transfer_socket_address") or None)


def _set_transfer_address(address: str | None) -> str | None:
    """Cross-process `device_put` on CPU needs a socket (one fixed port per process) and
    ephemeral transport ports; set both unless the user already did."""
    import jax
    current = jax.config.values.get("jax_cross_host_transfer_socket_address")
    if current:
        return current
    if address is None:
        platforms = os.environ.get("JAX_PLATFORMS", "") or str(
            jax.config.values.get("jax_platforms") or "")
        if platforms.split(",")[0] != "cpu":
            return None       # accelerator plugins move data across hosts themselves
        host = socket.gethostbyname(socket.gethostname())
        address = f"{host}:{free_port(host)}"
    jax.config.update("jax_cross_host_transfer_socket_address", address)
    jax.config.update("jax_cross_host_transport_addresses", address.rsplit(":", 1)[0] + ":0")
    return address


def _die(status: int, message: str) -> None:
    print(f"autopar: {message}", file=sys.stderr, flush=True)
    os._exit(status)


def init_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None, *, transfer_address: str | None = None,
                     join_timeout_s: float | None = None,
                     heartbeat_timeout_s: float | None = None,
                     auto_detect: bool = True) -> DistributedInfo:
    """Join this process to a multi-process JAX job (idempotent; call it before any other JAX
    call).

    Args:
      coordinator_address, num_processes, process_id: as `jax.distributed.initialize`; each
        defaults to `AUTOPAR_COORDINATOR_ADDRESS` / `AUTOPAR_NUM_PROCESSES` /
        `AUTOPAR_PROCESS_ID`, then to JAX's own detection (SLURM, Open MPI, ...).
      transfer_address: `host:port` this process receives cross-process transfers on (CPU
        only; default `AUTOPAR_TRANSFER_ADDRESS`, else this host and a free port).
      join_timeout_s: how long to wait for every process to join (default
        `AUTOPAR_JOIN_TIMEOUT_S`, else 300 s); past it this process exits with status
        `EXIT_JOIN_TIMEOUT` and a message naming the coordinator and the count it waited for.
      heartbeat_timeout_s: a process silent this long counts as dead (default
        `AUTOPAR_HEARTBEAT_TIMEOUT_S`, else 60 s); every other process then exits with status
        `EXIT_PEER_LOST` and a message naming it.
      auto_detect: with no address given or found in the environment, still let JAX detect a
        cluster when one of its variables (e.g. `SLURM_JOB_ID`) is set; False runs as one
        process.

    Returns the process id and count (`num_processes == 1` when there is no job to join).
    """
    import jax
    if is_initialized():
        return _info()
    address = coordinator_address or os.environ.get(ENV_COORDINATOR) or None
    n = num_processes if num_processes is not None else _env_int(ENV_NUM_PROCESSES)
    pid = process_id if process_id is not None else _env_int(ENV_PROCESS_ID)
    detect = auto_detect and any(os.environ.get(v) for v in _CLUSTER_ENVS)
    if address is None and n is None and pid is None and not detect:
        log.info("autopar: no multi-process job found (no %s, JAX_COORDINATOR_ADDRESS or "
                 "cluster scheduler variables); running as a single process", ENV_COORDINATOR)
        return DistributedInfo(process_id=0, num_processes=1, coordinator_address=None,
                               transfer_address=None)
    join_s = join_timeout_s if join_timeout_s is not None else _env_float(ENV_JOIN_TIMEOUT, 300)
    beat_s = heartbeat_timeout_s if heartbeat_timeout_s is not None else \
        _env_float(ENV_HEARTBEAT, 60)
    _set_transfer_address(transfer_address or os.environ.get(ENV_TRANSFER) or None)
    where = address or "the address JAX detects"
    log.info("autopar: process %s of %s joining the job at %s (waiting up to %.0f s)",
             pid, n, where, join_s)
    # JAX aborts the process from C++ when joining times out; this timer says why first.
    timer = threading.Timer(join_s, _die, (EXIT_JOIN_TIMEOUT, (
        f"process {pid} waited {join_s:.0f} s for all {n} processes to join the job at "
        f"{where}; they did not. Fix: start every process (process ids 0..{(n or 1) - 1}, the "
        "same coordinator address) within the time-out, check that the coordinator's host "
        "and port are reachable, or raise join_timeout_s.")))
    timer.daemon = True
    timer.start()
    try:
        jax.distributed.initialize(coordinator_address=address, num_processes=n,
                                   process_id=pid, initialization_timeout=int(join_s) + 30,
                                   heartbeat_timeout_seconds=max(1, int(beat_s)))
    finally:
        timer.cancel()
    info = _info()
    _start_watchdog(info, beat_s)
    log.info("autopar: process %d of %d joined; %d devices in the job, %d here",
             info.process_id, info.num_processes, len(jax.devices()), len(jax.local_devices()))
    return info


def _start_watchdog(info: DistributedInfo, heartbeat_timeout_s: float) -> None:
    """A daemon thread that exits this process with a clear message when another process of
    the job is gone (the coordination service stops listing a process once its heartbeats
    stop), rather than leaving it blocked in a collective forever."""
    stop = threading.Event()
    client = _client()
    everyone = list(range(info.num_processes))
    period = min(1.0, heartbeat_timeout_s / 4)

    def watch():
        while not stop.wait(period):
            try:
                live = set(client.get_live_nodes(everyone))
            except Exception as e:   # the coordinator itself (process 0) is unreachable
                if stop.is_set():
                    return
                _die(EXIT_PEER_LOST, (
                    f"process {info.process_id} lost the job's coordinator (process 0, "
                    f"{info.coordinator_address}): {str(e).splitlines()[0][:200]}. Process 0 "
                    "died or stopped answering; this process stops too. Fix: read process 0's "
                    "log for its error, then restart every process (resume from the last "
                    "checkpoint with autopar.restore_checkpoint)."))
            gone = [p for p in everyone if p not in live]
            if gone and not stop.is_set():
                _die(EXIT_PEER_LOST, (
                    f"process {info.process_id}: process(es) {gone} of the job stopped "
                    f"answering (no heartbeat for {heartbeat_timeout_s:.0f} s); this process "
                    "stops too instead of waiting forever in a collective. Fix: read the log of "
                    f"process {gone[0]} for its error, then restart every process (resume from "
                    "the last checkpoint with autopar.restore_checkpoint)."))

    atexit.register(stop.set)     # registered after JAX's shutdown hook, so it runs first
    threading.Thread(target=watch, name="autopar-watchdog", daemon=True).start()

    def excepthook(kind, error, tb):
        """A runtime error in a transfer or collective usually means another process died:
        wait (up to the heartbeat time-out) for the coordination service to say which one,
        and say so, instead of JAX's abort at shutdown."""
        previous(kind, error, tb)
        if "JaxRuntimeError" not in kind.__name__:
            return
        deadline = time.monotonic() + heartbeat_timeout_s + 5
        while time.monotonic() < deadline:
            try:
                gone = [p for p in everyone if p not in set(client.get_live_nodes(everyone))]
            except Exception:
                gone = [0]
            if gone:
                stop.set()
                _die(EXIT_PEER_LOST, (
                    f"process {info.process_id} failed (above) because process(es) {gone} of "
                    "the job died or stopped answering. Fix: read the log of process "
                    f"{gone[0]} for its error, then restart every process (resume from the last "
                    "checkpoint with autopar.restore_checkpoint)."))
            time.sleep(period)

    previous = sys.excepthook
    sys.excepthook = excepthook


def to_host(tree):
    """Every leaf of `tree` as a numpy array on every process, wherever the plan left it (a
    pipeline's loss lives on the last stage's devices, which may all be on another process).
    Every process must call it, in the same order.

    Example:
        >>> state, loss = step(state, batch)
        >>> print(float(autopar.to_host(loss)))   # on every process
    """
    import jax
    import numpy as np
    if jax.process_count() == 1:
        return jax.tree_util.tree_map(np.asarray, tree)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    keep: list = []          # what other processes copy from must outlive their copies
    readable = [_replica(x, keep) for x in leaves]
    values = [np.asarray(r.addressable_data(0)) if isinstance(r, jax.Array) else r
              for r in readable]
    # Every process calls to_host in the same order, so the n-th call is one barrier.
    _client().wait_at_barrier(f"autopar/to_host/{next(_TO_HOST_CALLS)}",
                              int(_PLAN_WAIT_S * 1000))
    return jax.tree_util.tree_unflatten(treedef, values)


def _replica(x, keep: list):
    """A fully replicated array with a replica on this process (or x as numpy). Processes
    that hold a replica read it; each other process gets a single-device copy from the first
    holder (every process takes part in every copy, whether x is addressable here or not)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    if not isinstance(x, jax.Array):
        return np.asarray(x)
    on = lambda devs: NamedSharding(Mesh(np.array(devs, dtype=object), ("d",)), PartitionSpec())
    held = sorted(x.sharding.device_set, key=lambda d: (d.process_index, d.id))
    if not x.is_fully_replicated:
        # A reshard is a collective; waiting on each keeps a many-leaf tree from enqueueing
        # more than the CPU runtime can hold in flight (it hangs past ~32, see JAX_NOTES).
        x = jax.device_put(x, on(held)).block_until_ready()
    holders = {d.process_index for d in held}
    me, source = jax.process_index(), held[0]
    first = {}
    for dev in jax.devices():
        first.setdefault(dev.process_index, dev)
    missing = [(p, dev) for p, dev in sorted(first.items()) if p not in holders]
    mine = x if me in holders else None
    if missing:
        local = [s.data for s in x.addressable_shards if s.device == source]
        one = jax.make_array_from_single_device_arrays(x.shape, on([source]), local,
                                                       dtype=x.dtype)
        keep += [x, one]
        for p, dev in missing:
            copy = jax.device_put(one, on([dev]))
            if p == me:
                mine = copy
    return mine

# How many times this process has used each coordination key: every process runs the same
# sequence of shares and agreements (SPMD), so the n-th use of a key is the same round on
# every process, and a round never reads what an earlier one with the same key left in the
# coordination service's store (a re-plan of the same step with another method would read
# the last plan's digests: a false mismatch, or a false agreement).
_ROUNDS: collections.Counter = collections.Counter()


def _round(name: str) -> str:
    _ROUNDS[name] += 1
    return f"{name}/{_ROUNDS[name]}"


def share_from_first(key: str, produce: Callable[[], str]) -> tuple[str, bool]:
    """Process 0 computes `produce()` and every process gets its result: (text, whether this
    process computed it). One process: just `produce()`. Every process must call it with the
    same key, in the same order."""
    import jax
    if jax.process_count() == 1:
        return produce(), True
    client = _client()
    name = _round(f"autopar/share/{key}")
    if jax.process_index() == 0:
        text = produce()
        client.key_value_set(name, text, allow_overwrite=True)
        return text, True
    log.info("autopar: process %d waiting for process 0's plan", jax.process_index())
    return client.blocking_key_value_get(name, int(_PLAN_WAIT_S * 1000)), False


def check_agreement(key: str, text: str, what: str) -> None:
    """Raise `PlanMismatchError` unless every process passes the same `text` (compared by
    digest) for `key`: e.g. the shardings each process lowered its plan to."""
    import jax
    if jax.process_count() == 1:
        return
    client = _client()
    mine = hashlib.sha256(text.encode()).hexdigest()[:16]
    name = _round(f"autopar/agree/{key}")
    client.key_value_set(f"{name}/{jax.process_index()}", mine, allow_overwrite=True)
    digests = {p: client.blocking_key_value_get(f"{name}/{p}", int(_PLAN_WAIT_S * 1000))
               for p in range(jax.process_count())}
    if len(set(digests.values())) > 1:
        raise PlanMismatchError(
            f"the processes of this job lowered different {what} (digest per process: "
            f"{digests}); running them would hang or give wrong results. This happens when "
            "the processes see different arguments, autopar or JAX versions, or when a solver "
            "time limit cut a search short differently. Fix: run the same code and versions "
            "on every host, pass identical arguments, or pass a saved plan "
            "(parallelize(..., plan=ParallelPlan.from_json(text))).")
