"""Config fields that carry their help text, so command-line flags are generated from them."""

from __future__ import annotations

import dataclasses

# The sections of `jspec serve --help`, in order: SGLang's docs group its server arguments the
# same way, so a flag is found where an SGLang user looks for it.
GROUPS = {
    "model": "model and tokenizer",
    "serving": "serving (HTTP, API, warm-up)",
    "memory": "memory and scheduling",
    "kernels": "kernels and compiled programs",
    "speculative": "speculative decoding",
    "parallel": "parallelism",
    "lora": "LoRA adapters",
    "disaggregation": "PD disaggregation",
}


def setting(default, help: str, choices=None, *, group: str, **flag):
    """A dataclass field with its flag's help, choices, --help group (a GROUPS key) and any other
    argparse options."""
    if group not in GROUPS:
        raise ValueError(f"unknown settings group {group!r}; choose one of {list(GROUPS)}")
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices, "group": group, **flag})
