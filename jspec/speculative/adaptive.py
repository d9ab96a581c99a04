"""Adaptive speculation: which draft shape each decode iteration runs (host side).

Every shape is a (num_steps, topk, num_draft_tokens) of the same method over one device state,
(0, 1, 1) verifying the root alone. The policy keeps per request an estimate of the per-depth
acceptance rate alpha (an EMA over the accept lengths the loop already reads back), predicts
each shape's accepted drafts from it, and picks the shape with the most expected tokens per
second of the batch: (rows + predicted accepts) / the shape's measured iteration time at the
batch's bucket. The design and its model are in docs/design-details.md.
"""

from __future__ import annotations

import dataclasses
import functools
import json

import numpy as np

Shape = tuple[int, int, int]  # (num_steps, topk, num_draft_tokens)


def shape_label(shape: Shape) -> str:
    return "off" if shape[0] == 0 else ",".join(map(str, shape))


def expected_accepts(alpha: np.ndarray, shape: Shape) -> np.ndarray:
    """Predicted accepted drafts per row: depth d is reached with probability r^d, where a
    depth holds topk independent tries at alpha each, r = 1 - (1 - alpha)^topk. A tree whose
    num_draft_tokens keeps fewer than topk children per depth is overrated by this; the
    observed accept lengths correct alpha for the shapes that run."""
    steps, topk, _ = shape
    if steps == 0:
        return np.zeros_like(alpha)
    r = 1.0 - (1.0 - alpha) ** topk
    return sum(r**d for d in range(1, steps + 1))


@functools.cache
def _accept_curve(shape: Shape) -> tuple[np.ndarray, np.ndarray]:
    """expected_accepts on a fine grid of alpha: increasing, so np.interp inverts it."""
    alpha = np.linspace(0.0, 1.0, 4097)
    return alpha, expected_accepts(alpha, shape)


def alpha_from_accept(accept: np.ndarray, shape: Shape) -> np.ndarray:
    """The alpha whose expected accepts under `shape` equal `accept` (the curve inverted by
    interpolation: one vector operation per processed iteration)."""
    alpha, curve = _accept_curve(shape)
    return np.interp(accept, curve, alpha)


def parse_shape(label: str) -> Shape:
    return (0, 1, 1) if label == "off" else tuple(int(x) for x in label.split(","))


@dataclasses.dataclass
class CostTable:
    """Seconds per decode iteration of each shape at each batch bucket, and where they came from.
    ragged: (shape, bucket, drafting rows) -> seconds of the iteration where only that many rows
    draft (the others verify their root alone); a row opts out only where this was measured."""

    seconds: dict[Shape, dict[int, float]]
    source: str
    ragged: dict[tuple[Shape, int, int], float] = dataclasses.field(default_factory=dict)

    def at(self, shape: Shape, bucket: int) -> float | None:
        row = self.seconds.get(shape)
        if not row:
            return None
        if bucket in row:
            return row[bucket]
        # A bucket not measured: the nearest measured one above it, else the largest.
        above = [b for b in row if b >= bucket]
        return row[min(above)] if above else row[max(row)]

    @classmethod
    def load(cls, path: str) -> CostTable:
        """A cost table from JSON: {"costs": {"3,1,4": {"1": seconds, "16": ...}, "off": ...},
        "ragged": {"3,1,4": {"16": {"4": seconds, ...}}}} (ragged optional)."""
        with open(path) as f:
            data = json.load(f)
        seconds = {
            parse_shape(label): {int(b): float(t) for b, t in row.items()} for label, row in data["costs"].items()
        }
        ragged = {
            (parse_shape(label), int(b), int(d)): float(t)
            for label, per_bucket in data.get("ragged", {}).items()
            for b, per_d in per_bucket.items()
            for d, t in per_d.items()
        }
        return cls(seconds, f"loaded from {path}", ragged)

    def to_json(self) -> dict:
        out = {"costs": {shape_label(s): {str(b): t for b, t in row.items()} for s, row in self.seconds.items()}}
        if self.ragged:
            out["ragged"] = {}
            for (shape, b, d), t in self.ragged.items():
                out["ragged"].setdefault(shape_label(shape), {}).setdefault(str(b), {})[str(d)] = t
        return out


@dataclasses.dataclass
class AdaptiveStats:
    """What /metrics and /get_server_info show of the policy."""

    chosen: dict[tuple[int, Shape], int] = dataclasses.field(default_factory=dict)  # (bucket, shape) -> count
    seconds: dict[Shape, float] = dataclasses.field(default_factory=dict)  # wall time per shape
    accept_ema: dict[Shape, float] = dataclasses.field(default_factory=dict)  # mean accepted drafts per shape
    rows_opted_out: int = 0  # rows that verified their root alone while others in the batch drafted


@dataclasses.dataclass
class Choice:
    """One iteration's pick: the shape, and which rows draft (None: all)."""

    shape: int
    drafting: list[bool] | None = None


