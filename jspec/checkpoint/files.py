"""safetensors files of an HF checkpoint: finding them, reading them memory-mapped, writing them.

Reading parses the header itself and maps the data with np.memmap instead of going through
the safetensors library: its numpy API copies every tensor into host memory, and its flax
API puts each on the default device unsharded; mapped, a tensor's bytes are read only when
it is placed on the device, under its own sharding.
"""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from jspec.checkpoint.errors import CorruptCheckpointError, NoSafetensorsError

_ST_DTYPES = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("bool"),
}


def read_safetensors_file(filename: str | os.PathLike) -> dict[str, np.ndarray]:
    """Memory-maps one .safetensors file; returns read-only little-endian views."""
    filename = os.fspath(filename)
    size = os.path.getsize(filename)
    with open(filename, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise CorruptCheckpointError(f"{filename!r} is not a safetensors file (shorter than 8 bytes)")
        header_len = int.from_bytes(head, "little")
        if header_len > size - 8:
            raise CorruptCheckpointError(f"{filename!r}: header length {header_len} exceeds the file size {size}")
        try:
            header = json.loads(f.read(header_len))
        except ValueError as e:
            raise CorruptCheckpointError(f"{filename!r}: unreadable safetensors header ({e})") from None
    data_start = 8 + header_len
    buf = np.memmap(filename, dtype=np.uint8, mode="r") if size > data_start else np.zeros(0, np.uint8)
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _ST_DTYPES.get(info["dtype"])
        if dtype is None:
            raise CorruptCheckpointError(f"{filename!r}: tensor {name!r} has unsupported dtype {info['dtype']!r}")
        shape = tuple(int(d) for d in info["shape"])
        start, end = (int(o) for o in info["data_offsets"])
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if end - start != nbytes or data_start + end > size:
            raise CorruptCheckpointError(
                f"{filename!r}: tensor {name!r} ({info['dtype']} {list(shape)}) has byte range "
                f"[{start}, {end}) but needs {nbytes} bytes within a {size}-byte file (truncated?)"
            )
        out[name] = buf[data_start + start : data_start + end].view(dtype).reshape(shape)
    return out


def safetensors_files(path: str | os.PathLike) -> list[str]:
    """The weight files of an HF checkpoint directory, index first."""
    path = os.fspath(path)
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map") or {}
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not os.path.isfile(os.path.join(path, s))]
        if missing:
            raise NoSafetensorsError(
                f"model directory {path!r}: model.safetensors.index.json lists shard(s) {missing} that do not exist"
            )
        if not shards:
            raise NoSafetensorsError(f"model directory {path!r}: model.safetensors.index.json has an empty weight_map")
        return [os.path.join(path, s) for s in shards]
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    # Shards without an index happen when an index is lost; consolidated.safetensors
    # (Mistral's own format) uses other tensor names, so it is not picked up.
    shards = sorted(f for f in os.listdir(path) if f.startswith("model-") and f.endswith(".safetensors"))
    if shards:
        return [os.path.join(path, s) for s in shards]
    present = sorted(os.listdir(path))
    hint = (
        " (PyTorch .bin weights are not supported; convert them to safetensors)"
        if any(f.endswith(".bin") for f in present)
        else ""
    )
    raise NoSafetensorsError(
        f"model directory {path!r} has no model.safetensors or model.safetensors.index.json{hint}; "
        f"it contains {present[:20]}"
    )


def read_hf_tensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """All tensors of an HF checkpoint directory by name, as memory-mapped numpy arrays
    (bf16 as `ml_dtypes.bfloat16`), so reading costs no host memory until used."""
    return merge_shards(read_hf_shards(path), path)


def read_hf_shards(path: str | os.PathLike) -> list[dict[str, np.ndarray]]:
    """Each safetensors file's tensors by name (memory-mapped), file by file."""
    return [read_safetensors_file(filename) for filename in safetensors_files(path)]


def merge_shards(shards: list[dict[str, np.ndarray]], path: str | os.PathLike) -> dict[str, np.ndarray]:
    tensors: dict[str, np.ndarray] = {}
    for shard in shards:
        for name, arr in shard.items():
            if name in tensors:
                raise CorruptCheckpointError(f"tensor {name!r} appears in more than one shard of {os.fspath(path)!r}")
            tensors[name] = arr
    return tensors


def write_safetensors(out_dir: str, tensors: dict[str, np.ndarray], num_shards: int = 1) -> list[str]:
    """HF file naming: model.safetensors, or model-0000k-of-0000n.safetensors + index."""
    meta = {"format": "pt"}  # what transformers writes; some readers insist on it
    if num_shards <= 1:
        save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata=meta)
        return ["model.safetensors"]
    names = list(tensors)
    total = sum(a.nbytes for a in tensors.values())
    groups: list[list[str]] = [[] for _ in range(num_shards)]
    acc = 0
    for n in names:  # contiguous split by bytes, so every shard is non-empty for small n
        k = min(num_shards - 1, acc * num_shards // max(total, 1))
        groups[k].append(n)
        acc += tensors[n].nbytes
    groups = [g for g in groups if g]
    files, weight_map = [], {}
    for k, g in enumerate(groups):
        fname = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: tensors[n] for n in g}, os.path.join(out_dir, fname), metadata=meta)
        weight_map.update({n: fname for n in g})
        files.append(fname)
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return files
