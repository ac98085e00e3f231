"""A persistent on-disk cache of `ParallelPlan`s, so a step planned once is not searched again.

An entry is one JSON file `plan-<key>.json` in the cache directory: a small header (cache format,
autopar / jax / jaxlib versions, the key, when it was written) and the plan. `cache_key` hashes
everything a plan depends on (the traced graph, the abstract arguments, the cluster, the method,
the mesh, the device ids and the library versions, with a digest of autopar's own source), so
a change to any of them is a miss.

Writes are atomic (a temporary file in the same directory, fsync, `os.replace`): two processes
writing the same key leave one complete entry, never a mixed or partial one, and a reader sees
the old entry or the new one. A bad entry (truncated, not JSON, for another key, of another
format or library version, or not a plan) is never an error: `get` logs a warning naming the
file and the reason, moves the file aside to `plan-<key>.json.bad`, and returns None, so the plan
is rebuilt. An unwritable cache directory is warned about once and otherwise ignored.

Example:
    >>> cache = PlanCache()                        # $AUTOPAR_CACHE_DIR or ~/.cache/autopar/plans
    >>> key = cache_key(graph_fingerprint=fp, args_signature=sig, cluster=cluster,
    ...                 method=method, mesh_shape=(2, 4), axis_names=("data", "model"),
    ...                 device_ids=tuple(range(8)))
    >>> plan = cache.get(key)                      # None on a miss
    >>> if plan is None:
    ...     plan = make_plan()
    ...     cache.put(key, plan)
"""
from __future__ import annotations

import dataclasses
import datetime
import enum
import functools
import hashlib
import json
import logging
import os
import re
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from autopar.core import progress
from autopar.core._format import mesh_text
from autopar.core.errors import InvalidArgumentError
from autopar.core.plan import ParallelPlan, stamped

log = logging.getLogger(__name__)

FORMAT = "autopar-plan-cache"
VERSION = 2          # 2: plans carry `reshards`, which the lowering follows
_KEY = re.compile(r"[A-Za-z0-9_-]{1,128}")
_PREFIX, _SUFFIX, _BAD_SUFFIX, _TMP_SUFFIX = "plan-", ".json", ".json.bad", ".tmp"


# -- keys ------------------------------------------------------------------------------------

def _package_version(name: str) -> str:
    """The installed version of `name`, else its module's `__version__`, else "unknown"."""
    import importlib
    import importlib.metadata
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        return str(getattr(importlib.import_module(name), "__version__", "unknown"))
    except ImportError:
        return "unknown"


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """A digest of autopar's own source files: a plan is only as good as the code (cost model,
    memory model, search) that made it, and a checkout or an editable install changes that
    code without changing the version number.

    Example:
        >>> len(source_digest())
        16
    """
    root = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def library_versions() -> dict[str, str]:
    """The versions a cached plan is tied to: autopar's (and its source's digest), jax's and
    jaxlib's.

    Example:
        >>> library_versions()
        {'autopar': '0.1.0', 'autopar_source': '3f2a...', 'jax': '0.10.2', 'jaxlib': '0.10.2'}
    """
    versions = {name: _package_version(name) for name in ("autopar", "jax", "jaxlib")}
    return {"autopar": versions["autopar"], "autopar_source": source_digest(),
            "jax": versions["jax"], "jaxlib": versions["jaxlib"]}


