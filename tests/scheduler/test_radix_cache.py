"""Prefix (radix) cache: hand-made cases, eviction order, and a randomized
model-based test that checks every page's reference count after every step."""

import random
from collections import Counter

import numpy as np
import pytest

from jspec.kvcache.allocator import PageAllocator
from jspec.kvcache.radix_cache import RadixCache


def tree(cache):
    """{page-aligned prefix: (page, last_access, lock_ref)} for every cached page."""
    out = {}
    stack = [(cache._root, ())]
    while stack:
        node, prefix = stack.pop()
        for child in node.children.values():
            p = prefix
            for i, page in enumerate(child.pages):
                p = p + child.key[i * cache.page_size : (i + 1) * cache.page_size]
                out[p] = (page, child.last_access, child.lock_ref)
            stack.append((child, p))
    return out


def num_nodes(cache):
    n, stack = 0, [cache._root]
    while stack:
        node = stack.pop()
        n += len(node.children)
        stack.extend(node.children.values())
    return n


def finish(cache, alloc, tokens, table, own, match):
    """The protocol's finish step."""
    n = cache.insert(tokens, table)
    alloc.free(own)
    cache.unlock(match)
    return n


# ------------------------------------------------------------ hand-made cases


def test_page_size_1_match_insert_split():
    a = PageAllocator(32)
    c = RadixCache(a, page_size=1)
    assert c.match_prefix([1, 2, 3]).num_tokens == 0
    own = a.alloc(4)
    assert c.insert([1, 2, 3, 4], own) == 0
    a.free(own)
    assert c.cached_pages() == 4 and a.num_free == 31 - 4

    m = c.match_prefix([1, 2, 3, 9])  # diverges inside the node: split it
    assert (m.num_tokens, m.pages) == (3, own[:3])
    assert num_nodes(c) == 2
    c.check_invariants()

    # A second sequence sharing [1, 2, 3]: only its tail is adopted.
    m = c.match_prefix([1, 2, 3, 9, 9])
    c.lock(m)
    own2 = a.alloc(2)
    assert finish(c, a, [1, 2, 3, 9, 9], m.pages + own2, own2, m) == 3
    assert c.match_prefix([1, 2, 3, 9, 9, 7]).pages == own[:3] + own2
    assert c.match_prefix([1, 2, 3, 4, 5]).pages == own
    assert c.match_prefix([2, 3]).num_tokens == 0
    assert c.match_prefix([]).num_tokens == 0
    assert num_nodes(c) == 3 and c.cached_pages() == 6
    c.check_invariants()

    # Inserting a prefix of a cached sequence adopts nothing (and splits).
    dup = a.alloc(2)
    assert c.insert(np.array([1, 2], np.int32), dup) == 2
    a.free(dup)
    assert c.cached_pages() == 6 and num_nodes(c) == 4
    assert c.match_prefix(np.array([1, 2, 7])).pages == own[:2]
    c.check_invariants()
    assert c.reset() == 6
    a.check_no_leaks()


def test_page_size_4_partial_page_never_shared():
    a = PageAllocator(16)
    c = RadixCache(a, page_size=4)
    toks = list(range(100, 110))  # 10 tokens: 2 full pages + a partial one
    m = c.match_prefix(toks[:-1])
    c.lock(m)
    own = a.alloc(3)
    assert finish(c, a, toks, own, own, m) == 0
    assert c.cached_pages() == 2
    assert a.num_free == 15 - 2  # the partial page went back to the pool

    assert c.match_prefix(toks).num_tokens == 8
    assert c.match_prefix(toks + [1, 2, 3]).num_tokens == 8
    assert c.match_prefix(toks[:7]).pages == own[:1]  # 7 tokens: 1 full page
    assert c.match_prefix(toks[:3]).num_tokens == 0  # less than a page
    # A difference in the last token of page 1 loses all of page 1.
    m = c.match_prefix(toks[:7] + [0])
    assert (m.num_tokens, m.pages) == (4, own[:1])
    assert num_nodes(c) == 2  # split at the page boundary
    c.check_invariants()

    # Diverging inside page 1: the new sequence gets its own page 1.
    other = toks[:5] + [0, 0, 0, 7, 7]
    m = c.match_prefix(other[:-1])
    c.lock(m)
    own2 = a.alloc(2)
    assert finish(c, a, other, m.pages + own2, own2, m) == 1
    assert c.match_prefix(other).pages == [own[0], own2[0]]
    assert c.match_prefix(toks).pages == own[:2]
    assert c.cached_pages() == 3
    c.check_invariants()
    c.reset()
    a.check_no_leaks()


