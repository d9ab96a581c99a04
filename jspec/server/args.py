"""Command-line flags, generated from the config dataclasses' fields with SGLang's names.

EngineConfig's fields become `--page-size` and the like, SpecConfig's `--speculative-*`,
LoadConfig's how the checkpoint is read, and ServerConfig's (this module: what only the
launcher reads) the rest. A field's metadata holds its help text, choices and --help group, so
a setting is declared once.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing

from jspec.config.engine import EngineConfig
from jspec.config.fields import GROUPS, setting
from jspec.config.load import LoadConfig
from jspec.config.reasoning import REASONING_FORMATS
from jspec.config.spec import SpecConfig

SPEC_PREFIX = "speculative_"


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    model_path: str | None = setting(
        None,
        "the checkpoint: a local HF directory or a Hugging Face Hub repo id (default: the embedded demo model)",
        group="model",
    )
    served_model_name: str | None = setting(
        None, "the model name clients send (default: the Hub repo id, or the directory's name)", group="serving"
    )
    host: str = setting("127.0.0.1", "address to listen on", group="serving")
    port: int = setting(30000, "port to listen on", group="serving")
    api_key: str | None = setting(
        None,
        "clients must send 'Authorization: Bearer KEY' on every route but /health (a 401 otherwise)",
        group="serving",
    )
    reasoning_parser: str | None = setting(
        None,
        "split a chat completion's <think>...</think> into message.reasoning_content (deepseek-r1: everything "
        "before </think>, the opening tag optional; qwen3: only when the output opens with <think>); "
        "response_format and tools apply after it",
        choices=tuple(REASONING_FORMATS),
        group="serving",
    )
    skip_warmup: bool = setting(False, "compile lazily instead of at start-up", group="serving")
    warmup_sampling_modes: str = setting(
        "all",
        "comma list of greedy,sampled: the decode programs to compile at "
        "start-up, or 'all' (the others compile at first use)",
        group="serving",
    )
    log_level: str = setting("info", "logging level", group="serving")
    engine_in_thread: bool = setting(
        False,
        "run the engine's loop on a thread of the HTTP server's process instead of a process of its own "
        "(one interpreter and GIL for both: the routes' Python slows the loop under load; for debugging). "
        "The PD modes and multi-host runs always do",
        group="serving",
    )
    nnodes: int = setting(1, "hosts in a multi-host run (jax.distributed)", group="parallel")
    node_rank: int = setting(0, "this host's rank in [0, nnodes)", group="parallel")
    dist_init_addr: str | None = setting(
        None, "HOST:PORT of node 0's jax.distributed coordinator (nnodes > 1)", group="parallel"
    )
    disaggregation_mode: str = setting(
        "null",
        "prefill: compute prompts' KV and hand them to decode engines (serves no HTTP, listens on "
        "--disaggregation-bootstrap-port); decode: the HTTP server, which sends each prompt to a prefill engine "
        "and decodes it here",
        choices=("null", "prefill", "decode"),
        group="disaggregation",
    )
    disaggregation_bootstrap_port: int = setting(
        8998, "prefill: the port decode engines connect to (on --host)", group="disaggregation"
    )
    disaggregation_transfer_backend: str = setting(
        "socket",
        "decode: how KV arrays cross (socket: in the TCP stream, works between hosts; shm: POSIX shared "
        "memory, one host)",
        choices=("socket", "shm"),
        group="disaggregation",
    )
    disaggregation_prefill_addrs: tuple[str, ...] = setting(
        ("127.0.0.1:8998",),
        "decode: the prefill engines' bootstrap addresses (each request goes to the least loaded)",
        nargs="+",
        metavar="HOST:PORT",
        group="disaggregation",
    )

    def __post_init__(self):
        if self.api_key is not None and not self.api_key:
            raise ValueError("--api-key must not be empty")


def _flags(cls, prefix: str = "", defaults: dict | None = None) -> list[tuple[str, str, dict]]:
    """(group, flag, argparse options) of each field of cls, from its metadata."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        meta = dict(f.metadata)
        if "help" not in meta or SpecConfig in typing.get_args(hints[f.name]):
            continue  # the speculative settings get their own flags
        group, options = meta.pop("group"), {"help": meta.pop("help")}
        choices = meta.pop("choices")
        default = (defaults or {}).get(f.name, f.default)
        flag = "--" + (prefix + f.name).replace("_", "-")
        kind = [t for t in typing.get_args(hints[f.name]) if t is not type(None)] or [hints[f.name]]
        base = typing.get_origin(kind[0]) or kind[0]
        if base is bool:
            options["action"] = "store_true"
        elif base in (dict, tuple, list):
            options.update(default=list(default or ()), **meta)
        else:
            options.update(type=base, default=default, choices=choices, **meta)
        out.append((group, flag, options))
    return out


