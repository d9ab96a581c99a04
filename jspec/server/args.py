"""Command-line flags, generated from the config dataclasses' fields with SGLang's names.

EngineConfig's fields become `--page-size` and the like, SpecConfig's `--speculative-*`, and
ServerConfig's (this module: what only the launcher reads) the rest. A field's metadata holds
its help text and choices, so a setting is declared once.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing

from jspec.config.engine import EngineConfig
from jspec.config.fields import setting
from jspec.config.spec import SpecConfig

SPEC_PREFIX = "speculative_"


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    model_path: str | None = setting(None, "local HF checkpoint directory (default: the embedded demo model)")
    load_format: str = setting(
        "auto", "dummy: random weights of config.json's shape (benchmarks)", choices=("auto", "dummy")
    )
    served_model_name: str | None = setting(None, "the model name clients send (default: the directory's name)")
    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(30000, "port to listen on")
    skip_warmup: bool = setting(False, "compile lazily instead of at start-up")
    warmup_sampling_modes: str = setting(
        "all",
        "comma list of greedy,sampled: the decode programs to compile at "
        "start-up, or 'all' (the others compile at first use)",
    )
    log_level: str = setting("info", "logging level")
    nnodes: int = setting(1, "hosts in a multi-host run (jax.distributed)")
    node_rank: int = setting(0, "this host's rank in [0, nnodes)")
    dist_init_addr: str | None = setting(None, "HOST:PORT of node 0's jax.distributed coordinator (nnodes > 1)")
    disaggregation_mode: str = setting(
        "null",
        "prefill: compute prompts' KV and hand them to decode engines (serves no HTTP, listens on "
        "--disaggregation-bootstrap-port); decode: the HTTP server, which sends each prompt to a prefill engine "
        "and decodes it here",
        choices=("null", "prefill", "decode"),
    )
    disaggregation_bootstrap_port: int = setting(8998, "prefill: the port decode engines connect to (on --host)")
    disaggregation_transfer_backend: str = setting(
        "socket",
        "decode: how KV arrays cross (socket: in the TCP stream, works between hosts; shm: POSIX shared "
        "memory, one host)",
        choices=("socket", "shm"),
    )
    disaggregation_prefill_addrs: tuple[str, ...] = setting(
        ("127.0.0.1:8998",),
        "decode: the prefill engines' bootstrap addresses (each request goes to the least loaded)",
        nargs="+",
        metavar="HOST:PORT",
    )


def _add_fields(group, cls, prefix: str = "", defaults: dict | None = None) -> None:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        meta = dict(f.metadata)
        if "help" not in meta or SpecConfig in typing.get_args(hints[f.name]):
            continue  # the speculative settings get their own flags
        help_text, choices = meta.pop("help"), meta.pop("choices")
        default = (defaults or {}).get(f.name, f.default)
        flag = "--" + (prefix + f.name).replace("_", "-")
        kind = [t for t in typing.get_args(hints[f.name]) if t is not type(None)] or [hints[f.name]]
        base = typing.get_origin(kind[0]) or kind[0]
        if base is bool:
            group.add_argument(flag, action="store_true", help=help_text)
        elif base in (dict, tuple, list):
            group.add_argument(flag, default=list(default or ()), help=help_text, **meta)
        else:
            group.add_argument(flag, type=base, default=default, choices=choices, help=help_text, **meta)


def build_parser(
    description: str | None = None, server: bool = True, prog: str | None = None
) -> argparse.ArgumentParser:
    """The server's flags; server=False: the engine's and speculative decoding's alone."""
    ap = argparse.ArgumentParser(
        prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    if server:
        _add_fields(ap.add_argument_group("server"), ServerConfig)
    _add_fields(ap.add_argument_group("engine (SGLang's flag names)"), EngineConfig)
    # No algorithm: speculation off (SpecConfig's own default algorithm applies once one is named).
    _add_fields(
        ap.add_argument_group("speculative decoding (SGLang's flag names)"),
        SpecConfig,
        SPEC_PREFIX,
        defaults={"algorithm": None},
    )
    return ap


def server_config(args: argparse.Namespace) -> ServerConfig:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(ServerConfig)}
    values["disaggregation_prefill_addrs"] = tuple(values["disaggregation_prefill_addrs"])
    return ServerConfig(**values)


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
    if algorithm != "NGRAM" and not getattr(args, SPEC_PREFIX + "draft_model_path"):
        raise ValueError(f"--speculative-algorithm {algorithm} needs --speculative-draft-model-path")
    return SpecConfig(**{f.name: getattr(args, SPEC_PREFIX + f.name) for f in dataclasses.fields(SpecConfig)})


def parse_lora_paths(items) -> dict[str, str]:
    """NAME=DIR items (a bare DIR is named by its basename) -> {name: dir}."""
    paths = {}
    for item in items or ():
        name, sep, path = item.partition("=")
        if not sep:
            name, path = os.path.basename(os.path.normpath(item)), item
        if not name or not path or name in paths:
            raise ValueError(f"--lora-paths {item!r}: give NAME=DIR (or DIR), each name once")
        paths[name] = path
    return paths