def test_concurrent_duplicates_are_not_adopted():
    """Two requests compute the same prefix at once; the second one's pages are
    duplicates: insert says so and the request's free() returns them."""
    a = PageAllocator(16)
    c = RadixCache(a, page_size=2)
    prompt = [1, 2, 3, 4, 5, 6, 7]
    ma, mb = c.match_prefix(prompt), c.match_prefix(prompt)
    c.lock(ma)
    c.lock(mb)
    own_a, own_b = a.alloc(4), a.alloc(4)
    assert finish(c, a, prompt, own_a, own_a, ma) == 0
    assert finish(c, a, prompt, own_b, own_b, mb) == 3
    assert c.cached_pages() == 3 and a.num_free == 15 - 3
    assert c.match_prefix(prompt).pages == own_a[:3]
    c.reset()
    a.check_no_leaks()


def test_locked_pages_survive_eviction_and_reset():
    a = PageAllocator(16)
    c = RadixCache(a, page_size=1)
    own = a.alloc(3)
    c.insert([1, 2, 3], own)
    a.free(own)
    m = c.match_prefix([1, 2])  # splits [1,2,3] into [1,2] + [3]
    c.lock(m)
    assert c.evictable_pages() == 1
    assert c.evict(100) == 1  # only the unlocked tail [3]
    assert c.reset() == 0
    assert c.match_prefix([1, 2, 3]).pages == own[:2]
    with pytest.raises(AssertionError, match="leak"):
        a.check_no_leaks()
    c.unlock(m)
    assert c.evictable_pages() == 2
    assert c.reset() == 2
    a.check_no_leaks()
    with pytest.raises(ValueError, match="not locked"):
        c.unlock(m)
    with pytest.raises(ValueError, match="evicted"):
        c.lock(m)


def test_eviction_is_lru_by_leaf_and_returns_count():
    a = PageAllocator(32)
    c = RadixCache(a, page_size=2)
    seqs = {k: [k, k, k, k] for k in (1, 2, 3)}  # 2 pages each, disjoint
    pages = {}
    for k, s in seqs.items():
        pages[k] = a.alloc(2)
        c.insert(s, pages[k])
        a.free(pages[k])
    c.match_prefix(seqs[1])  # 1 is now the most recent: order 2, 3, 1
    assert c.evict(1) == 2  # whole node: 2 pages
    assert c.match_prefix(seqs[2]).num_tokens == 0
    assert c.match_prefix(seqs[3]).num_tokens == 4  # 3 now the most recent

    m1 = c.match_prefix(seqs[1])
    c.lock(m1)
    assert c.evictable_pages() == 2
    assert c.evict(3) == 2  # 3 goes, 1 is locked
    assert c.match_prefix(seqs[1]).pages == pages[1]
    assert c.evict(1) == 0 and c.cached_pages() == 2
    c.unlock(m1)
    assert c.evict(0) == 0
    assert c.evict(1) == 2
    a.check_no_leaks()


def test_eviction_climbs_from_leaf_to_parent():
    """Leaves go first; a parent is evicted once its children are gone, within
    the same call when more pages are needed. Within one subtree the older leaf
    goes first."""
    a = PageAllocator(32)
    c = RadixCache(a, page_size=1)
    for tail in ([5], [6, 6]):
        s = [1, 2] + tail
        m = c.match_prefix(s)
        c.lock(m)
        own = a.alloc(len(s) - len(m.pages))
        finish(c, a, s, m.pages + own, own, m)
    assert num_nodes(c) == 3 and c.cached_pages() == 5
    assert c.evict(1) == 1  # [5] is the older leaf
    assert c.match_prefix([1, 2, 5]).num_tokens == 2
    assert c.evict(3) == 4  # [6, 6] (2 pages) is not enough: then [1, 2]
    assert c.cached_pages() == 0
    a.check_no_leaks()


def test_evict_counts_only_pages_returned_to_the_pool():
    """A request that inserted without handing its pages off still holds them:
    evicting drops the cache's reference but frees nothing."""
    a = PageAllocator(8)
    c = RadixCache(a, page_size=1)
    own = a.alloc(3)
    c.insert([1, 2, 3], own)  # request still running, keeps its references
    assert c.evict(2) == 0
    assert c.cached_pages() == 0 and a.num_free == 4
    a.free(own)
    a.check_no_leaks()


