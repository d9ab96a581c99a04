"""How a checkpoint is read: where from (a directory or a Hub repo id at a revision), in which
dtype, with which tokenizer and chat template. SGLang's flag names."""

from __future__ import annotations

import dataclasses

from jspec.config.fields import setting

LOAD_FORMATS = ("auto", "dummy")
DTYPES = ("auto", "bfloat16", "float16", "float32")


@dataclasses.dataclass(frozen=True)
class LoadConfig:
    load_format: str = setting(
        "auto", "dummy: random weights of config.json's shape (benchmarks)", choices=LOAD_FORMATS, group="model"
    )
    revision: str | None = setting(
        None,
        "the Hub revision of --model-path (branch, tag or commit; default: main); a directory ignores it",
        group="model",
    )
    dtype: str = setting(
        "auto",
        "the weights' and activations' dtype (auto: bfloat16 on a GPU, float32 elsewhere)",
        choices=DTYPES,
        group="model",
    )
    tokenizer_path: str | None = setting(
        None, "the tokenizer's directory or Hub repo id (default: the model's)", group="model"
    )
    chat_template: str | None = setting(
        None, "a Jinja chat template, or a file holding one, in place of the tokenizer's", group="model"
    )

    def __post_init__(self):
        for name, choices in (("load_format", LOAD_FORMATS), ("dtype", DTYPES)):
            if getattr(self, name) not in choices:
                raise ValueError(f"unknown {name} {getattr(self, name)!r}; choose one of {choices}")