def canonical_text(value: Any) -> str:
    """A text for `value` that is the same in every process: None, bools, ints, floats (repr),
    strings, enums (by class and member name), tuples, lists, dicts and sets (sorted), numpy
    scalars, and dataclasses (class name and every field, recursively). Anything else (whose
    repr may hold an address) raises `InvalidArgumentError`.

    Example:
        >>> canonical_text(autopar.AutoLayerOption(num_layers=2))
        'AutoLayerOption(num_layers=2,imbalance=0.25)'
    """
    if isinstance(value, enum.Enum):
        return f"{type(value).__qualname__}.{value.name}"
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = ",".join(f"{f.name}={canonical_text(getattr(value, f.name))}"
                          for f in dataclasses.fields(value))
        return f"{type(value).__qualname__}({fields})"
    if isinstance(value, (tuple, list)):
        inner = ",".join(canonical_text(v) for v in value)
        return f"({inner})" if isinstance(value, tuple) else f"[{inner}]"
    if isinstance(value, dict):
        items = sorted(f"{canonical_text(k)}:{canonical_text(v)}" for k, v in value.items())
        return "{" + ",".join(items) + "}"
    if isinstance(value, (set, frozenset)):
        return "set(" + ",".join(sorted(canonical_text(v) for v in value)) + ")"
    if hasattr(value, "item") and hasattr(value, "dtype") and getattr(value, "ndim", 1) == 0:
        return canonical_text(value.item())       # a numpy scalar
    raise InvalidArgumentError(
        f"cannot make a plan cache key from {value!r} of type {type(value).__qualname__}: its "
        "text may differ between processes. Fix: use plain values (numbers, strings, enums, "
        "tuples, frozen dataclasses of them) in the method and cluster, or pass "
        "plan_cache=None.")


def cache_key(*, graph_fingerprint: str, args_signature: str, cluster: Any, method: Any,
              mesh_shape: Sequence[int], axis_names: Sequence[str],
              device_ids: Sequence[int], extra: str = "") -> str:
    """The sha256 hex digest naming the plan for these inputs under this autopar, jax and
    jaxlib (see `library_versions`) and this cache format. `cluster` is a `ClusterSpec` and
    `method` an options dataclass (`ShardParallel`, `PipeshardParallel`, ...); both enter
    through `canonical_text`. Sequences are normalized, so a list and a tuple give one key.

    Example:
        >>> key = cache_key(graph_fingerprint="3f2a...", args_signature="f32[32,8] f32[32,16]",
        ...                 cluster=autopar.ClusterSpec.preset("dgx-a100"),
        ...                 method=autopar.ShardParallel(), mesh_shape=(1, 8),
        ...                 axis_names=("data", "model"), device_ids=range(8))
        >>> len(key)
        64
    """
    parts = {
        "cache": f"{FORMAT}/{VERSION}",
        "versions": canonical_text(library_versions()),
        "graph": str(graph_fingerprint),
        "args": str(args_signature),
        "cluster": canonical_text(cluster),
        "method": canonical_text(method),
        "mesh_shape": canonical_text(tuple(int(n) for n in mesh_shape)),
        "axis_names": canonical_text(tuple(str(a) for a in axis_names)),
        "device_ids": canonical_text(tuple(int(d) for d in device_ids)),
        "extra": str(extra),
    }
    text = "".join(f"{name}={len(v)}:{v}\n" for name, v in parts.items())
    return hashlib.sha256(text.encode()).hexdigest()


