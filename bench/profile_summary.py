"""Summarise a py-spy ``record -f raw --threads`` profile: where one thread spends its samples.

    python -m bench.profile_summary prof-python.txt.gz --thread scheduler [--top 40] [--json]

A raw profile has one line per distinct stack, ``thread (tid): name;frame;frame;... count``. For the
threads whose name contains ``--thread``, this prints each frame's inclusive share (the samples whose
stack holds it) and self share (the samples it is the innermost frame of), and which Python frames
lead into the frames named by ``--waits`` (default: device waits, ``Event::wait`` and
``cudaEventSynchronize``, in a ``--native`` profile). ``bench/gpu/h200_speed.sh profile`` records them.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Iterator


def stacks(path: Path) -> Iterator[tuple[list[str], int]]:
    """(frames, samples) per line; frames[0] is the thread."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if stack and count.isdigit():
                yield stack.split(";"), int(count)


def summarise(path: Path, thread: str, top: int, waits: tuple[str, ...]) -> dict:
    threads: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    own: Counter[str] = Counter()
    waited: Counter[str] = Counter()
    total = 0
    for frames, n in stacks(path):
        threads[frames[0]] += n
        if thread not in frames[0]:
            continue
        total += n
        for frame in set(frames[1:]):
            inclusive[frame] += n
        own[frames[-1]] += n
        at = next((i for i, f in enumerate(frames) if any(w in f for w in waits)), None)
        if at is not None:
            python = [f.split(" (")[0] + ":" + f.rsplit(":", 1)[-1].rstrip(")") for f in frames[:at] if ".py:" in f]
            waited[" <- ".join(python[-3:])] += n
    share = lambda c: [(round(100 * v / max(total, 1), 1), k) for k, v in c.most_common(top)]  # noqa: E731
    return {"file": str(path), "thread": thread, "samples": total, "threads": dict(threads.most_common()),
            "inclusive_pct": share(inclusive), "self_pct": share(own), "device_wait_pct": share(waited)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="profile_summary", description=__doc__.split("\n\n")[0])
    p.add_argument("profile", type=Path)
    p.add_argument("--thread", default="scheduler", help="threads whose name contains this (default scheduler)")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--waits", default="Event::wait,cudaEventSynchronize", help="comma-separated frame names")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if not args.profile.exists():
        p.error(f"{args.profile}: no such file")
    got = summarise(args.profile, args.thread, args.top, tuple(w for w in args.waits.split(",") if w))
    if args.json:
        print(json.dumps(got, indent=1))
        return 0
    print(f"{got['samples']} samples of threads named *{args.thread}* in {args.profile}; all threads: {got['threads']}")
    for title, key in (("inclusive", "inclusive_pct"), ("self", "self_pct"), ("device waits from", "device_wait_pct")):
        if got[key]:
            print(f"-- {title}")
            for pct, frame in got[key]:
                print(f"{pct:6.1f}%  {frame[:150]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
