"""What several test modules share: the tiny-model factory, references, oracles and guards."""

from pathlib import Path

REPO_ROOT = str(Path(__file__).resolve().parents[2])
