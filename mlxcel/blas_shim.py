"""A tiny in-memory shared library that exports unprefixed BLAS names and jumps to prefixed ones.

MLX's CPU backend calls ``cblas_sgemm``; scipy-openblas32 (the OpenBLAS on PyPI built for every CPU
with ``DYNAMIC_ARCH``, and with no libgfortran to find) exports it as ``scipy_cblas_sgemm``. A symbol
name can only be put into the process's global scope by a loaded ELF object, and a pure-Python wheel
ships no compiled code, so this module writes one: for each name, an exported function that is a
single indirect jump through a slot, and an exported array of those slots (``SLOTS_SYMBOL``) that
the caller fills with the real functions' addresses before anything calls them.

The object has no relocations and no section headers: an ELF header, four program headers (text,
data, dynamic, a non-executable stack), ``.dynsym``, ``.dynstr``, a SysV ``DT_HASH`` table and the
jumps in the first segment; ``.dynamic`` and the slots in the second, one 64 KiB page further (the
largest page size of either machine). x86-64 (``endbr64; jmp *slot(%rip)``) and AArch64
(``ldr x16, slot; br x16``) only. References: the System V gABI (ELF, DT_HASH), the x86-64 and
AArch64 psABIs.
"""

from __future__ import annotations

import ctypes
import os
import platform
import struct
import tempfile
from collections.abc import Sequence

SLOTS_SYMBOL = "mlxcel_blas_slots"
SONAME = "libmlxcel_blas_shim.so"
PAGE = 0x10000
_EHDR, _PHDR, _SYM, _DYN = "<16sHHIQQQIHHHHHH", "<IIQQQQQQ", "<IBBHQQ", "<qQ"
_PT_LOAD, _PT_DYNAMIC, _PT_GNU_STACK = 1, 2, 0x6474E551
_DT = {"hash": 4, "strtab": 5, "symtab": 6, "strsz": 10, "syment": 11, "soname": 14}
_MACHINES = {"x86_64": 62, "amd64": 62, "aarch64": 183, "arm64": 183}
_STUB = 16  # bytes per jump


def machine() -> str | None:
    """'x86_64' or 'aarch64' where a shim can be written for this process, else None."""
    name = platform.machine().lower()
    if name not in _MACHINES or struct.calcsize("P") != 8 or os.uname().sysname != "Linux":
        return None
    return "x86_64" if _MACHINES[name] == 62 else "aarch64"


def sysv_hash(name: bytes) -> int:
    """The System V ABI's ELF symbol hash (DT_HASH)."""
    h = 0
    for c in name:
        h = ((h << 4) + c) & 0xFFFFFFFF
        g = h & 0xF0000000
        h = (h ^ (g >> 24)) & ~g & 0xFFFFFFFF
    return h


