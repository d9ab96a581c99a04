"""The host's book of one KV pool: which pages and which request slots are free.

A scheduler owns one (a DP scheduler one per rank). The worker only sizes the device pool
and the carry these ids index; page 0 and slot max_slots are its scratch, never handed out.
"""

from __future__ import annotations

from jspec.kvcache.allocator import PageAllocator


class KVManager:
    def __init__(self, num_pages: int, max_slots: int, page_size: int):
        self.allocator = PageAllocator(int(num_pages))
        self.page_size = page_size
        self.max_slots = max_slots
        self.free_slots = list(range(max_slots - 1, -1, -1))

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def alloc_slot(self) -> int:
        if not self.free_slots:
            raise RuntimeError(f"all {self.max_slots} request slots are in use")
        return self.free_slots.pop()

    def free_slot(self, slot: int) -> None:
        if slot in self.free_slots or not 0 <= slot < self.max_slots:
            raise ValueError(f"free of slot {slot}, which is not held")
        self.free_slots.append(slot)

    def check_no_leaks(self) -> None:
        """Raises unless every page and slot is back (call at idle, the prefix cache emptied)."""
        self.allocator.check_no_leaks()
        if len(self.free_slots) != self.max_slots:
            raise AssertionError(f"request slot leak: {self.max_slots - len(self.free_slots)} slots held")
