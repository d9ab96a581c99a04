"""Checkpoints named by Hugging Face Hub repo ids ("org/name"), resolved to a local directory.

A path that exists is used as it is. Anything else shaped like a repo id is resolved through
huggingface_hub's snapshot_download, so the library's own rules hold: its cache (HF_HOME,
HF_HUB_CACHE), HF_HUB_OFFLINE, tokens, and a revision (branch, tag or commit); offline or with
the Hub unreachable it answers from the cache. Only the files jspec's readers open are fetched:
the config, the tokenizer's files, and the weights the safetensors index lists (not the other
formats a repo may also carry). A name that resolves nowhere is a HubCheckpointError that says
what was tried.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
import re

from jspec.checkpoint.errors import CheckpointError

log = logging.getLogger("jspec.checkpoint")

# What each kind of checkpoint reads besides its weights.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
METADATA = {
    "model": ("config.json", "model.safetensors.index.json", *TOKENIZER_FILES),
    # An EAGLE head or a STANDALONE draft: its config and weights (safetensors, else PyTorch .bin).
    "draft": ("config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json"),
    "tokenizer": ("config.json", *TOKENIZER_FILES),
    "adapter": ("adapter_config.json", "adapter_model.safetensors"),
}
# The file a directory of that kind cannot do without.
REQUIRED = {
    "model": "config.json",
    "draft": "config.json",
    "tokenizer": "tokenizer.json",
    "adapter": "adapter_config.json",
}
SAFETENSORS = ("model.safetensors.index.json", ("model.safetensors", "model-*.safetensors"))
TORCH_BIN = ("pytorch_model.bin.index.json", ("pytorch_model.bin", "pytorch_model-*.bin"))

# huggingface_hub's repo id rule: [namespace/]name of word characters, '-' and '.'.
_REPO_ID = re.compile(r"^(?:[\w\-.]+/)?[\w\-.]+$")


class HubCheckpointError(CheckpointError, FileNotFoundError):
    """A checkpoint name that is neither a local path nor a Hub repo jspec could get."""


def is_repo_id(name: str) -> bool:
    """Could `name` be a Hub repo id (and not a filesystem path)?"""
    return (
        bool(_REPO_ID.match(name))
        and not name.startswith((".", "-"))
        and ".." not in name
        and "--" not in name
        and not name.endswith(".")
    )


def resolve_checkpoint(
    name: str | os.PathLike, kind: str = "model", revision: str | None = None, local_files_only: bool = False
) -> str:
    """A local directory holding checkpoint `name`: the path itself if it exists, else the Hub
    snapshot of repo `name` at `revision` (kind: model, draft, tokenizer or adapter: which files
    to fetch). A path that does not exist and is no repo id is returned as it is, for the reader
    to report."""
    if kind not in METADATA:
        raise ValueError(f"unknown checkpoint kind {kind!r}; choose one of {list(METADATA)}")
    path = os.fspath(name)
    if os.path.exists(path) or not is_repo_id(path):
        if revision is not None and os.path.exists(path):
            log.warning("%s is a local path: revision %r is ignored (it applies to Hub repo ids)", path, revision)
        return path
    from huggingface_hub import constants, errors  # here: a slow import that only Hub ids need

    where = (
        f"{kind} {path!r} is not a local directory, and as a Hugging Face Hub repo id (revision {revision or 'main'})"
    )
    try:
        snapshot = _download(path, kind, revision, local_files_only)
    except errors.RevisionNotFoundError:
        raise HubCheckpointError(f"{where}: the Hub has no revision {revision!r} of it") from None
    except errors.RepositoryNotFoundError:
        raise HubCheckpointError(
            f"{where}: the Hub has no such repo, or it is private or gated (log in, or set HF_TOKEN)"
        ) from None
    except errors.LocalEntryNotFoundError as e:
        if isinstance(e, getattr(errors, "IncompleteSnapshotError", ())):
            why = f"its cached snapshot lacks files ({e})"
        elif local_files_only:
            why = f"it is not in the cache at {constants.HF_HUB_CACHE}, and local_files_only kept the Hub out"
        elif constants.HF_HUB_OFFLINE:
            why = (
                f"it is not in the cache at {constants.HF_HUB_CACHE}, and HF_HUB_OFFLINE is set: the Hub was not asked"
            )
        else:
            cause = e.__cause__ or e
            why = (
                f"it is not in the cache at {constants.HF_HUB_CACHE}, and the Hub ({constants.ENDPOINT}) could "
                f"not be reached ({type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''})"
            )
        raise HubCheckpointError(f"{where}: {why}") from None
    except errors.HfHubHTTPError as e:
        raise HubCheckpointError(f"{where}: the Hub answered {str(e).splitlines()[0]}") from None
    if not os.path.isfile(os.path.join(snapshot, REQUIRED[kind])):
        raise HubCheckpointError(
            f"{where}: its snapshot {snapshot} has no {REQUIRED[kind]} (a repo of another kind, or, offline, "
            f"one cached only in part)"
        )
    log.info("%s %s (revision %s): %s", kind, path, revision or "main", snapshot)
    return snapshot


def _download(repo_id: str, kind: str, revision: str | None, local_files_only: bool) -> str:
    """The snapshot directory after fetching the kind's files: its metadata first, then the
    weights its index names (else the usual single-file names) at the commit the first call
    resolved, so a branch that moves meanwhile cannot mix two commits. Files a commit already
    has in the cache are its files for good: weights found there are not asked for again."""
    from huggingface_hub import snapshot_download  # here: a slow import that only Hub ids need

    def fetch(patterns, rev) -> str:
        return snapshot_download(
            repo_id, revision=rev, allow_patterns=list(patterns), local_files_only=local_files_only
        )

    snapshot = fetch(METADATA[kind], revision)
    if kind not in ("model", "draft"):
        return snapshot
    commit = os.path.basename(snapshot)
    for index, patterns in (SAFETENSORS, TORCH_BIN) if kind == "draft" else (SAFETENSORS,):
        index_path = os.path.join(snapshot, index)
        if os.path.isfile(index_path):
            with open(index_path) as f:
                shards = sorted(set((json.load(f).get("weight_map") or {}).values()))
            if not all(os.path.isfile(os.path.join(snapshot, s)) for s in shards):
                snapshot = fetch(shards, commit)
        elif not _matching(snapshot, patterns):
            snapshot = fetch(patterns, commit)
        if _matching(snapshot, ("*.safetensors", "*.bin")):
            break
    return snapshot


def _matching(directory: str, patterns) -> bool:
    """Does directory hold a file that one of the glob patterns matches?"""
    return any(fnmatch.fnmatch(f, p) for f in os.listdir(directory) for p in patterns)