def test_rejects_bad_inserts():
    a = PageAllocator(8)
    c = RadixCache(a, page_size=2)
    own = a.alloc(2)
    c.insert([1, 2, 3, 4], own)
    with pytest.raises(ValueError, match="already cached"):
        c.insert([9, 9], [own[0]])  # the same page at a second place
    with pytest.raises(ValueError, match="scratch"):
        c.insert([8, 8], [PageAllocator.SCRATCH_PAGE])
    with pytest.raises(ValueError, match="full pages"):
        c.insert([7, 7, 7, 7], own[:1])
    with pytest.raises(ValueError):
        RadixCache(a, page_size=0)
    c.check_invariants()
    a.free(own)
    c.reset()
    a.check_no_leaks()


# ------------------------------------------------------ randomized model test


class Model:
    """The cache as a dict of page-aligned prefixes, with per-page recency and
    lock counts: the obvious (slow) version of what the tree must do."""

    def __init__(self, ps):
        self.ps = ps
        self.pages = {}  # prefix -> page
        self.time = {}  # prefix -> clock of last touch
        self.locks = Counter()  # prefix -> live locks covering it
        self.clock = 0

    def prefixes(self, tokens, n_pages):
        return [tuple(tokens[: (i + 1) * self.ps]) for i in range(n_pages)]

    def walk(self, tokens):
        """Cached page-aligned prefixes of tokens, touched for LRU."""
        self.clock += 1
        out = []
        for p in self.prefixes(tokens, len(tokens) // self.ps):
            if p not in self.pages:
                break
            self.time[p] = self.clock
            out.append(p)
        return out

    def insert(self, tokens, table):
        full = len(tokens) // self.ps
        n = len(self.walk(tokens))
        for i, p in enumerate(self.prefixes(tokens, full)[n:], n):
            self.pages[p] = table[i]
            self.time[p] = self.clock
        return n

    def lock(self, prefixes, d):
        for p in prefixes:
            self.locks[p] += d
            assert self.locks[p] >= 0

    def eviction_order(self):
        """Prefixes in the order LRU eviction of unlocked leaves removes them."""
        kids = Counter(p[: -self.ps] for p in self.pages)
        order = []
        leaves = [p for p in self.pages if kids[p] == 0 and self.locks[p] == 0]
        while leaves:
            # Distinct leaves never share a clock (one op touches one root path).
            p = min(leaves, key=lambda q: self.time[q])
            leaves.remove(p)
            order.append(p)
            parent = p[: -self.ps]
            kids[parent] -= 1
            if parent and kids[parent] == 0 and self.locks[parent] == 0:
                leaves.append(parent)
        return order


class Req:
    def __init__(self, prompt, tokens, match, matched, table, own):
        self.prompt, self.tokens = prompt, tokens
        self.match, self.matched = match, matched  # handle, locked model prefixes
        self.table, self.own = table, own
        self.handed_off = False


def run_random(ps, seed, steps):
    rng = random.Random(seed)
    alloc = PageAllocator(1 + 96 // ps)
    cache = RadixCache(alloc, ps)
    model = Model(ps)
    reqs = []
    base = [rng.choices(range(100, 1000), k=rng.randint(8, 30)) for _ in range(4)]
    base.append(base[0][:9] + rng.choices(range(100, 1000), k=12))  # shares base[0]'s head
    stats = Counter()

    def check():
        t = tree(cache)
        assert {p: v[0] for p, v in t.items()} == model.pages
        for p, (_, _, lock_ref) in t.items():
            assert lock_ref == model.locks[p], p
        # Recency: tree clock and model clock order every page the same way.
        pairs = sorted((t[p][1], model.time[p]) for p in t)
        assert all(x[1] <= y[1] for x, y in zip(pairs, pairs[1:]))
        pairs = sorted((model.time[p], t[p][1]) for p in t)
        assert all(x[1] <= y[1] for x, y in zip(pairs, pairs[1:]))
        # Every page's count is the cache's reference plus the requests' own.
        expect = np.zeros(alloc.num_pages, np.int32)
        expect[0] = 1
        for page in model.pages.values():
            expect[page] += 1
        for r in reqs:
            for page in r.own:
                expect[page] += 1
        np.testing.assert_array_equal(alloc._refcount, expect)
        assert len(alloc._free) == len(set(alloc._free))
        assert set(alloc._free) == set(np.nonzero(expect == 0)[0].tolist())
        assert cache.cached_pages() == len(model.pages)
        assert cache.evictable_pages() == sum(model.locks[p] == 0 for p in model.pages)
        cache.check_invariants()

    def evict(n, everything=False):
        order = model.eviction_order()
        before = tree(cache)
        freed = cache.reset() if everything else cache.evict(n)
        gone = [p for p in before if p not in tree(cache)]
        # What went is exactly the LRU order's head: never a locked page.
        assert set(gone) == set(order[: len(gone)])
        held = Counter(page for r in reqs for page in r.own)
        assert freed == sum(held[model.pages[p]] == 0 for p in gone)
        assert freed >= n or len(gone) == len(order)
        for p in gone:
            del model.pages[p], model.time[p]
        stats["evicted"] += len(gone)
        return freed

    def end(r, insert):
        if insert:
            n = cache.insert(r.tokens, r.table)
            full = len(r.tokens) // ps
            assert n >= len(r.matched)  # the locked match is still there
            # What the cache adopts must be the request's own pages.
            assert all(page in r.own for page in r.table[n:full])
            assert model.insert(r.tokens, r.table) == n
            stats["reused"] += n
        alloc.free(r.own)
        r.own = []
        cache.unlock(r.match)
        model.lock(r.matched, -1)
        reqs.remove(r)

    for _ in range(steps):
        op = rng.random()
        if op < 0.35 and len(reqs) < 6:  # arrival
            b = rng.choice(base)
            prompt = b[: rng.randint(1, len(b))] + rng.choices(range(1, 4), k=rng.randint(0, 6))
            tokens = prompt + rng.choices(range(1, 4), k=rng.randint(0, 8))
            m = cache.match_prefix(prompt[:-1])
            matched = model.walk(prompt[:-1])
            assert m.num_tokens == len(matched) * ps
            assert m.pages == [model.pages[p] for p in matched]
            cache.lock(m)
            model.lock(matched, +1)
            check()
            need = -(-len(tokens) // ps) - len(m.pages)
            if need > alloc.num_free:
                evict(need - alloc.num_free)
            if need > alloc.num_free:  # pool full of running requests: reject
                cache.unlock(m)
                model.lock(matched, -1)
                stats["rejected"] += 1
            else:
                own = alloc.alloc(need)
                reqs.append(Req(prompt, tokens, m, matched, m.pages + own, own))
        elif op < 0.45 and reqs:  # cache a running request's prompt after prefill
            r = rng.choice(reqs)
            if r.handed_off:
                continue
            n = cache.insert(r.prompt, r.table)
            assert model.insert(r.prompt, r.table) == n
            if rng.random() < 0.7:  # the protocol's hand-off
                full = len(r.prompt) // ps
                m2 = cache.match_prefix(r.prompt)
                matched2 = model.walk(r.prompt)
                assert len(m2.pages) == full and m2.pages[n:] == r.table[n:full]
                cache.lock(m2)
                model.lock(matched2, +1)
                cache.unlock(r.match)
                model.lock(r.matched, -1)
                r.match, r.matched = m2, matched2
                mine = [p for p in r.table[:full] if p in r.own]
                alloc.free(mine)
                r.own = [p for p in r.own if p not in mine]
                r.table[:full] = m2.pages
                r.handed_off = True
                stats["handoff"] += 1
        elif op < 0.75 and reqs:  # finish (or, rarely, abort without caching)
            end(rng.choice(reqs), insert=rng.random() < 0.9)
        elif op < 0.87:  # eviction pressure
            evict(rng.randint(1, 12))
        elif op < 0.89:
            evict(0, everything=True)
        else:  # lookup only (touches recency)
            b = rng.choice(base)
            q = b[: rng.randint(0, len(b))]
            assert cache.match_prefix(q).pages == [model.pages[p] for p in model.walk(q)]
        check()

    while reqs:
        end(reqs[0], insert=True)
        check()
    evict(0, everything=True)
    check()
    assert cache.cached_pages() == 0
    alloc.check_no_leaks()
    return stats


@pytest.mark.parametrize("ps", [1, 2, 4])
def test_random_against_model(ps):
    stats = Counter()
    for seed in range(3):
        stats += run_random(ps, seed, steps=1500)
    # The run exercised what it claims to.
    assert stats["reused"] > 100 and stats["evicted"] > 50
    assert stats["handoff"] > 10 and stats["rejected"] > 0
