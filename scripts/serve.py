"""The OpenAI-compatible server: `python -m jspec serve` (jspec/server/launch.py), kept at this path."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from jspec.server.launch import main  # noqa: E402

if __name__ == "__main__":
    main()
