"""A request's device state in and out of an engine: what PD disaggregation moves.

A worker's state (steps.PlainState, spec.method.SpecState) has two kinds of leaves:
- paged: the KV pools (the target's, and a draft's: EAGLE's head, a STANDALONE model),
  [layers, pages, page_size, heads, dim], indexed through the request's page table;
- per-slot: everything else (the FutureMap carry with EAGLE's top-k and hidden state,
  penalty counts, NGRAM's token history), [slots + 1, ...], indexed by the request slot.

extract_request gathers positions 0..n-1 of every paged leaf, token-major
([layers, n, heads, dim], so the two engines may use different page sizes), and the
slot's row of every per-slot leaf. write_request scatters them into another engine's
pages and slot inside a jitted step that donates the state, like every other step.
Lengths are bucketed to powers of two so both compile a few programs, not one per prompt.
"""

from __future__ import annotations

import functools
import hashlib

import jax
import numpy as np

from jspec.kvcache.pool import KVPool
from jspec.layers.batch import bucket

MIN_TOKENS = 16


def _is_pool(x) -> bool:
    return isinstance(x, KVPool)


def split_state(state):
    """(paged leaves, per-slot leaves, a function rebuilding the state from both lists)."""
    outer, treedef = jax.tree.flatten(state, is_leaf=_is_pool)
    kinds = [_is_pool(x) for x in outer]

    def rebuild(paged, rows):
        paged, rows = iter(paged), iter(rows)
        leaves = [KVPool(next(paged), next(paged)) if k else next(rows) for k in kinds]
        return jax.tree.unflatten(treedef, leaves)

    paged = [a for x, k in zip(outer, kinds) if k for a in x]
    rows = [x for x, k in zip(outer, kinds) if not k]
    return paged, rows, rebuild


def layout(state) -> list[list]:
    """What one request's arrays look like ([kind, shape without the token/slot axis, dtype]): two
    engines can exchange requests only if their layouts are equal (same model, draft, method)."""
    paged, rows, _ = split_state(state)
    return [["paged", [a.shape[0], *a.shape[3:]], str(a.dtype)] for a in paged] + [
        ["row", list(a.shape[1:]), str(a.dtype)] for a in rows
    ]


def weights_fingerprint(worker) -> str:
    """A digest of a few values of the target's (and draft's) weights: equal layouts do not make
    equal models, and KV computed by other weights would decode into fluent-looking garbage.
    Read once, when an engine is made, never in the loop."""
    h = hashlib.sha1()
    for tree in (worker.params, getattr(worker, "dparams", None)):
        leaves = jax.tree.leaves(tree)
        for a in leaves[:4] + leaves[-2:]:
            h.update(np.asarray(a.reshape(-1)[:16], np.float32).tobytes())
    return h.hexdigest()


def check_arrays(want: list, arrays, n: int) -> None:
    """ValueError unless `arrays` are one n-token request of layout `want`: a malformed message
    must fail its request, not the jitted write (and with it the engine loop)."""
    got, tokens = [], set()
    for (kind, _, _), a in zip(want, arrays):
        if kind == "paged" and a.ndim > 1:
            got.append([kind, [a.shape[0], *a.shape[2:]], str(a.dtype)])
            tokens.add(a.shape[1])
        else:
            got.append([kind, list(a.shape), str(a.dtype)])
    if len(arrays) != len(want) or got != want or tokens != {n}:
        raise ValueError(
            f"the transferred arrays do not match this engine's state for a {n}-token prompt: got "
            f"{[(list(a.shape), str(a.dtype)) for a in arrays]}, layout {want}"
        )


def stage_request(want: list, arrays: list[np.ndarray], n: int, to_device: bool) -> list:
    """Checks one arrived request's arrays against layout `want` and pads its KV to the token
    bucket; with to_device, also starts their copy to the device. Runs on the link's reader
    thread, so neither the host copies nor the upload of a long prompt stall the decode loop."""
    check_arrays(want, arrays, n)
    nb = token_bucket(n)
    out = []
    for (kind, _, _), t in zip(want, arrays):
        if kind == "paged" and nb != n:
            buf = np.zeros((t.shape[0], nb, *t.shape[2:]), t.dtype)
            buf[:, :n] = t
            t = buf
        out.append(t)
    return jax.device_put(out) if to_device else out


def token_bucket(n: int) -> int:
    return bucket(n, MIN_TOKENS)


@jax.jit
def _extract(state, flat_slots, slot):
    paged, rows, _ = split_state(state)
    out = []
    for a in paged:
        L, P, S = a.shape[:3]
        out.append(a.reshape(L, P * S, *a.shape[3:])[:, flat_slots])
    return out + [r[slot] for r in rows]


def extract_request(state, pages: list[int], page_size: int, n: int, slot: int) -> list[jax.Array]:
    """Device arrays of one request's KV positions 0..n-1 (bucketed: rows past n are padding
    the caller drops) and its slot rows. Not donating: it reads the state between steps."""
    nb = token_bucket(n)
    pos = np.arange(nb)
    pt = np.zeros(-(-nb // page_size), np.int32)
    pt[: len(pages)] = pages[: len(pt)]
    flat = np.where(pos < n, pt[pos // page_size] * page_size + pos % page_size, 0).astype(np.int32)
    return _extract(state, flat, np.int32(slot))


@functools.partial(jax.jit, donate_argnames=("state",))
def _write(state, paged_in, rows_in, flat_slots, slot):
    paged, rows, rebuild = split_state(state)
    new_paged = []
    for a, t in zip(paged, paged_in):
        L, P, S = a.shape[:3]
        flat = a.reshape(L, P * S, *a.shape[3:]).at[:, flat_slots].set(t.astype(a.dtype), mode="drop")
        new_paged.append(flat.reshape(a.shape))
    new_rows = [r.at[slot].set(x.astype(r.dtype)) for r, x in zip(rows, rows_in)]
    return rebuild(new_paged, new_rows)


def write_request(state, staged: list, pages: list[int], page_size: int, n: int, slot: int):
    """The new state with one request's staged arrays (stage_request's, host or device) written
    into `pages` (covering positions 0..n-1) and `slot`. Donates `state`."""
    k = len(split_state(state)[0])
    nb = token_bucket(n)
    pos = np.arange(nb)
    pt = np.asarray(pages, np.int32)
    drop = split_state(state)[0][0].shape[1] * page_size
    flat = np.where(pos < n, pt[np.minimum(pos // page_size, len(pt) - 1)] * page_size + pos % page_size, drop)
    return _write(state, list(staged[:k]), list(staged[k:]), flat.astype(np.int32), np.int32(slot))