def build_parser(
    description: str | None = None, server: bool = True, prog: str | None = None
) -> argparse.ArgumentParser:
    """The server's flags, grouped in --help as SGLang's docs group them (config/fields.py
    GROUPS); server=False: how the model loads, the engine's and speculative decoding's alone."""
    ap = argparse.ArgumentParser(
        prog=prog,
        usage="%(prog)s [flags]",
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    flags = _flags(ServerConfig) if server else []
    flags += _flags(LoadConfig) + _flags(EngineConfig)
    # No algorithm: speculation off (SpecConfig's own default algorithm applies once one is named).
    flags += _flags(SpecConfig, SPEC_PREFIX, defaults={"algorithm": None})
    for key, title in GROUPS.items():
        members = [(flag, options) for group, flag, options in flags if group == key]
        if members:
            group = ap.add_argument_group(title)
            for flag, options in members:
                group.add_argument(flag, **options)
    return ap


def server_config(args: argparse.Namespace) -> ServerConfig:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(ServerConfig)}
    values["disaggregation_prefill_addrs"] = tuple(values["disaggregation_prefill_addrs"])
    return ServerConfig(**values)


def load_config(args: argparse.Namespace) -> LoadConfig:
    return LoadConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(LoadConfig)})


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """EngineConfig from parsed flags; raises ValueError on a bad combination."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig) if f.name != "speculative"}
    values["lora_paths"] = parse_lora_paths(args.lora_paths)
    return EngineConfig(**values, speculative=spec_config(args))


def spec_config(args: argparse.Namespace) -> SpecConfig | None:
    algorithm = getattr(args, SPEC_PREFIX + "algorithm")
    if not algorithm:
        return None
    if algorithm == "NEXTN" and not getattr(args, SPEC_PREFIX + "draft_model_path"):
        # The MTP layers live in the target's own checkpoint (SGLang's default too).
        setattr(args, SPEC_PREFIX + "draft_model_path", args.model_path)
        if getattr(args, SPEC_PREFIX + "draft_model_revision") is None:
            setattr(args, SPEC_PREFIX + "draft_model_revision", args.revision)
    if algorithm != "NGRAM" and not getattr(args, SPEC_PREFIX + "draft_model_path"):
        raise ValueError(f"--speculative-algorithm {algorithm} needs --speculative-draft-model-path")
    return SpecConfig(**{f.name: getattr(args, SPEC_PREFIX + f.name) for f in dataclasses.fields(SpecConfig)})


def parse_lora_paths(items) -> dict[str, str]:
    """NAME=PATH items (a bare PATH, a directory or a Hub repo id, is named by its last
    component) -> {name: path}."""
    paths = {}
    for item in items or ():
        name, sep, path = item.partition("=")
        if not sep:
            name, path = os.path.basename(os.path.normpath(item)), item
        if not name or not path or name in paths:
            raise ValueError(f"--lora-paths {item!r}: give NAME=PATH (or PATH), each name once")
        paths[name] = path
    return paths
