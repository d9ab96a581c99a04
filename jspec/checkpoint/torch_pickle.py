"""pytorch_model.bin read without torch: a restricted unpickler that rebuilds tensors as
memory-mapped numpy arrays and refuses any other global before it can run.

torch.save (torch >= 1.6) writes a zip: <prefix>/data.pkl is a protocol-2 pickle of the
state dict whose tensors are `torch._utils._rebuild_tensor_v2(storage, offset, size, stride,
requires_grad, hooks)` calls; each storage is a persistent id ("storage", torch.<Type>Storage,
key, location, numel) whose bytes are the stored (uncompressed) record <prefix>/data/<key>.
Only those names are resolved.
"""

from __future__ import annotations

import collections
import math
import os
import pickle
import re
import zipfile
from typing import Any

import ml_dtypes
import numpy as np

from jspec.checkpoint.errors import CheckpointError, CorruptCheckpointError


class UnsafePickleError(CheckpointError):
    """A pytorch_model.bin whose pickle asks for something outside the whitelist."""


_TORCH_STORAGE_DTYPES = {
    "FloatStorage": np.dtype("<f4"),
    "HalfStorage": np.dtype("<f2"),
    "BFloat16Storage": np.dtype(ml_dtypes.bfloat16),
    "LongStorage": np.dtype("<i8"),
    "BoolStorage": np.dtype("bool"),
}


class _Frozen:
    """Pickle BUILD calls __setstate__ on whatever is on the stack; our objects refuse it."""

    __slots__ = ()

    def __setstate__(self, state):
        raise UnsafePickleError("pickle tries to set the state of a tensor or storage object")


class _StorageType(_Frozen):
    __slots__ = ("name", "dtype")

    def __init__(self, name: str, dtype: np.dtype):
        self.name, self.dtype = name, dtype


class _Storage(_Frozen):
    __slots__ = ("array",)

    def __init__(self, array: np.ndarray):
        self.array = array


class _Tensor(_Frozen):
    __slots__ = ("array",)

    def __init__(self, array: np.ndarray):
        self.array = array


def _as_int_tuple(x: Any, what: str) -> tuple[int, ...]:
    if not isinstance(x, tuple) or not all(isinstance(v, int) and not isinstance(v, bool) for v in x):
        raise CorruptCheckpointError(f"tensor {what} must be a tuple of ints, got {x!r}")
    return x


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None, metadata=None):
    if not isinstance(storage, _Storage):
        raise UnsafePickleError("_rebuild_tensor_v2 called without a storage")
    if backward_hooks:
        raise UnsafePickleError("tensor has backward hooks, which jspec does not load")
    if not isinstance(storage_offset, int) or storage_offset < 0:
        raise CorruptCheckpointError(f"bad tensor storage offset {storage_offset!r}")
    size, stride = _as_int_tuple(size, "size"), _as_int_tuple(stride, "stride")
    if len(size) != len(stride) or any(n < 0 for n in size) or any(s < 0 for s in stride):
        raise CorruptCheckpointError(f"bad tensor size {size} / stride {stride}")
    flat = storage.array
    if math.prod(size) == 0:
        return _Tensor(np.zeros(size, flat.dtype))
    last = storage_offset + sum((n - 1) * s for n, s in zip(size, stride))
    if last >= flat.shape[0]:
        raise CorruptCheckpointError(
            f"tensor of size {list(size)}, stride {list(stride)}, offset {storage_offset} reaches element "
            f"{last} of a storage of {flat.shape[0]} elements"
        )
    item = flat.dtype.itemsize
    view = np.lib.stride_tricks.as_strided(
        flat[storage_offset:], shape=size, strides=[s * item for s in stride], writeable=False
    )
    return _Tensor(view)


def _rebuild_parameter(data, requires_grad=False, backward_hooks=None):
    if not isinstance(data, _Tensor):
        raise UnsafePickleError("_rebuild_parameter called without a tensor")
    if backward_hooks:
        raise UnsafePickleError("parameter has backward hooks, which jspec does not load")
    return data


_ALLOWED_GLOBALS = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
}


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, file, where: str, load_storage):
        super().__init__(file)
        self._where = where
        self._load_storage = load_storage

    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED_GLOBALS:
            return _ALLOWED_GLOBALS[(module, name)]
        if module == "torch" and name in _TORCH_STORAGE_DTYPES:
            return _StorageType(name, _TORCH_STORAGE_DTYPES[name])
        raise UnsafePickleError(
            f"{self._where}: the pickle refers to {module}.{name}, which is not allowed; a state dict may only "
            f"use collections.OrderedDict, torch._utils._rebuild_tensor_v2 / _rebuild_parameter and the "
            f"storages {sorted(_TORCH_STORAGE_DTYPES)} (convert other checkpoints to safetensors)"
        )

    def persistent_load(self, pid):
        ok = (
            isinstance(pid, tuple)
            and len(pid) == 5
            and pid[0] == "storage"
            and isinstance(pid[1], _StorageType)
            and isinstance(pid[2], str)
            and isinstance(pid[4], int)
        )
        if not ok:
            raise UnsafePickleError(f"{self._where}: unsupported persistent id {pid!r} in the pickle")
        return self._load_storage(pid[1], pid[2], pid[4])


