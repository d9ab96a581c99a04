"""A loaded model: its config, its param pytree and its tokenizer, from a checkpoint or given."""

from __future__ import annotations

import dataclasses
import os

from jspec.config.model import ModelConfig


@dataclasses.dataclass
class Model:
    """A loaded model: config, param pytree and (optionally) its tokenizer."""

    cfg: ModelConfig
    params: object
    tokenizer: object = None


def load(path: str | os.PathLike, dtype=None, load_format: str = "auto") -> Model:
    """A checkpoint directory -> Model. load_format "dummy" (SGLang's name): random weights of
    config.json's shape, for benchmarks of model shapes whose weights are not at hand."""
    return _load(path, dtype, load_format)


def load_logged(path: str | os.PathLike, load_format: str = "auto") -> Model:
    """load(), logging what was loaded and in how long."""
    import logging
    import time

    from jspec.checkpoint.loader import count_params

    t0 = time.perf_counter()
    model = load(path, load_format=load_format)
    logging.getLogger("jspec.checkpoint").info(
        "weights loaded: %s, %d layers, %.0fM parameters, %s%s, in %.1f s",
        os.path.basename(os.path.normpath(path)),
        model.cfg.num_layers,
        count_params(model.params) / 1e6,
        model.params["embed"].dtype,
        " (random: --load-format dummy)" if load_format == "dummy" else "",
        time.perf_counter() - t0,
    )
    return model


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


def _load(path, dtype, load_format) -> Model:
    from jspec.checkpoint.loader import load_model
    from jspec.checkpoint.tokenizer import load_tokenizer

    if load_format == "dummy":
        import jax
        import jax.numpy as jnp

        from jspec.checkpoint.loader import init_random_params

        cfg = ModelConfig.from_pretrained(path)
        dtype = dtype or (jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32)
        return Model(cfg, init_random_params(cfg, jax.random.key(0), dtype), load_tokenizer(path))
    if load_format != "auto":
        raise ValueError(f"unknown load_format {load_format!r}; choose auto or dummy")
    cfg, params = load_model(path, dtype=dtype)
    return Model(cfg, params, load_tokenizer(path))


def as_model(model) -> Model:
    if isinstance(model, Model):
        return model
    if isinstance(model, (str, os.PathLike)):
        return load(model)
    if isinstance(model, tuple) and len(model) in (2, 3) and isinstance(model[0], ModelConfig):
        return Model(*model)
    raise TypeError(
        f"model must be a checkpoint path, a jspec.Model or a (ModelConfig, params) tuple, got {type(model).__name__}"
    )
