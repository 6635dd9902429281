"""An optimized OpenBLAS for MLX's CPU backend on Linux, from PyPI.

The ``mlx[cpu]`` wheel links the reference (netlib) BLAS, and MLX calls ``cblas_sgemm`` for float32
matrix products. A library loaded into the global symbol scope before ``mlx.core`` is imported
takes those calls: on 2 cores the default model's prompt goes about 15x faster, decode about 2x,
with the same output (``docs/benchmarks.md``, "BLAS on Linux CPUs").

The library is scipy-openblas32, a Linux dependency of mlxcel (so ``pip install``, the install
role's wheel and CI all have it): OpenBLAS built for every x86-64 and AArch64 core (``DYNAMIC_ARCH``)
with nothing else to install. It exports its symbols with a ``scipy_`` prefix, so
``mlxcel/blas_shim.py`` puts ``cblas_sgemm`` (and the other names MLX calls) into the global scope
as jumps to ``scipy_cblas_sgemm``. ``MLXCEL_BLAS_DIR`` names another OpenBLAS instead (a directory
holding an unprefixed ``libopenblas.so.0``, or an extracted Debian ``libopenblas0-pthread``'s
``usr/lib``); ``MLXCEL_BLAS=reference`` opts out.

Just before the load, the environment gets OpenBLAS's idle timeout and ``MLXCEL_THREADS``'s budget
(``mlxcel/threads.py``: idle worker threads sleep instead of spinning while a pipeline stage waits).
Where nothing sets a thread count, a product uses every core but one (``default_threads``).
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxcel import blas_shim, config, envs
from mlxcel.threads import available_cores, blas_environment, env_budget

PYPI_PACKAGE = "scipy-openblas32"
PYPI_PREFIX = "scipy_"
SHIMMED = ("cblas_sgemm", "cblas_dgemm", "cblas_cgemm")  # the CBLAS functions libmlx imports
THREAD_ENVS = ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS")  # OpenBLAS reads these
# A Debian extraction needs its libgfortran, which needs libquadmath: loaded first where present.
_DEBIAN_DEPS = ("libquadmath.so.0", "libgfortran.so.5")
_OPENBLAS = "libopenblas.so.0"


@dataclass(frozen=True)
class OpenBLAS:
    """A loaded OpenBLAS: its handle, the prefix of its symbols and what the banner says of it."""

    lib: ctypes.CDLL
    prefix: str
    path: Path
    source: str

    def function(self, name: str) -> Any:
        """The library's ``name`` (``openblas_get_num_threads``), prefixed as it exports it."""
        return getattr(self.lib, self.prefix + name)

    def describe(self) -> str:
        """'openblas <version> <core> (<source>: <path>)', e.g. 'openblas 0.3.34 Haswell (scipy-openblas32: ...)'."""
        config_fn, core_fn = self.function("openblas_get_config"), self.function("openblas_get_corename")
        config_fn.restype = core_fn.restype = ctypes.c_char_p
        words = config_fn().decode(errors="replace").split()
        version = words[1] if len(words) > 1 and words[0] == "OpenBLAS" else "?"
        return f"openblas {version} {core_fn().decode(errors='replace')} ({self.source}: {self.path})"


_state = {"blas": "reference"}
_loaded: dict[str, object] = {}


def preload_openblas() -> str:
    """Load OpenBLAS globally if possible and mlx.core is not loaded yet; return the BLAS in use.

    Where the load fails, MLX keeps its reference BLAS and the answer says why ('reference (...)').
    """
    if "openblas" in _loaded or not sys.platform.startswith("linux"):
        return _state["blas"]
    if (envs.get("MLXCEL_BLAS") or "").lower() == "reference" or "mlx.core" in sys.modules:
        return _state["blas"]
    _prepare_environment()
    directory = envs.get("MLXCEL_BLAS_DIR")
    try:
        found = _load_directory(Path(directory)) if directory else _load_pypi()
    except (ImportError, OSError, ValueError) as exc:
        _state["blas"] = f"reference ({exc})"
        return _state["blas"]
    _loaded["openblas"] = found
    if not any(os.environ.get(name) for name in THREAD_ENVS):
        set_blas_threads(default_threads(available_cores()))
    _state["blas"] = found.describe()
    return _state["blas"]