def default_cache_dir() -> Path:
    """$AUTOPAR_CACHE_DIR, else $XDG_CACHE_HOME/autopar/plans, else ~/.cache/autopar/plans
    (next to `cost.profiler.default_cache_dir()`'s profiles, which also use $AUTOPAR_CACHE_DIR as
    is: entries are named `plan-<key>.json`, so the two can share it).

    Example:
        >>> os.environ["AUTOPAR_CACHE_DIR"] = "/scratch/autopar"; default_cache_dir()
        PosixPath('/scratch/autopar')
    """
    if os.environ.get("AUTOPAR_CACHE_DIR"):
        return Path(os.environ["AUTOPAR_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "autopar" / "plans"


ENV = "AUTOPAR_PLAN_CACHE"
_OFF_WORDS = ("0", "off", "false", "no")


def env_setting() -> tuple[str, bool]:
    """($AUTOPAR_PLAN_CACHE as set, "" when unset; whether it turns the cache off: 0, off,
    false or no, in any case). A directory there is where `parallelize(plan_cache=True)` and
    `autopar cache` look.

    Example:
        >>> os.environ["AUTOPAR_PLAN_CACHE"] = "OFF"; env_setting()
        ('OFF', True)
    """
    text = os.environ.get(ENV, "")
    return text, text.lower() in _OFF_WORDS


# -- the cache -------------------------------------------------------------------------------

class _BadEntry(Exception):
    """Why a cache file cannot be used (caught inside `PlanCache.get`)."""


class PlanCache:
    """Plans on disk, one `plan-<key>.json` per key in `directory` (default `default_cache_dir()`).

    `get` never raises for a bad entry and `put` never raises for an unwritable directory: a
    cache problem costs a re-plan, not the user's run. Safe to share between processes.

    Example:
        >>> cache = PlanCache("/tmp/plans")
        >>> cache.put(key, plan)
        PosixPath('/tmp/plans/plan-<key>.json')
        >>> cache.get(key) == plan
        True
    """

    def __init__(self, directory: str | os.PathLike | None = None):
        self.directory = Path(directory) if directory is not None else default_cache_dir()
        self._warned_unwritable = False

    def __repr__(self) -> str:
        return f"PlanCache({str(self.directory)!r})"

    def path(self, key: str) -> Path:
        """The file holding `key`'s entry."""
        if not isinstance(key, str) or not _KEY.fullmatch(key):
            raise InvalidArgumentError(
                f"plan cache key {key!r} must be 1-128 letters, digits, '_' or '-' (it names a "
                "file). Fix: use autopar.tools.plan_cache.cache_key(...).")
        return self.directory / f"{_PREFIX}{key}{_SUFFIX}"

    def get(self, key: str) -> ParallelPlan | None:
        """The plan stored under `key`, or None on a miss or a bad entry (logged, moved aside)."""
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                data, stat = f.read(), os.fstat(f.fileno())
        except (FileNotFoundError, NotADirectoryError):
            log.debug("plan cache miss: no %s", path)
            return None
        except OSError as e:
            log.warning("plan cache entry %s could not be read (%s); ignored; the plan will be "
                        "rebuilt.", path, e)
            return None
        try:
            plan = _decode(data, key)
        except _BadEntry as e:
            aside = self._move_aside(path, stat)
            log.warning("plan cache entry %s ignored; it will be rebuilt: %s.%s", path, e,
                        f" Moved to {aside}." if aside else "")
            return None
        log.debug("plan cache hit: %s", path)
        return plan

    def put(self, key: str, plan: ParallelPlan) -> Path | None:
        """Store `plan` under `key` atomically and return its file; None (with a warning the
        first time) when the directory cannot be written."""
        path = self.path(key)
        if not isinstance(plan, ParallelPlan):
            raise InvalidArgumentError(f"PlanCache.put stores a ParallelPlan, got "
                                       f"{type(plan).__qualname__}.")
        try:
            data = _encode(key, plan)
        except (TypeError, ValueError) as e:      # a value JSON cannot hold, in a dict field
            log.warning("plan cache: the plan for key %s cannot be written as JSON (%s); it is "
                        "not cached.", key, e)
            return None
        tmp = None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{_PREFIX}{key}.",
                                       suffix=_TMP_SUFFIX)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            tmp = None
            _fsync_directory(self.directory)
        except OSError as e:
            self._unwritable(e)
            return None
        finally:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
        log.debug("plan cache stored %s", path)
        return path

    def entries(self) -> dict[str, Path]:
        """{key: file} of the stored entries, sorted by key."""
        found = {_key_of(p.name, _SUFFIX): p for p in self._files()}
        return {k: found[k] for k in sorted(k for k in found if k is not None)}

    def clear(self) -> int:
        """Delete every entry, moved-aside entry and leftover temporary file; returns how many
        files were deleted. Other files in the directory are left alone."""
        removed = 0
        for p in self._files():
            try:
                p.unlink()
                removed += 1
            except FileNotFoundError:
                pass
        return removed

    def describe(self) -> list[EntryInfo]:
        """One `EntryInfo` per stored or moved-aside entry, sorted by key (`autopar cache ls`).
        Reading never moves or deletes anything.

        Example:
            >>> [(e.key[:12], e.method, e.mesh, e.problem) for e in PlanCache().describe()]
            [('3f2a9c0d1e2b', 'shard_parallel', 'data=2 x model=8', '')]
        """
        out = []
        for path in self._files():
            key = _key_of(path.name, _SUFFIX) or _key_of(path.name, _BAD_SUFFIX)
            if key is not None:
                out.append(_entry_info(key, path, aside=path.name.endswith(_BAD_SUFFIX)))
        return sorted(out, key=lambda e: (e.key, e.path.name))

    def _files(self) -> list[Path]:
        """This cache's files (`plan-<key>.json`, `plan-<key>.json.bad`,
        `.plan-<key>.*.tmp`), and no others, so the directory can be shared."""
        try:
            names = os.listdir(self.directory)
        except OSError:
            return []
        return [self.directory / name for name in sorted(names)
                if _key_of(name, _SUFFIX) or _key_of(name, _BAD_SUFFIX)
                or (name.startswith(".") and name.endswith(_TMP_SUFFIX)
                    and _key_of(name[1:].split(".", 1)[0] + _SUFFIX, _SUFFIX))]

    def _move_aside(self, path: Path, stat: os.stat_result) -> Path | None:
        """Rename a bad entry to `<key>.json.bad`, unless a writer has replaced it since it was
        read (then the new file is left for the next `get`)."""
        try:
            now = os.stat(path)
            if (now.st_ino, now.st_dev, now.st_mtime_ns) != \
                    (stat.st_ino, stat.st_dev, stat.st_mtime_ns):
                return None
            aside = path.with_name(path.stem + _BAD_SUFFIX)
            os.replace(path, aside)
            return aside
        except OSError:
            return None

    def _unwritable(self, error: OSError) -> None:
        if self._warned_unwritable:
            log.debug("plan cache %s not writable: %s", self.directory, error)
            return
        self._warned_unwritable = True
        log.warning("plan cache directory %s is not writable (%s); plans will not be cached. "
                    "Fix: set AUTOPAR_CACHE_DIR to a writable directory, or pass "
                    "plan_cache=None.", self.directory, error)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class EntryInfo:
    """What `PlanCache.describe` reads from one entry file."""
    key: str
    path: Path
    size_bytes: int
    modified: float              # the file's mtime (seconds since the epoch)
    created_utc: str = ""        # when the entry was written
    method: str = ""
    mesh: str = ""               # e.g. "data=2 x model=8"
    cluster: str = ""
    searched_at: str = ""        # when the search that made the plan ran
    versions: tuple[tuple[str, str], ...] = ()   # (library, version) it was written under
    problem: str = ""            # why `get` would not use it ("" = usable by this autopar)


def _entry_info(key: str, path: Path, *, aside: bool) -> EntryInfo:
    try:
        stat = path.stat()
        data = path.read_bytes()
    except OSError as e:
        return EntryInfo(key=key, path=path, size_bytes=0, modified=0.0,
                         problem=f"unreadable ({e})")
    base = dict(key=key, path=path, size_bytes=stat.st_size, modified=stat.st_mtime)
    try:
        d = json.loads(data.decode())
        plan = d["plan"]
        base.update(created_utc=str(d.get("created_utc", "")), method=str(plan["method"]),
                    mesh=mesh_text(plan["axis_names"], plan["mesh_shape"]),
                    cluster=str(plan.get("cluster", "")),
                    searched_at=str(plan.get("searched_at", "")),
                    versions=tuple((k, str(d[k])) for k in library_versions() if k in d))
    except (UnicodeDecodeError, ValueError, KeyError, TypeError):
        pass                            # _decode below says why
    if aside:
        return EntryInfo(**base, problem="moved aside as bad (get ignores it)")
    try:
        _decode(data, key)
    except _BadEntry as e:
        return EntryInfo(**base, problem=str(e))
    return EntryInfo(**base)


def _key_of(name: str, suffix: str) -> str | None:
    """The key of a file named `plan-<key><suffix>`, else None."""
    if name.startswith(_PREFIX) and name.endswith(suffix):
        key = name[len(_PREFIX):-len(suffix)]
        if _KEY.fullmatch(key):
            return key
    return None


def _fsync_directory(directory: Path) -> None:
    """Make the rename durable where the platform allows it (best effort)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _header(key: str) -> dict:
    return {"format": FORMAT, "version": VERSION, **library_versions(), "key": key,
            "created_utc": datetime.datetime.now(datetime.UTC).isoformat()}


def _encode(key: str, plan: ParallelPlan) -> bytes:
    entry = {**_header(key), "plan": json.loads(plan.to_json(indent=None))}
    return (json.dumps(entry, indent=1) + "\n").encode()


def _decode(data: bytes, key: str) -> ParallelPlan:
    """The plan in one entry file's bytes; `_BadEntry` says why there is none."""
    if not data:
        raise _BadEntry("the file is empty")
    try:
        d = json.loads(data.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _BadEntry(f"not valid JSON ({e}); truncated or overwritten?") from None
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        found = d.get("format") if isinstance(d, dict) else type(d).__name__
        raise _BadEntry(f"not a plan cache entry (format {found!r}, expected {FORMAT!r})")
    if d.get("version") != VERSION:
        raise _BadEntry(f"cache format version {d.get('version')!r}; this autopar reads "
                        f"version {VERSION}")
    if d.get("key") != key:
        raise _BadEntry(f"it holds key {d.get('key')!r}, not its file name's key")
    now = library_versions()
    stale = [f"{name} {d.get(name)!r} (now {now[name]!r})" for name in now
             if d.get(name) != now[name]]
    if stale:
        raise _BadEntry("written by another version: " + ", ".join(stale))
    try:
        return ParallelPlan.from_json(json.dumps(d.get("plan")))
    except Exception as e:   # PlanMismatchError, or a missing / malformed field
        raise _BadEntry(f"the plan does not load ({type(e).__name__}: {e})") from None


def find_plan(key: str, search: Callable[[], ParallelPlan],
              cache: PlanCache | None) -> ParallelPlan:
    """The plan for `key`. Process 0 reads the cache, else searches (and writes the cache); in
    a multi-process job every other process receives process 0's plan, so all of them run the
    same one. The plan's `origin` and `timings_s["plan_lookup"]` say where it came from and
    how long that took."""
    from autopar.runtime.distributed import share_from_first

    def produce() -> ParallelPlan:
        t0 = time.perf_counter()
        hit = cache.get(key) if cache is not None else None
        if hit is not None:
            log.info("autopar: plan cache hit (%s): the search is skipped",
                     cache.path(key))
            progress.note("plan cache", f"hit, no search (searched {hit.searched_at or '?'}; "
                          f"{cache.path(key)})", time.perf_counter() - t0)
            return dataclasses.replace(hit, origin="plan cache", timings_s={
                **hit.timings_s, "plan_lookup": time.perf_counter() - t0})
        plan = stamped(search())
        if cache is not None and cache.put(key, plan) is not None:
            log.info("autopar: plan saved to the plan cache (%s)", cache.path(key))
        return plan

    import jax
    if jax.process_count() == 1:
        return produce()
    t0 = time.perf_counter()
    text, first = share_from_first(key, lambda: produce().to_json())
    plan = ParallelPlan.from_json(text)
    if first:
        return plan
    return dataclasses.replace(plan, origin=f"process 0 ({plan.origin})", timings_s={
        **plan.timings_s, "plan_lookup": time.perf_counter() - t0})
