"""Generates text from the command line: `python -m jspec generate` (jspec/cli.py), kept at this path."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from jspec.cli import generate  # noqa: E402

if __name__ == "__main__":
    generate()
