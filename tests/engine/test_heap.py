"""A serving process's start-up heap, frozen out of Python's collections (engine/heap.py)."""

import gc
import logging

from jspec.engine import heap
from jspec.engine.heap import GcPauses, serving_gc_pauses, settle_heap


def test_settle_heap_freezes_the_live_objects_out_of_collections(caplog, monkeypatch):
    monkeypatch.setattr(heap, "_SERVING_PAUSES", None)  # as in a process that has not settled yet
    gc.unfreeze()
    gc.disable()  # only the collections this test asks for
    try:
        with caplog.at_level(logging.INFO, logger="jspec.engine"):
            settle_heap("test process", freeze=True)
        assert gc.get_freeze_count() > 1000  # this process's modules, at the least
        assert "test process: " in caplog.text and "frozen out of Python's collections" in caplog.text
        with GcPauses() as pauses:
            gc.collect()
        assert pauses.count == [0, 0, 1] and pauses.max_ms[2] == pauses.total_ms[2] > 0
        # The process's own count (the engine's stats) saw it too.
        assert serving_gc_pauses().count == [0, 0, 1]
    finally:
        serving_gc_pauses().__exit__()
        gc.enable()
        gc.unfreeze()  # the rest of the suite runs with Python's default


def test_gc_pauses_counts_each_generation_and_stops_when_left():
    gc.disable()
    try:
        with GcPauses() as pauses:
            gc.collect(0)
            gc.collect(1)
        gc.collect(0)  # after the block: not counted
    finally:
        gc.enable()
    assert pauses.count == [1, 1, 0]
    assert all(total >= longest >= 0 for total, longest in zip(pauses.total_ms, pauses.max_ms))