def _stored_record(zf: zipfile.ZipFile, filename: str, name: str, dtype: np.dtype, numel: int) -> np.ndarray:
    """Memory-maps one uncompressed zip member as a 1-D array of `numel` items."""
    try:
        info = zf.getinfo(name)
    except KeyError:
        raise CorruptCheckpointError(f"{filename!r}: storage record {name!r} is missing") from None
    if info.compress_type != zipfile.ZIP_STORED:
        raise CorruptCheckpointError(f"{filename!r}: storage record {name!r} is compressed; torch.save never does that")
    if info.file_size != numel * dtype.itemsize:
        raise CorruptCheckpointError(
            f"{filename!r}: storage record {name!r} has {info.file_size} bytes, the pickle says "
            f"{numel} x {dtype.itemsize}"
        )
    if numel == 0:
        return np.zeros(0, dtype)
    # The member's bytes start after its local header, whose name and extra
    # fields (torch pads the extra field to align storages) have their own lengths.
    with open(filename, "rb") as f:
        f.seek(info.header_offset)
        head = f.read(30)
    if len(head) != 30 or head[:4] != b"PK\x03\x04":
        raise CorruptCheckpointError(f"{filename!r}: bad zip local header for {name!r}")
    start = info.header_offset + 30 + int.from_bytes(head[26:28], "little") + int.from_bytes(head[28:30], "little")
    return np.memmap(filename, dtype=np.uint8, mode="r", offset=start, shape=(info.file_size,)).view(dtype)


def read_torch_bin_file(filename: str | os.PathLike) -> dict[str, np.ndarray]:
    """Reads a torch.save'd state dict (zip format, torch >= 1.6) into read-only
    numpy arrays (memory-mapped; bf16 as ml_dtypes.bfloat16), without torch.

    Refuses, before anything runs, a pickle that names any global outside the
    tensor-rebuild whitelist (`UnsafePickleError`)."""
    filename = os.fspath(filename)
    if not zipfile.is_zipfile(filename):
        raise CorruptCheckpointError(
            f"{filename!r} is not a zip-format PyTorch checkpoint (the legacy torch < 1.6 format and other "
            f"files are not supported): re-save it with a recent torch or convert it to safetensors"
        )
    with zipfile.ZipFile(filename) as zf:
        pkls = [n for n in zf.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pkls) != 1:
            raise CorruptCheckpointError(f"{filename!r}: expected one <prefix>/data.pkl in the zip, found {pkls}")
        prefix = pkls[0][: -len("data.pkl")]
        if prefix + "byteorder" in zf.namelist():
            order = zf.read(prefix + "byteorder").decode("ascii", "replace").strip()
            if order != "little":
                raise CorruptCheckpointError(f"{filename!r}: byte order {order!r} is not supported (only little)")
        storages: dict[str, _Storage] = {}

        def load_storage(stype: _StorageType, key: str, numel: int) -> _Storage:
            if not re.fullmatch(r"[A-Za-z0-9_]+", key):
                raise UnsafePickleError(f"{filename!r}: bad storage key {key!r}")
            if key not in storages:
                storages[key] = _Storage(_stored_record(zf, filename, f"{prefix}data/{key}", stype.dtype, numel))
            elif storages[key].array.dtype != stype.dtype:
                raise CorruptCheckpointError(f"{filename!r}: storage {key!r} is used with two dtypes")
            return storages[key]

        with zf.open(pkls[0]) as f:
            try:
                obj = _RestrictedUnpickler(f, repr(filename), load_storage).load()
            except CheckpointError:
                raise
            except Exception as e:  # a malformed pickle: report it as such, not as a crash
                raise CorruptCheckpointError(f"{filename!r}: unreadable pickle ({type(e).__name__}: {e})") from None
    if not isinstance(obj, dict):
        raise CorruptCheckpointError(f"{filename!r}: expected a state dict, the pickle holds a {type(obj).__name__}")
    out = {}
    for name, t in obj.items():
        if not isinstance(name, str) or not isinstance(t, _Tensor) or not isinstance(t.array, np.ndarray):
            raise CorruptCheckpointError(
                f"{filename!r}: entry {name!r} is not a tensor (a flat name -> tensor state dict is expected)"
            )
        out[name] = t.array
    return out
