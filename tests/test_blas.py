"""MLX's BLAS calls go to the OpenBLAS from PyPI (scipy-openblas32) on Linux: proven in fresh processes
from what the loader bound and what is mapped; the results are the reference BLAS's; the shim that
renames its symbols jumps where it is told."""

import ctypes
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mlxcel import blas_shim
from mlxcel.blas import THREAD_ENVS, default_threads
from mlxcel.threads import available_cores

pytestmark = pytest.mark.proc  # starts processes (tests/proc_marker.py)

linux = pytest.mark.skipif(not sys.platform.startswith("linux") or blas_shim.machine() is None,
                           reason="the PyPI OpenBLAS is a dependency on x86-64 and AArch64 Linux only")

LOGITS = """
import json, sys
import mlxcel
import mlx.core as mx
from mlxcel.blas import blas_in_use
from mlxcel.models.loading import load_checkpoint
m = load_checkpoint(sys.argv[1])
logits = m.model(mx.array([[1, 5, 9, 200, 7, 3, 11, 42]]))
print(json.dumps({"blas": blas_in_use(), "logits": logits[0, -1, :16].tolist()}))
"""

BOUND = """
import ctypes, json
import mlxcel
import mlx.core as mx
from mlxcel import blas, blas_shim
a = mx.ones((64, 64))
mx.eval(a @ a)  # the first float32 product binds libmlx's cblas_sgemm
scope = ctypes.CDLL(None)  # the global scope, where libmlx's cblas_sgemm was looked up
slots = (ctypes.c_void_p * len(blas.SHIMMED)).in_dll(scope, blas_shim.SLOTS_SYMBOL)
found = blas.openblas()
print(json.dumps({
    "blas": blas.blas_in_use(), "path": str(found.path), "slot": slots[blas.SHIMMED.index("cblas_sgemm")],
    "stub": ctypes.cast(scope.cblas_sgemm, ctypes.c_void_p).value,
    "target": ctypes.cast(found.function("cblas_sgemm"), ctypes.c_void_p).value,
    "maps": open("/proc/self/maps").read()}))
"""


def python(code: str, *args: str, **env: str) -> dict:
    """Run ``code`` in a fresh interpreter with ``env`` over this one's, less any MLXCEL_BLAS setting."""
    settings = ("MLXCEL_BLAS", "MLXCEL_BLAS_DIR", "MLXCEL_THREADS", *THREAD_ENVS)
    inherited = {k: v for k, v in os.environ.items() if k not in settings}
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120,
                         env={**inherited, **env}, check=True)
    return json.loads(out.stdout)


def mapping_of(maps: str, address: int) -> str:
    """The file (or memfd) name of the mapping of /proc/<pid>/maps that holds ``address``."""
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        start, end = (int(x, 16) for x in fields[0].split("-"))
        if start <= address < end:
            return fields[5] if len(fields) > 5 else ""
    raise AssertionError(f"{address:#x} is in no mapping")


@linux
def test_mlx_cblas_sgemm_runs_the_pypi_openblas(tmp_path):
    got = python(BOUND, LD_DEBUG="bindings", LD_DEBUG_OUTPUT=str(tmp_path / "ld"))
    path = Path(got["path"])
    assert path.parent.parent.name == "scipy_openblas32" and path.name.startswith("libscipy_openblas")
    assert re.fullmatch(rf"openblas [\d.]+ \S+ \(scipy-openblas32: {re.escape(str(path))}\)", got["blas"])
    # libmlx's cblas_sgemm was bound to the shim, whose stub jumps to the library's scipy_cblas_sgemm
    log = "".join(p.read_text() for p in tmp_path.glob("ld.*"))
    binding = re.search(r"binding file \S*/libmlx\.so \[\d+\] to (\S+) \[\d+\]: normal symbol `cblas_sgemm'", log)
    assert binding, "libmlx.so never bound cblas_sgemm"
    assert re.fullmatch(r"/proc/self/fd/\d+|\S*/mlxcel-blas-shim-\S*\.so", binding[1]), binding[1]
    assert "mlxcel-blas-shim" in mapping_of(got["maps"], got["stub"]), "the global cblas_sgemm is not the shim's"
    assert got["slot"] == got["target"]
    assert mapping_of(got["maps"], got["target"]) == str(path)


@linux
def test_openblas_gives_the_reference_blas_logits(tiny_llama):
    fast = python(LOGITS, str(tiny_llama))
    reference = python(LOGITS, str(tiny_llama), MLXCEL_BLAS="reference")
    assert "scipy-openblas32" in fast["blas"] and reference["blas"] == "reference"
    assert fast["logits"] == pytest.approx(reference["logits"], rel=1e-4, abs=1e-5)


@linux
def test_openblas_leaves_a_core_free_unless_told_otherwise():
    code = "import json, mlxcel; from mlxcel.blas import blas_threads; print(json.dumps(blas_threads()))"
    assert python(code) == default_threads(available_cores())
    assert python(code, OPENBLAS_NUM_THREADS="1") == 1
    assert python(code, MLXCEL_THREADS="2") == 2
    assert [default_threads(n) for n in (1, 2, 3, 16)] == [1, 1, 2, 15]


@linux
def test_a_blas_dir_without_openblas_is_named_in_the_banner(tmp_path):
    code = "import json, mlxcel; from mlxcel.blas import blas_in_use; print(json.dumps(blas_in_use()))"
    got = python(code, MLXCEL_BLAS_DIR=str(tmp_path))
    assert got == f"reference (MLXCEL_BLAS_DIR={tmp_path}: no libopenblas.so.0 there)"


@pytest.mark.skipif(blas_shim.machine() is None, reason="shims are written for x86-64 and AArch64 Linux")
def test_shim_functions_jump_to_their_targets():
    libc = ctypes.CDLL(None)
    target = ctypes.cast(libc.labs, ctypes.c_void_p).value
    names = [f"mlxcel_test_labs_{os.getpid()}_{i}" for i in range(2)]
    for name in names:  # two shims in one process: the second is not taken for the first
        blas_shim.load([name, name + "_b"], [target, target])
    for name in names + [n + "_b" for n in names]:
        labs = getattr(ctypes.CDLL(None), name)  # found through the global scope: the hash table works
        labs.restype, labs.argtypes = ctypes.c_long, [ctypes.c_long]
        assert labs(-7) == 7 and labs(12) == 12


def test_the_jump_encodings():
    # checked against objdump (x86-64) and llvm-mc --triple=aarch64 (ldr x16, #0xfe80; br x16; brk #0);
    # the AArch64 shim also ran scipy-openblas32's aarch64 cblas_sgemm correctly under qemu-aarch64
    assert blas_shim._jump("x86_64", 0x200, 0x10078) == bytes.fromhex("f30f1efa ff256efe0000 cccccccccccc")
    assert blas_shim._jump("aarch64", 0x1F0, 0x10070) == bytes.fromhex("10f40758 00021fd6 000020d4 000020d4")


def test_bad_shim_requests_are_refused():
    with pytest.raises(ValueError, match="no BLAS shim for 'riscv64'"):
        blas_shim.build(["cblas_sgemm"], "riscv64")
    with pytest.raises(ValueError, match="distinct function names"):
        blas_shim.build(["cblas_sgemm", "cblas_sgemm"], "x86_64")
    with pytest.raises(ValueError, match="non-null target"):
        blas_shim.load(["cblas_sgemm"], [0])
