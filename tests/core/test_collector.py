"""`no_full_collections`: full collections wait for the end of the block; the process's
thresholds come back."""
import gc

from autopar.core.collector import FULL_EVERY, no_full_collections


def _full_collections(work) -> int:
    seen = []

    def count(phase, info):
        if phase == "start" and info["generation"] == 2:
            seen.append(1)
    gc.callbacks.append(count)
    try:
        work()
    finally:
        gc.callbacks.remove(count)
    return len(seen)


def _grow():
    """Enough long-lived containers that CPython's default thresholds collect in full: a full
    collection waits until the long-lived objects grew by a quarter, so half the heap more."""
    keep = [[i] for i in range(max(300_000, len(gc.get_objects()) // 2))]
    return len(keep)


def test_the_block_defers_full_collections_and_restores_the_thresholds():
    before = gc.get_threshold()
    assert _full_collections(_grow) > 0        # the default thresholds: full collections run
    with no_full_collections():
        assert gc.get_threshold() == (before[0], before[1], FULL_EVERY)
        assert _full_collections(_grow) == 0
        with no_full_collections():            # nested: still deferred, not restored early
            pass
        assert gc.get_threshold()[2] == FULL_EVERY
    assert gc.get_threshold() == before


def test_the_block_restores_after_an_error_and_leaves_a_users_setting():
    before = gc.get_threshold()
    try:
        with no_full_collections():
            raise ValueError("planning failed")
    except ValueError:
        pass
    assert gc.get_threshold() == before
    gc.set_threshold(before[0], before[1], 2 * FULL_EVERY)    # the user's own setting
    try:
        with no_full_collections():
            assert gc.get_threshold()[2] == 2 * FULL_EVERY
        assert gc.get_threshold()[2] == 2 * FULL_EVERY
    finally:
        gc.set_threshold(*before)