def _jump(arch: str, at: int, slot: int) -> bytes:
    """One stub at address ``at`` that jumps to the address stored at ``slot``."""
    if arch == "x86_64":  # endbr64; jmp *rel32(%rip); int3 padding
        code = b"\xf3\x0f\x1e\xfa" + b"\xff\x25" + struct.pack("<i", slot - (at + 10))
        return code.ljust(_STUB, b"\xcc")
    words = ((slot - at) // 4) & 0x7FFFF  # ldr x16, <literal>; br x16; brk #0 padding
    return struct.pack("<IIII", 0x58000000 | (words << 5) | 16, 0xD61F0200, 0xD4200000, 0xD4200000)


def _hash_table(names: Sequence[bytes]) -> bytes:
    """DT_HASH over symbol 0 (undefined) and ``names`` (1..n)."""
    count = len(names) + 1
    buckets, chains = [0] * count, [0] * count
    for index, name in enumerate(names, start=1):
        b = sysv_hash(name) % count
        chains[index], buckets[b] = buckets[b], index
    return struct.pack(f"<II{count}I{count}I", count, count, *buckets, *chains)


def build(functions: Sequence[str], arch: str) -> bytes:
    """The bytes of the shared object: ``functions`` jump through ``SLOTS_SYMBOL[i]``."""
    if arch not in ("x86_64", "aarch64"):
        raise ValueError(f"no BLAS shim for {arch!r}: x86_64 or aarch64")
    if not functions or len(set(functions)) != len(functions):
        raise ValueError("the shim needs distinct function names")
    names = [f.encode() for f in functions] + [SLOTS_SYMBOL.encode()]
    strtab = b"\0" + b"".join(n + b"\0" for n in names) + SONAME.encode() + b"\0"
    name_at = [1 + sum(len(n) + 1 for n in names[:i]) for i in range(len(names))]
    symtab_at = struct.calcsize(_EHDR) + 4 * struct.calcsize(_PHDR)
    strtab_at = symtab_at + struct.calcsize(_SYM) * (len(names) + 1)
    hash_at = -(-(strtab_at + len(strtab)) // 8) * 8
    hashes = _hash_table(names)
    text_at = -(-(hash_at + len(hashes)) // _STUB) * _STUB
    text_end = text_at + _STUB * len(functions)
    dynamic = [("hash", hash_at), ("strtab", strtab_at), ("symtab", symtab_at), ("strsz", len(strtab)),
               ("syment", struct.calcsize(_SYM)), ("soname", len(strtab) - len(SONAME) - 1)]
    dyn = b"".join(struct.pack(_DYN, _DT[tag], value) for tag, value in dynamic) + struct.pack(_DYN, 0, 0)
    slots_at = PAGE + len(dyn)
    data_size = len(dyn) + 8 * len(functions)

    symbols = [struct.pack(_SYM, 0, 0, 0, 0, 0, 0)]
    for i in range(len(functions)):  # STB_GLOBAL|STT_FUNC, defined (any index but SHN_UNDEF/SHN_ABS)
        symbols.append(struct.pack(_SYM, name_at[i], 0x12, 0, 1, text_at + _STUB * i, _STUB))
    symbols.append(struct.pack(_SYM, name_at[-1], 0x11, 0, 1, slots_at, 8 * len(functions)))
    jumps = b"".join(_jump(arch, text_at + _STUB * i, slots_at + 8 * i) for i in range(len(functions)))

    e_machine = _MACHINES[arch]
    header = struct.pack(_EHDR, b"\x7fELF\x02\x01\x01" + bytes(9), 3, e_machine, 1, 0,
                         struct.calcsize(_EHDR), 0, 0, struct.calcsize(_EHDR), struct.calcsize(_PHDR), 4, 0, 0, 0)
    phdrs = b"".join([
        struct.pack(_PHDR, _PT_LOAD, 5, 0, 0, 0, text_end, text_end, PAGE),
        struct.pack(_PHDR, _PT_LOAD, 6, PAGE, PAGE, PAGE, data_size, data_size, PAGE),
        struct.pack(_PHDR, _PT_DYNAMIC, 6, PAGE, PAGE, PAGE, len(dyn), len(dyn), 8),
        struct.pack(_PHDR, _PT_GNU_STACK, 6, 0, 0, 0, 0, 0, 16),
    ])
    text = header + phdrs + b"".join(symbols) + strtab
    text = text.ljust(hash_at, b"\0") + hashes
    text = text.ljust(text_at, b"\0") + jumps
    return text.ljust(PAGE, b"\0") + dyn + bytes(8 * len(functions))


def load(functions: Sequence[str], targets: Sequence[int]) -> ctypes.CDLL:
    """Load a shim into the global symbol scope with ``functions[i]`` jumping to address ``targets[i]``.

    Raises OSError where the object cannot be loaded (no memfd and no executable temporary directory),
    ValueError on an unsupported machine or a null target.
    """
    arch = machine()
    if arch is None:
        raise ValueError(f"no BLAS shim for {platform.machine()!r} {os.uname().sysname}: x86_64 or aarch64 Linux")
    if len(targets) != len(functions) or not all(targets):
        raise ValueError("every shim function needs a non-null target")
    lib = _dlopen_bytes(build(functions, arch))
    slots = (ctypes.c_void_p * len(functions)).in_dll(lib, SLOTS_SYMBOL)
    for i, address in enumerate(targets):
        slots[i] = address
    return lib


def _dlopen_bytes(image: bytes) -> ctypes.CDLL:
    """dlopen an in-memory object: from a memfd, else from a temporary file removed at once.

    The memfd stays open: the loader knows the object by its path, and a later object opened as the
    same /proc/self/fd/N (a reused descriptor) would be taken for it.
    """
    if hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd"):
        fd = os.memfd_create("mlxcel-blas-shim", os.MFD_CLOEXEC)
        try:
            with open(fd, "wb", closefd=False) as f:
                f.write(image)
            return ctypes.CDLL(f"/proc/self/fd/{fd}", mode=ctypes.RTLD_GLOBAL)
        except OSError:
            os.close(fd)  # e.g. vm.memfd_noexec: try a file
    with tempfile.NamedTemporaryFile(prefix="mlxcel-blas-shim-", suffix=".so") as f:
        f.write(image)
        f.flush()
        return ctypes.CDLL(f.name, mode=ctypes.RTLD_GLOBAL)