@dataclasses.dataclass
class AdaptivePolicy:
    """Picks a shape index per decode iteration. `alpha` lives on each request
    (Request.accept_alpha); the policy holds the shapes, the costs and the statistics."""

    shapes: tuple[Shape, ...]
    costs: CostTable
    decay: float = 0.7  # EMA weight of a request's earlier estimate
    prior_alpha: float = 0.6  # a new request's estimate before any observation
    probe_every: int = 16  # after this many iterations in which some row did not draft, one where all do
    opt_out: bool = True  # rows unlikely to accept may verify their root alone while the others draft
    stats: AdaptiveStats = dataclasses.field(default_factory=AdaptiveStats)
    _since_all_drafted: int = 0

    def choose(self, alphas: np.ndarray, bucket: int, ready=lambda i, drafting_rows: True) -> Choice:
        """alphas [rows]: each row's estimate; bucket: the rows' program bucket; ready(i, d): the
        program of shape i with d drafting rows (None: all) is compiled (others are not picked).

        Beside each shape for the whole batch, it weighs the shape for only the d rows most
        likely to accept (d a power of two), the others verifying their root alone, where the
        cost table holds that iteration's measured cost."""
        rows = len(alphas)
        best, best_rate, drafting_cost = Choice(0), -1.0, []
        for i, shape in enumerate(self.shapes):
            cost = self.costs.at(shape, bucket)
            if cost is None:
                continue
            accepts = np.interp(alphas, *_accept_curve(shape))  # expected_accepts, tabulated
            options = [(None, rows + float(accepts.sum()), cost)]
            if shape[0] > 0 and self.opt_out and rows > 1:
                order = np.argsort(-accepts, kind="stable")
                total = np.cumsum(accepts[order])
                d = 1
                while d < rows:
                    partial = self.costs.ragged.get((shape, bucket, d))
                    if partial is not None:
                        options.append((d, rows + float(total[d - 1]), partial))
                    d *= 2
            for d, tokens, c in options:
                if not ready(i, d):
                    continue
                if shape[0] > 0 and d is None:
                    drafting_cost.append((c, i))
                if tokens / c > best_rate:
                    flags = None
                    if d is not None:
                        flags = [False] * rows
                        for r in order[:d]:
                            flags[r] = True
                    best, best_rate = Choice(i, flags), tokens / c
        everyone_drafts = self.shapes[best.shape][0] > 0 and best.drafting is None
        self._since_all_drafted = 0 if everyone_drafts else self._since_all_drafted + 1
        if self._since_all_drafted >= self.probe_every and drafting_cost:
            # A row that does not draft teaches nothing about its acceptance; now and then every
            # row drafts with the cheapest shape, so that no estimate stays stale.
            best, self._since_all_drafted = Choice(min(drafting_cost)[1]), 0
        key = (bucket, self.shapes[best.shape])
        self.stats.chosen[key] = self.stats.chosen.get(key, 0) + 1
        if best.drafting is not None:
            self.stats.rows_opted_out += best.drafting.count(False)
        return best

    def observe(self, shape_index: int, reqs, accept_lens: np.ndarray, seconds: float, drafting=None) -> None:
        """One processed iteration: each request's accepted drafts under the shape it ran
        (drafting: the rows that drafted; None: all)."""
        shape = self.shapes[shape_index]
        self.stats.seconds[shape] = self.stats.seconds.get(shape, 0.0) + seconds
        if drafting is not None:
            keep = [i for i, d in enumerate(drafting) if d]
            reqs, accept_lens = [reqs[i] for i in keep], np.asarray(accept_lens)[keep]
        if shape[0] == 0 or not reqs:
            return
        acc = np.asarray(accept_lens[: len(reqs)], np.float64)
        # A full accept says only "alpha is high": cap it below the shape's maximum.
        obs = alpha_from_accept(np.minimum(acc, shape[0] - 0.5), shape)
        for req, a in zip(reqs, obs):
            old = req.accept_alpha
            req.accept_alpha = float(a) if old is None else self.decay * old + (1 - self.decay) * float(a)
        mean = float(acc.mean())
        old = self.stats.accept_ema.get(shape)
        self.stats.accept_ema[shape] = mean if old is None else self.decay * old + (1 - self.decay) * mean

    def alphas(self, reqs) -> np.ndarray:
        return np.array([self.prior_alpha if r.accept_alpha is None else r.accept_alpha for r in reqs], np.float64)

    def describe(self) -> dict:
        """The policy's state for /get_server_info."""
        per_bucket: dict[int, dict[str, int]] = {}
        # Copies first: the engine's thread updates these while a server thread reads them.
        chosen, seconds, accept = dict(self.stats.chosen), dict(self.stats.seconds), dict(self.stats.accept_ema)
        for (bucket, shape), n in chosen.items():
            per_bucket.setdefault(bucket, {})[shape_label(shape)] = n
        return {
            "shapes": [shape_label(s) for s in self.shapes],
            "cost_source": self.costs.source if self.costs else "not measured yet",
            "costs_ms": {
                shape_label(s): {b: round(t * 1e3, 4) for b, t in sorted(row.items())}
                for s, row in (self.costs.seconds if self.costs else {}).items()
            },
            "chosen_per_bucket": {b: per_bucket[b] for b in sorted(per_bucket)},
            "seconds_per_shape": {shape_label(s): round(t, 4) for s, t in seconds.items()},
            "mean_accept_per_shape": {shape_label(s): round(a, 4) for s, a in accept.items()},
            "rows_opted_out": self.stats.rows_opted_out,
        }
