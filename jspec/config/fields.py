"""Config fields that carry their help text, so command-line flags are generated from them."""

from __future__ import annotations

import dataclasses


def setting(default, help: str, choices=None, **flag):
    """A dataclass field with its flag's help, choices and any other argparse options."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices, **flag})
