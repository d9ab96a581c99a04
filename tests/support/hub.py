"""A Hugging Face Hub cache tree, written as huggingface_hub lays one out, so that tests resolve
repo ids through the library itself, offline:

    <cache>/models--ORG--NAME/blobs/<id>                    the files' contents, by id (git's blob
                                                            sha1, or sha256 for LFS files)
    <cache>/models--ORG--NAME/snapshots/<commit>/<path>     relative symlinks to ../../blobs/<id>
    <cache>/models--ORG--NAME/refs/<branch or tag>          the commit hash it points at
"""

import hashlib
import os

LFS_SUFFIXES = (".safetensors", ".bin", ".gguf")  # what the Hub stores through LFS


def blob_id(path: str, data: bytes) -> str:
    if path.endswith(LFS_SUFFIXES):
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def add_snapshot(cache: str, repo_id: str, source_dir: str, refs=("main",), skip=()) -> str:
    """Caches the files of source_dir (but `skip`) as one commit of repo_id, which each of refs
    then names; returns the commit hash."""
    repo = os.path.join(cache, "models--" + repo_id.replace("/", "--"))
    files = {}
    for name in sorted(os.listdir(source_dir)):
        if name not in skip and os.path.isfile(os.path.join(source_dir, name)):
            with open(os.path.join(source_dir, name), "rb") as f:
                files[name] = f.read()
    commit = hashlib.sha1(repr(sorted((n, blob_id(n, d)) for n, d in files.items())).encode()).hexdigest()
    os.makedirs(os.path.join(repo, "blobs"), exist_ok=True)
    snapshot = os.path.join(repo, "snapshots", commit)
    os.makedirs(snapshot, exist_ok=True)
    for name, data in files.items():
        blob = blob_id(name, data)
        with open(os.path.join(repo, "blobs", blob), "wb") as f:
            f.write(data)
        link = os.path.join(snapshot, name)
        if not os.path.lexists(link):
            os.symlink(os.path.join("..", "..", "blobs", blob), link)
    os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
    for ref in refs:
        with open(os.path.join(repo, "refs", ref), "w") as f:
            f.write(commit)
    return commit


def use_cache(monkeypatch, cache: str, offline: bool = True) -> None:
    """Points huggingface_hub at `cache` (HF_HUB_CACHE), offline unless told otherwise
    (HF_HUB_OFFLINE): in this process, whose library read the environment when it was imported,
    and in the environment, for the processes it starts."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", cache)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
    # And for the processes this one starts (`jspec serve` builds its engine in a child).
    monkeypatch.setenv("HF_HUB_CACHE", cache)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1" if offline else "0")
