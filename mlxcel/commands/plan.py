"""``mlxcel plan``: print how a checkpoint's layers split into pipeline stages, with bytes per stage.

Each layer is priced by its bytes and its kind (``mlxcel.topology.layer_cost``; ``--context`` and
``--rows`` size the caches and the experts a decode step touches): docs/pipeline.md, "Partition by cost".

Reads only the safetensors headers (no weights, no MLX). The JSON form is the
one in the pipeline contract: {"model", "num_layers", "stages": [{"stage",
"layers", "start", "end", "bytes"}]}.

With ``--layers`` the ranges are not planned but checked: syntax, contiguity, one range per stage,
coverage of the checkpoint's layers and (with ``--memory``) each stage's fit, the same rules the
engine applies when it loads them; a problem exits 1 with one line naming the stage.
"""

from __future__ import annotations

import argparse
import json

from mlxcel.config import DEFAULT_MODEL_DIR, non_negative_int, positive_int
from mlxcel.errors import CLIError
from mlxcel.topology.partition import (
    PartitionError,
    Stage,
    StageCosts,
    check_coverage,
    human_bytes,
    layer_costs,
    parse_memory_list,
    parse_range_text,
    plan_stages,
    stages_for_ranges,
)


def plan_json(costs: StageCosts, stages: list[Stage]) -> dict:
    return {
        "model": costs.model,
        "num_layers": costs.num_layers,
        "stages": [{"stage": s.index, "layers": s.layers, "start": s.start, "end": s.end, "bytes": s.bytes}
                   for s in stages],
    }


def kinds_line(costs: StageCosts) -> str:
    """"layer kinds: 0 mla+dense, 1-60 mla+moe": runs of equal kind, in layer order."""
    runs: list[tuple[int, int, str]] = []
    for i, kind in enumerate(costs.kinds):
        if runs and runs[-1][2] == kind and runs[-1][1] == i - 1:
            runs[-1] = (runs[-1][0], i, kind)
        else:
            runs.append((i, i, kind))
    if len(runs) > 8:  # a periodic mix (kimi_k3's MLA every 4th layer): counts, not runs
        counts = {k: costs.kinds.count(k) for k in dict.fromkeys(costs.kinds)}
        return "layer kinds: " + ", ".join(f"{n} x {k}" for k, n in counts.items())
    return "layer kinds: " + ", ".join(f"{a}-{b} {k}" if a != b else f"{a} {k}" for a, b, k in runs)


def plan_table(costs: StageCosts, stages: list[Stage], memory: list[int] | None) -> str:
    """Stage, inclusive layers, bytes (readable and exact), share of all stages' bytes, memory if given;
    with experts or caches priced, what a decode step of each stage reads too."""
    total = sum(s.bytes for s in stages)
    head = "tied to the embedding, also charged to the last stage" if costs.tied else "a separate lm_head"
    lines = [f"model: {costs.model} ({costs.num_layers} layers, {human_bytes(costs.total)} of tensors; head {head})"]
    step = costs.by_kind
    header = ["stage", "layers", "bytes", "exact bytes", "share"] + (["step reads"] if step else []) \
        + (["memory"] if memory else [])
    rows = [[str(s.index), s.layers, human_bytes(s.bytes), str(s.bytes), f"{100 * s.bytes / total:.1f}%"]
            + ([human_bytes(s.step or 0)] if step else [])
            + ([human_bytes(memory[s.index])] if memory else []) for s in stages]
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]
    for row in [header, *rows]:
        cells = [cell.ljust(w) if c < 2 else cell.rjust(w) for c, (cell, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
    if costs.kinds:
        lines.append(kinds_line(costs))
    return "\n".join(lines)


def given_stages(costs: StageCosts, text: str, n: int, memory: list[int] | None) -> list[Stage]:
    """``--layers`` checked against the checkpoint (and the memories), priced as stages."""
    ranges = parse_range_text(text, "--layers")
    if len(ranges) != n:
        raise PartitionError(f"--layers names {len(ranges)} stage{'s' if len(ranges) != 1 else ''} "
                             f"but --pp-size is {n}")
    check_coverage(ranges, costs.num_layers, "--layers")
    stages = stages_for_ranges(costs, ranges)
    for stage in stages:
        if memory and stage.bytes > memory[stage.index]:
            raise PartitionError(f"--layers: stage {stage.index} ({stage.layers}) needs {human_bytes(stage.bytes)} "
                                 f"but has {human_bytes(memory[stage.index])} of memory")
    return stages


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """``mlxcel plan``."""
    pl = subparsers.add_parser("plan", help="show how a checkpoint's layers split into pipeline stages, with bytes "
                                            "per stage")
    pl.add_argument("-m", "--model", default=DEFAULT_MODEL_DIR, help=f"checkpoint directory (default {DEFAULT_MODEL_DIR})")
    pl.add_argument("--pp-size", type=positive_int, required=True, metavar="N", help="number of stages")
    pl.add_argument("--memory", default=None, metavar="SIZES",
                    help="usable memory per stage, e.g. 8GiB,16GiB (or one value for all; B, KB/KiB, MB/MiB, GB/GiB)")
    pl.add_argument("--layers", default=None, metavar="RANGES",
                    help="check these inclusive ranges (e.g. 0-11,12-29) against the checkpoint and price them")
    pl.add_argument("--context", type=non_negative_int, default=0, metavar="TOKENS",
                    help="price every layer's cache for sequences of this many tokens (default 0: weights only)")
    pl.add_argument("--rows", type=positive_int, default=1, metavar="N",
                    help="sequences per decode step: how many of an MoE layer's experts a step touches, and "
                         "how many caches (default 1)")
    pl.add_argument("--json", action="store_true", help="print JSON instead of a table")
    pl.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        costs = layer_costs(args.model, context=args.context, rows=args.rows)
        memory = parse_memory_list(args.memory, args.pp_size) if args.memory else None
        if args.layers is not None:
            stages = given_stages(costs, args.layers, args.pp_size, memory)
        else:
            stages = plan_stages(costs, args.pp_size, memory)
    except PartitionError as exc:
        raise CLIError(str(exc)) from None
    print(json.dumps(plan_json(costs, stages)) if args.json else plan_table(costs, stages, memory))
    return 0
