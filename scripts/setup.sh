#!/usr/bin/env bash
# Create .venv (if needed), install mlxcel with its test/bench extras, and build the default model.
# Idempotent: a second run only checks that everything is in place.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "==> creating .venv with $($PYTHON --version)"
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.mlxcel-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "==> installing mlxcel and its dependencies"
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -e '.[dev]'
  touch "$stamp"
fi
# MLX's CPU wheel links the reference BLAS; Debian's OpenBLAS makes float32 prompts ~10x faster
# (see mlxcel/blas.py). Extracted into the venv, nothing installed system-wide; skipped where unavailable.
blas=.venv/opt/blas
if [ "$(uname -s)" = Linux ] && [ ! -e "$blas/.done" ] && command -v apt-get >/dev/null 2>&1; then
  echo "==> fetching OpenBLAS for MLX's CPU backend (Debian packages, extracted into $blas)"
  tmp=$(mktemp -d)
  if (cd "$tmp" && { apt-get download libopenblas0-pthread libgfortran5 libquadmath0 >/dev/null 2>&1 ||
                     { apt-get update -qq >/dev/null 2>&1 && apt-get download libopenblas0-pthread libgfortran5 libquadmath0 >/dev/null 2>&1; }; }); then
    mkdir -p "$blas"
    for deb in "$tmp"/*.deb; do dpkg -x "$deb" "$blas"; done
    touch "$blas/.done"
  else
    echo "    (could not download OpenBLAS; MLX keeps its reference BLAS: slower prompts, same results)"
  fi
  rm -rf "$tmp"
fi
echo "==> default model"
.venv/bin/mlxcel models fetch-default
