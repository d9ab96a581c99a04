"""A loaded model: its config, its param pytree and its tokenizer, from a checkpoint or given."""

from __future__ import annotations

import dataclasses
import logging
import os
import time

import jax
import jax.numpy as jnp

from jspec.checkpoint.hub import is_repo_id, resolve_checkpoint
from jspec.checkpoint.loader import count_params, init_random_params, load_model
from jspec.checkpoint.tokenizer import load_tokenizer, read_chat_template
from jspec.config.load import LoadConfig
from jspec.config.model import ModelConfig


@dataclasses.dataclass
class Model:
    """A loaded model: config, param pytree and (optionally) its tokenizer; path: the checkpoint
    directory it was read from (a Hub repo's snapshot), when it was."""

    cfg: ModelConfig
    params: object
    tokenizer: object = None
    path: str | None = None


def load(
    path: str | os.PathLike,
    dtype=None,
    load_format: str = "auto",
    *,
    revision: str | None = None,
    tokenizer_path: str | os.PathLike | None = None,
    chat_template: str | None = None,
    local_files_only: bool = False,
    per_layer: bool = False,
) -> Model:
    """A checkpoint -> Model. path: a directory, or a Hugging Face Hub repo id ("org/name", at
    `revision`; fetched into huggingface_hub's cache unless HF_HUB_OFFLINE or local_files_only
    keep it to what is cached: checkpoint/hub.py). dtype: a jnp dtype or its name ("auto" or
    None: bfloat16 on a GPU, float32 elsewhere). load_format "dummy" (SGLang's name): random
    weights of config.json's shape, for benchmarks of shapes whose weights are not at hand.
    tokenizer_path: another tokenizer (a directory or a repo id); chat_template: a Jinja
    template, or a file holding one, in place of the tokenizer's. A checkpoint of several
    shards reports its reading as it goes: a bar on a terminal, else log lines. per_layer:
    the layers as per-layer arrays, made so from the start where the loader can (random
    weights, HF checkpoints of the Llama family): what an engine on one GPU runs."""
    return _load(path, dtype, load_format, revision, tokenizer_path, chat_template, local_files_only, per_layer)


def load_logged(path: str | os.PathLike, load_config=None, *, per_layer: bool = False) -> Model:
    """load() with a LoadConfig's settings, logging what was loaded and in how long."""
    load_config = load_config or LoadConfig()
    t0 = time.perf_counter()
    model = load(path, **dataclasses.asdict(load_config), per_layer=per_layer)
    logging.getLogger("jspec.checkpoint").info(
        "weights loaded: %s, %d layers, %.0fM parameters, %s%s, in %.1f s",
        display_name(path, load_config.revision),
        model.cfg.num_layers,
        count_params(model.params) / 1e6,
        model.params["embed"].dtype,
        " (random: --load-format dummy)" if load_config.load_format == "dummy" else "",
        time.perf_counter() - t0,
    )
    return model


def display_name(path: str | os.PathLike, revision: str | None = None) -> str:
    """How a checkpoint is named in logs and by default to clients: a Hub repo id as it is
    (with its revision), a directory by its last component."""
    path = os.fspath(path)
    if not os.path.exists(path) and is_repo_id(path):
        return f"{path}@{revision}" if revision else path
    return os.path.basename(os.path.normpath(path))


def with_context_length(model: Model, context_length: int | None) -> Model:
    """model with its context capped (SGLang's --context-length): it bounds the page tables."""
    if context_length is None:
        return model
    limit = model.cfg.max_position_embeddings
    if not 0 < context_length <= limit:
        raise ValueError(
            f"context_length={context_length} must be in [1, {limit}] (the model's max_position_embeddings)"
        )
    return dataclasses.replace(model, cfg=dataclasses.replace(model.cfg, max_position_embeddings=context_length))


def _load(path, dtype, load_format, revision, tokenizer_path, chat_template, local_files_only, per_layer) -> Model:
    if load_format not in ("auto", "dummy"):
        raise ValueError(f"unknown load_format {load_format!r}; choose auto or dummy")
    dtype = _dtype(dtype)
    template = read_chat_template(chat_template) if chat_template is not None else None
    name = display_name(path, revision)
    directory = resolve_checkpoint(path, "model", revision, local_files_only)
    if load_format == "dummy":
        cfg = ModelConfig.from_pretrained(directory)
        dtype = dtype or (jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32)
        params = init_random_params(cfg, jax.random.key(0), dtype, per_layer=per_layer)
    else:
        # A checkpoint of several shards reports its reading (checkpoint/progress.py).
        cfg, params = load_model(directory, dtype=dtype, progress_name=name, per_layer=per_layer)
    if tokenizer_path is None:
        tokenizer = load_tokenizer(directory)
    else:
        tokenizer_dir = resolve_checkpoint(tokenizer_path, "tokenizer", local_files_only=local_files_only)
        tokenizer = load_tokenizer(tokenizer_dir)
        if tokenizer is None:
            raise FileNotFoundError(f"tokenizer path {os.fspath(tokenizer_path)!r} has no tokenizer.json")
    if template is not None:
        if tokenizer is None:
            raise ValueError("a chat template needs a tokenizer; this model has none (give tokenizer_path)")
        tokenizer.chat_template = template
    return Model(cfg, params, tokenizer, directory)


DTYPES = ("bfloat16", "float16", "float32")


def _dtype(dtype):
    """None for the default ("auto" or None), else the jnp dtype a name or dtype stands for."""
    if dtype is None or (isinstance(dtype, str) and dtype == "auto"):
        return None
    if isinstance(dtype, str) and dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose auto or one of {DTYPES}")
    return jnp.dtype(dtype)


def as_model(model) -> Model:
    if isinstance(model, Model):
        return model
    if isinstance(model, (str, os.PathLike)):
        return load(model)  # a directory or a Hub repo id
    if isinstance(model, tuple) and len(model) in (2, 3) and isinstance(model[0], ModelConfig):
        return Model(*model)
    raise TypeError(
        f"model must be a checkpoint path or Hub repo id, a jspec.Model or a (ModelConfig, params) tuple, got {type(model).__name__}"
    )
