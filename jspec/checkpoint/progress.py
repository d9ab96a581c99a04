"""Progress of reading a checkpoint's weights: shards and bytes, as a bar when stderr is a
terminal and as log lines (every tenth of the bytes) otherwise, then the time taken.

The weights are memory-mapped, so a tensor's bytes are read when the converter takes it, in
the order of the param pytree rather than of the files: progress counts each tensor the first
time the converter takes it (TrackedTensors), and a shard is done once all its tensors are.
Looking at a tensor's shape or dtype (`peek`) reads no bytes and counts nothing.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterator, Mapping

import numpy as np

log = logging.getLogger("jspec.checkpoint")
LOG_STEPS = 10  # log lines per load, when stderr is no terminal


class ReadProgress:
    def __init__(self, shards: list[dict[str, np.ndarray]], where: str, stream=None):
        self.where = where
        self.shard_of = {name: i for i, shard in enumerate(shards) for name in shard}
        self.left = [len(shard) for shard in shards]
        self.total = sum(int(t.nbytes) for shard in shards for t in shard.values())
        self.bytes = self.shards = 0
        self.logged = 0  # tenths of the bytes logged so far
        self.start = time.perf_counter()
        stream = sys.stderr if stream is None else stream
        self.bar = None
        if stream.isatty():
            from tqdm import tqdm  # here: only a terminal shows a bar

            self.bar = tqdm(
                total=self.total,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                desc=f"loading {where}",
                file=stream,
                dynamic_ncols=True,
            )
            self.bar.set_postfix_str(f"0/{len(shards)} shards")

    def read(self, name: str, nbytes: int) -> None:
        self.bytes += nbytes
        shard = self.shard_of[name]
        self.left[shard] -= 1
        if self.left[shard] == 0:
            self.shards += 1
        if self.bar is not None:
            self.bar.update(nbytes)
            self.bar.set_postfix_str(f"{self.shards}/{len(self.left)} shards", refresh=False)
            return
        tenth = self.bytes * LOG_STEPS // max(1, self.total)
        if tenth > self.logged and tenth < LOG_STEPS:
            self.logged = tenth
            self._log(self.bytes, self.shards)

    def close(self) -> None:
        """The load is over: tensors the converter never took (buffers it skips) are done too."""
        if self.bar is not None:
            self.bar.update(self.total - self.bar.n)
            self.bar.set_postfix_str(f"{len(self.left)}/{len(self.left)} shards")
            self.bar.close()
            return
        log.info(
            "read %s: %d shards, %s, in %.1f s",
            self.where,
            len(self.left),
            _size(self.total),
            time.perf_counter() - self.start,
        )

    def _log(self, nbytes: int, shards: int) -> None:
        log.info(
            "loading %s: %d%% (%s of %s), %d of %d shards read, %.1f s",
            self.where,
            100 * nbytes // max(1, self.total),
            _size(nbytes),
            _size(self.total),
            shards,
            len(self.left),
            time.perf_counter() - self.start,
        )


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


class TrackedTensors(Mapping):
    """A checkpoint's tensors by name, each counted as read the first time it is taken."""

    def __init__(self, tensors: dict[str, np.ndarray], progress: ReadProgress):
        self._tensors = tensors
        self._taken: set[str] = set()
        self.progress = progress

    def __getitem__(self, name: str) -> np.ndarray:
        t = self._tensors[name]
        if name not in self._taken:
            self._taken.add(name)
            self.progress.read(name, int(t.nbytes))
        return t

    def peek(self, name: str) -> np.ndarray:
        """The tensor, for its shape or dtype: not counted as read."""
        return self._tensors[name]

    def __contains__(self, name) -> bool:
        return name in self._tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


def peek(tensors: Mapping[str, np.ndarray], name: str) -> np.ndarray:
    """A tensor looked at for its shape or dtype alone (not counted as read when tracked)."""
    return tensors.peek(name) if isinstance(tensors, TrackedTensors) else tensors[name]
