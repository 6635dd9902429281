"""Keep bench/results light: raw traces packed into one archive per run directory, large row files gzipped.

A benchmark run leaves two kinds of files: the summary rows that the report reads and the docs cite
(``*.jsonl``, ``*.csv``), and raw per-token or per-step traces (``trace-*``, ``step_trace*``) that only a
later investigation opens. ``pack`` moves every trace of a directory into ``traces.tar.xz`` there (a
member already in the archive is replaced by the newer file) and gzips each row file larger than
``--gzip-over`` bytes (``x.jsonl`` -> ``x.jsonl.gz``; ``mlxcel report`` reads both). ``--check`` only
measures: it fails when the tree holds more than ``--cap`` bytes or an unpacked trace.

    python -m bench.pack_results bench/results            # pack, then print the total
    python -m bench.pack_results bench/results --check    # what CI's weight test asserts

Unpack a run's traces with ``tar -xJf DIR/traces.tar.xz -C DIR``.
"""

from __future__ import annotations

import argparse
import gzip
import io
import shutil
import sys
import tarfile
from pathlib import Path

ARCHIVE = "traces.tar.xz"
TRACE_PREFIXES = ("trace-", "step_trace")
ROW_SUFFIXES = (".jsonl", ".csv")
GZIP_OVER = 16 * 1024
CAP = 2 * 1024 * 1024  # bytes for the whole of bench/results (issue 41)


def is_trace(path: Path) -> bool:
    return path.name.startswith(TRACE_PREFIXES) and path.name != ARCHIVE


def _pack_traces(directory: Path, traces: list[Path]) -> None:
    archive = directory / ARCHIVE
    members: dict[str, bytes] = {}
    if archive.exists():
        with tarfile.open(archive, "r:xz") as tar:
            for info in tar.getmembers():
                extracted = tar.extractfile(info)
                if info.isfile() and extracted is not None:
                    members[info.name] = extracted.read()
    for path in traces:
        data = path.read_bytes()
        if path.name.endswith(".gz"):  # one compression layer is enough: xz packs the plain text better
            data, name = gzip.decompress(data), path.name[:-3]
        else:
            name = path.name
        members[name] = data
    partial = archive.with_name(ARCHIVE + ".part")
    with tarfile.open(partial, "w:xz", preset=9) as tar:
        for name in sorted(members):
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(members[name]), 0o644
            tar.addfile(info, io.BytesIO(members[name]))
    partial.replace(archive)  # the traces are deleted only once the archive holding them is complete
    for path in traces:
        path.unlink()


def _gzip_row_file(path: Path) -> Path:
    target = path.with_name(path.name + ".gz")
    with path.open("rb") as src, gzip.GzipFile(target, "wb", compresslevel=9, mtime=0) as dst:
        shutil.copyfileobj(src, dst)
    path.unlink()
    return target


def pack(root: Path, gzip_over: int = GZIP_OVER) -> list[str]:
    """Pack ``root``'s traces and gzip its large row files; return one line per change."""
    done: list[str] = []
    for directory in sorted({p.parent for p in root.rglob("*") if p.is_file()}):
        traces = sorted(p for p in directory.iterdir() if p.is_file() and is_trace(p))
        if traces:
            _pack_traces(directory, traces)
            done.append(f"{directory / ARCHIVE}: {len(traces)} trace file(s)")
        for path in sorted(directory.iterdir()):
            if path.is_file() and path.suffix in ROW_SUFFIXES and path.stat().st_size > gzip_over:
                done.append(f"{_gzip_row_file(path)}: gzipped")
    return done


def problems(root: Path, cap: int = CAP) -> list[str]:
    """Why ``root`` is too heavy: unpacked traces, or more than ``cap`` bytes in all."""
    files = [p for p in root.rglob("*") if p.is_file()]
    found = [f"{p}: an unpacked trace (python -m bench.pack_results {root})" for p in sorted(files) if is_trace(p)]
    total = sum(p.stat().st_size for p in files)
    if total > cap:
        found.append(f"{root}: {total / 1024:.0f} KiB, over the cap of {cap / 1024:.0f} KiB")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", nargs="?", default="bench/results", type=Path)
    parser.add_argument("--check", action="store_true", help="only measure; exit 1 when over the cap")
    parser.add_argument("--gzip-over", type=int, default=GZIP_OVER, metavar="BYTES",
                        help=f"gzip row files larger than this (default {GZIP_OVER})")
    parser.add_argument("--cap", type=int, default=CAP, metavar="BYTES",
                        help=f"the most the tree may hold (default {CAP})")
    args = parser.parse_args(argv)
    if not args.root.is_dir():
        parser.error(f"no such directory: {args.root}")
    if not args.check:
        for line in pack(args.root, args.gzip_over):
            print(line)
    found = problems(args.root, args.cap)
    total = sum(p.stat().st_size for p in args.root.rglob("*") if p.is_file())
    print(f"{args.root}: {total / 1024:.0f} KiB")
    for line in found:
        print(line, file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
