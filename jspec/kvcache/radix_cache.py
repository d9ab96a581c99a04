"""Prefix (radix) cache: requests that share a prompt prefix share its KV pages.

SGLang's RadixAttention: a radix tree over token ids whose nodes own whole KV pages (a
request's partial last page stays private). The cache holds one reference per page in the
tree; a request that matched a prefix locks it instead of holding references, and a locked
node is never evicted. Protocol: match_prefix, lock; on finish insert, free the request's own
pages, unlock (insert before free). docs/design-details.md has the protocol in full.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

from jspec.kvcache.allocator import PageAllocator


class _Node:
    """A run of whole pages. `key` holds its tokens (len(pages) * page_size)."""

    __slots__ = ("key", "pages", "children", "parent", "lock_ref", "last_access", "id")

    def __init__(self, key: tuple[int, ...], pages: list[int], parent: _Node | None, last_access: int, node_id: int):
        self.key = key
        self.pages = pages
        # Children are keyed by their first page of tokens: siblings differ there.
        self.children: dict[tuple[int, ...], _Node] = {}
        self.parent = parent
        # Number of live locks whose match ends in this node's subtree (itself
        # included), so a node is locked iff some running request reads it.
        self.lock_ref = 0
        self.last_access = last_access
        self.id = node_id  # tie-break in the eviction heap, deterministic


@dataclass
class PrefixMatch:
    """Longest cached page-aligned prefix: its length in tokens, its pages, and
    the tree node where it ends (the handle lock()/unlock() take)."""

    num_tokens: int
    pages: list[int]
    node: _Node


class RadixCache:
    """Radix tree of token ids whose nodes hold KV pages (see the module doc)."""

    def __init__(self, allocator: PageAllocator, page_size: int):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.allocator = allocator
        self.page_size = page_size
        self._clock = 0
        self._next_id = 1
        self._root = _Node((), [], None, 0, 0)
        self._num_cached = 0
        self._num_evictable = 0  # pages in nodes with lock_ref == 0
        self._cached = set()  # every page the tree holds, to refuse double adoption

    # ----------------------------------------------------------------- lookup

    def match_prefix(self, tokens: Sequence[int]) -> PrefixMatch:
        """Longest cached page-aligned prefix of `tokens`. Touches the matched
        nodes for LRU and may split one so the match ends on a node boundary
        (structure only: no reference count changes)."""
        node, pages = self._walk(self._as_key(tokens))
        return PrefixMatch(len(pages) * self.page_size, pages, node)

    def lock(self, match: PrefixMatch) -> None:
        """Pin the matched nodes (and their ancestors) against eviction."""
        node = match.node
        if node is not self._root and node.parent is None:
            raise ValueError("lock of a match whose pages were evicted: match again")
        while node is not self._root:
            if node.lock_ref == 0:
                self._num_evictable -= len(node.pages)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, match: PrefixMatch) -> None:
        node = match.node
        # lock_ref never decreases towards the root, so checking the end suffices.
        if node is not self._root and node.lock_ref <= 0:
            raise ValueError("unlock of a match that is not locked")
        while node is not self._root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._num_evictable += len(node.pages)
            node = node.parent

    # ----------------------------------------------------------------- insert

    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> int:
        """Offer the full pages of `tokens` (pages[i] holds tokens
        [i*page_size, (i+1)*page_size)); extra pages (a partial last one,
        over-allocation) are ignored. Returns how many leading full pages the
        cache already had; it retains (allocator.retain) the ones after those,
        which it adopts. The caller keeps its own references either way."""
        key = self._as_key(tokens)
        n_full = len(key) // self.page_size
        if len(pages) < n_full:
            raise ValueError(f"{len(key)} tokens need {n_full} full pages, got {len(pages)}")
        key = key[: n_full * self.page_size]
        node, cached = self._walk(key)
        n_cached = len(cached)
        new = [int(p) for p in pages[n_cached:n_full]]
        if new:
            # Refuse before touching counts: a page held twice by the tree
            # would be freed twice by eviction.
            bad = [p for p in new if p in self._cached or p == PageAllocator.SCRATCH_PAGE]
            if bad or len(set(new)) != len(new):
                raise ValueError(f"insert of pages already cached, repeated or scratch: {bad or new}")
            self.allocator.retain(new)
            start = n_cached * self.page_size
            child = _Node(key[start:], new, node, self._clock, self._new_id())
            node.children[key[start : start + self.page_size]] = child
            self._num_cached += len(new)
            self._num_evictable += len(new)
            self._cached.update(new)
        return n_cached

    # --------------------------------------------------------------- eviction

    def evict(self, num_pages: int) -> int:
        """Drop least-recently-used unlocked leaves until `num_pages` pages went
        back to the allocator's free list, or nothing evictable is left.
        Returns how many pages went back (may exceed num_pages: whole nodes go)."""
        return self._evict(num_pages) if num_pages > 0 else 0

    def reset(self) -> int:
        """Drop every unlocked node (locked ones stay, their requests read them).
        Returns the pages that went back to the free list."""
        return self._evict(math.inf)

    def evictable_pages(self) -> int:
        """Pages in unlocked nodes: what evict() can free when no request holds
        references of its own on cached pages (the protocol's steady state)."""
        return self._num_evictable

    def cached_pages(self) -> int:
        return self._num_cached

    def check_invariants(self) -> None:
        """Raises AssertionError if the tree's bookkeeping is inconsistent (tests, debugging)."""
        ps = self.page_size
        seen: list[int] = []
        evictable = 0
        stack = [self._root]
        while stack:
            node = stack.pop()
            child_locks = 0
            for first, child in node.children.items():
                assert child.parent is node and child.pages, "broken parent link or empty node"
                assert len(child.key) == len(child.pages) * ps and child.key[:ps] == first
                # A walk touches a child together with its ancestors.
                assert node is self._root or child.last_access <= node.last_access
                child_locks += child.lock_ref
                stack.append(child)
            if node is not self._root:
                assert node.lock_ref >= child_locks >= 0, "lock_ref below its subtree's"
                seen.extend(node.pages)
                evictable += len(node.pages) if node.lock_ref == 0 else 0
        assert len(seen) == len(set(seen)) == self._num_cached, "page held twice by the tree"
        assert set(seen) == self._cached
        assert evictable == self._num_evictable, (evictable, self._num_evictable)

    # -------------------------------------------------------------- internals

    def _as_key(self, tokens: Sequence[int]) -> tuple[int, ...]:
        return tuple(int(t) for t in tokens)

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def _walk(self, key: tuple[int, ...]) -> tuple[_Node, list[int]]:
        """Follow `key` down the tree, page by page, splitting the last node if
        the key leaves it midway; touch every node on the path. Returns the
        deepest node reached and the pages along the way."""
        ps = self.page_size
        self._clock += 1
        node, pages, pos = self._root, [], 0
        while len(key) - pos >= ps:
            child = node.children.get(key[pos : pos + ps])
            if child is None:
                break
            n = self._common_pages(child.key, key, pos)  # >= 1: first page matched
            if n < len(child.pages):
                child = self._split(child, n)
            child.last_access = self._clock
            pages.extend(child.pages)
            pos += n * ps
            node = child
        return node, pages

    def _common_pages(self, node_key: tuple[int, ...], key: tuple[int, ...], pos: int) -> int:
        ps = self.page_size
        limit = min(len(node_key), len(key) - pos) // ps
        if node_key[: limit * ps] == key[pos : pos + limit * ps]:
            return limit  # common case: the whole overlap matches, one C compare
        n = 0
        while node_key[n * ps : (n + 1) * ps] == key[pos + n * ps : pos + (n + 1) * ps]:
            n += 1
        return n

    def _split(self, node: _Node, n: int) -> _Node:
        """Cut `node` after its first n pages. The head becomes a new parent;
        `node` keeps the tail, so handles to it (locks) still end where they did.
        The head's subtree equals the old node's, so it inherits lock_ref and
        recency as they are; no count changes."""
        ps = self.page_size
        head = _Node(node.key[: n * ps], node.pages[:n], node.parent, node.last_access, self._new_id())
        head.lock_ref = node.lock_ref
        head.children[node.key[n * ps : (n + 1) * ps]] = node
        node.parent.children[node.key[:ps]] = head
        node.key = node.key[n * ps :]
        node.pages = node.pages[n:]
        node.parent = head
        return head

    def _evict(self, limit: float) -> int:
        leaves = []
        stack = [self._root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if not node.children and node is not self._root and node.lock_ref == 0:
                leaves.append((node.last_access, node.id, node))
        heapq.heapify(leaves)
        freed = 0
        while freed < limit and leaves:
            _, _, node = heapq.heappop(leaves)
            parent = node.parent
            before = self.allocator.num_free
            # Only the cache's reference goes; a request still holding its own
            # keeps the page alive, so count what actually reached the free list.
            self.allocator.free(node.pages)
            freed += self.allocator.num_free - before
            del parent.children[node.key[: self.page_size]]
            node.parent = None  # marks stale handles
            self._num_cached -= len(node.pages)
            self._num_evictable -= len(node.pages)
            self._cached.difference_update(node.pages)
            # Its parent may just have become an evictable leaf.
            if parent is not self._root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(leaves, (parent.last_access, parent.id, parent))
        return freed
