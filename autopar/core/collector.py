"""Python's cyclic garbage collector while autopar plans: no full collections.

Planning holds hundreds of thousands of long-lived objects (the traced graph, the ILPs'
strategies, the stage search's cached layer plans), and CPython's full (generation 2)
collection walks every one of them each time the long-lived objects grew by a quarter: on
GPT-39B's stage search (8 auto layers, 1024 microbatches) 19 full collections took 7.7 s of
49 s. Inside `no_full_collections()` the young generations are still collected (the cycles
that tracing and solving make die young), but a full collection waits until the block ends,
when the thresholds the process had are put back; garbage that reached the oldest generation
in between is freed by the next full collection after it.

    >>> with no_full_collections():
    ...     plan = search()

Nested blocks and blocks in several threads keep the setting until the last one ends; a
process whose own third threshold is already at least `FULL_EVERY` is left as it is.
"""
from __future__ import annotations

import contextlib
import gc
import threading

FULL_EVERY = 1_000_000      # generation-1 collections between full ones inside a block

_lock = threading.Lock()
_depth = 0
_saved: tuple[int, ...] | None = None


@contextlib.contextmanager
def no_full_collections():
    """Defer CPython's full garbage collections to the end of the block (see the module)."""
    global _depth, _saved
    with _lock:
        if _depth == 0:
            threshold = gc.get_threshold()
            if threshold[2] < FULL_EVERY:
                _saved = threshold
                gc.set_threshold(threshold[0], threshold[1], FULL_EVERY)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _saved is not None:
                # put back only what this module set (the user may have changed it since)
                if gc.get_threshold()[2] == FULL_EVERY:
                    gc.set_threshold(*_saved)
                _saved = None


__all__ = ["FULL_EVERY", "no_full_collections"]