def default_threads(cores: int) -> int:
    """Threads per matrix product when nothing sets a count: every core but one, at least one.

    OpenBLAS (since 2024, and scipy-openblas32 with it) waits for its worker threads by spinning
    without yielding the core. With a thread on every core, any other runnable thread (the server's,
    another process's) stalls a product for a whole time slice: on 2 shared cores, 2 threads decoded
    slower than the reference BLAS, 1 thread faster than it (docs/benchmarks.md).
    """
    return min(config.MAX_THREADS, max(1, cores - 1))


def _load_pypi() -> OpenBLAS:
    """scipy-openblas32's library, with unprefixed CBLAS names jumping into it."""
    try:
        import scipy_openblas32  # loads the library itself (RTLD_GLOBAL), after _prepare_environment
    except ImportError:
        raise ImportError(f"{PYPI_PACKAGE} is not installed") from None
    path = Path(scipy_openblas32.get_lib_dir()) / scipy_openblas32.get_library(fullname=True)
    lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    targets = [ctypes.cast(getattr(lib, PYPI_PREFIX + name), ctypes.c_void_p).value or 0 for name in SHIMMED]
    _loaded["shim"] = blas_shim.load(SHIMMED, targets)
    return OpenBLAS(lib, PYPI_PREFIX, path, PYPI_PACKAGE)


def _load_directory(root: Path) -> OpenBLAS:
    """An unprefixed OpenBLAS in ``root`` (MLXCEL_BLAS_DIR); ValueError naming the directory if none."""
    found = find_openblas(root)
    if found is None:
        raise ValueError(f"MLXCEL_BLAS_DIR={root}: no {_OPENBLAS} there")
    deps = found.parent.parent if found.parent.name == "openblas-pthread" else found.parent
    for dep in _DEBIAN_DEPS:
        if (deps / dep).exists():
            ctypes.CDLL(str(deps / dep), mode=ctypes.RTLD_GLOBAL)
    return OpenBLAS(ctypes.CDLL(str(found), mode=ctypes.RTLD_GLOBAL), "", found, "MLXCEL_BLAS_DIR")


def find_openblas(root: Path) -> Path | None:
    """``root``'s libopenblas.so.0: in it, in openblas-pthread/, or under a Debian multiarch directory."""
    for sub in (root, *sorted(root.glob("*-linux-gnu"))):
        for candidate in (sub / _OPENBLAS, sub / "openblas-pthread" / _OPENBLAS):
            if candidate.exists():
                return candidate
    return None


def _prepare_environment() -> None:
    """OpenBLAS reads its thread count and idle timeout from the environment once, when it loads."""
    os.environ.update(blas_environment(os.environ))


def openblas() -> OpenBLAS | None:
    """The preloaded OpenBLAS (for its thread controls), or None with the reference BLAS."""
    found = _loaded.get("openblas")
    return found if isinstance(found, OpenBLAS) else None


def blas_in_use() -> str:
    """'reference', 'reference (<why not OpenBLAS>)' or 'openblas <version> <core> (<source>: <path>)'."""
    return _state["blas"]


def blas_threads() -> int:
    """Threads one matrix product may use now (1 for the single-threaded reference BLAS)."""
    found = openblas()
    return int(found.function("openblas_get_num_threads")()) if found is not None else 1


def set_blas_threads(count: int) -> int:
    """Let matrix products use ``count`` threads (1..MAX_THREADS); returns the count now in effect.

    With the reference BLAS (single-threaded) this changes nothing and returns 1.
    """
    if not 1 <= count <= config.MAX_THREADS:
        raise ValueError(f"a thread budget must be 1 to {config.MAX_THREADS}, got {count}")
    found = openblas()
    if found is None:
        return 1
    found.function("openblas_set_num_threads")(count)
    return blas_threads()


def apply_thread_budget(flag: int | None, environ: Mapping[str, str] | None = None) -> int:
    """The ``--threads`` flag, else ``MLXCEL_THREADS``, else what the BLAS chose; returns the threads in effect.

    Raises ValueError for an invalid ``MLXCEL_THREADS``.
    """
    budget = flag if flag is not None else env_budget(environ)
    return set_blas_threads(budget) if budget is not None else blas_threads()
