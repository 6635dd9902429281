"""Split a model's layers into contiguous pipeline stages: explicit ranges, or priced by parameter bytes.

No MLX here: costs come from the safetensors headers (the JSON before the data),
so ``mlxcel plan`` prices a checkpoint of any size in milliseconds.

Ranges are written inclusive ("0-11,12-29", as operators and the cluster TOML
write them) and held as half-open ``(start, end)`` pairs. Stages count from 0,
as ``mlxcel plan`` prints them and the cluster TOML names them (stage-0, ...).

What a stage is charged:
- every tensor of its layers (``model.layers.<i>.``) at its real size in the
  file, so a quantized layer (weight, scales, biases) or a layer of another
  type weighs what it really does;
- the first stage: the embedding (``model.embed_tokens.``);
- the last stage: the final norm (``model.norm.``) and the head (``lm_head.``).
  With tied embeddings there is no head tensor: the last stage computes its
  logits with the embedding matrix, so it holds a copy and is charged the
  embedding's bytes too (once when one stage is both first and last).

Each layer is priced by its kind too (``mlxcel.topology.layer_cost``): with config.json at hand,
a stage's **step** cost charges a mixture-of-experts layer only the experts a decode step touches,
and every layer the cache it reads at the planned context; its **resident** bytes add that cache to
the weights. The split minimizes the heaviest stage's step cost within each stage's memory, which
bounds the resident bytes. For a dense checkpoint at context 0 the two are the bytes above.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

from mlxcel.models.errors import ModelError
from mlxcel.models.identity import layer_count
from mlxcel.topology.layer_cost import (
    cache_bytes,
    config_layer_bytes,
    is_expert_tensor,
    layer_kinds,
    step_bytes,
    text_config,
)
from mlxcel.topology.stage_rules import deepseek_v41_joined, needed_layers

LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")
# multimodal wrappers (qwen3_5, kimi_k3) hold the text model one level down: "language_model.model.layers.3."
# as mlx-lm names it, "model.language_model.layers.3." as Hugging Face checkpoints do
_WRAPPED = re.compile(r"^(?:language_model\.(?=model\.|lm_head\.)|model\.language_model\.)")
EMBED_PREFIX = "model.embed_tokens."
NORM_PREFIX = "model.norm."
HEAD_PREFIX = "lm_head."
MAX_HEADER_BYTES = 100 << 20  # the safetensors reference refuses headers above 100 MB
_RANGE = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$", re.ASCII)  # parse_range: the one grammar
_RANGE_HINT = "one inclusive range START-END, e.g. 0-11, or one layer, e.g. 7"


class PartitionError(ValueError):
    """A layer split that cannot be used; the message is one line for the operator."""


# ---------------------------------------------------------------------------
# Explicit ranges


def parse_range(text: object, where: str) -> tuple[int, int]:
    """One inclusive layer range, "12-29" (or "7" for one layer), -> half-open (12, 30).

    The one layer-range grammar: ``--pp-layers`` (each comma-separated stage), the cluster
    TOML's ``layers`` and ``mlxcel plan`` all read ranges through it. ASCII digits, optional
    spaces around them and the dash; not reversed. ``where`` (the flag, key or stage) starts
    every message.
    """
    if isinstance(text, str) and not text.strip():
        raise PartitionError(f"{where} is empty (expected {_RANGE_HINT})")
    match = _RANGE.match(text) if isinstance(text, str) else None
    if match is None:
        shown = text.strip() if isinstance(text, str) else text
        raise PartitionError(f"{where}: {shown!r} is not a layer range (expected {_RANGE_HINT})")
    first = int(match.group(1))
    last = int(match.group(2)) if match.group(2) is not None else first
    if last < first:
        raise PartitionError(f"{where}: range {first}-{last} is reversed (start must be <= end)")
    return first, last + 1


def parse_range_text(text: str, source: str = "--pp-layers") -> list[tuple[int, int]]:
    """"0-11,12-29" -> [(0, 12), (12, 30)]: syntax, order, contiguity and start at 0; not the model's size.

    Each stage is one ``parse_range``; ``source`` names the flag or TOML key in the messages.
    """
    if not text.strip():
        raise PartitionError(f"{source}: empty (expected inclusive ranges such as 0-11,12-29)")
    ranges = [parse_range(item, f"{source}: stage {stage}") for stage, item in enumerate(text.split(","))]
    check_contiguous(ranges, source)
    return ranges


def check_contiguous(ranges: Sequence[tuple[int, int]], source: str = "--pp-layers") -> None:
    """Stage ranges in order must start at layer 0 and follow each other without gap or overlap."""
    if ranges and ranges[0][0] != 0:
        raise PartitionError(f"{source}: stage 0 starts at {ranges[0][0]}, but the first stage must start at layer 0")
    for stage in range(1, len(ranges)):
        first, previous_last = ranges[stage][0], ranges[stage - 1][1] - 1
        if first != previous_last + 1:
            problem = "must not overlap" if first <= previous_last else "must be contiguous"
            raise PartitionError(f"{source}: stage {stage} starts at {first} but stage {stage - 1} ended at "
                                 f"{previous_last} (ranges {problem})")


def check_coverage(ranges: Sequence[tuple[int, int]], num_layers: int, source: str = "--pp-layers") -> None:
    """Ranges from ``parse_range_text`` must end exactly at the model's last layer."""
    end = ranges[-1][1]
    if end > num_layers:
        stage = next(i for i, (_, e) in enumerate(ranges) if e > num_layers)
        raise PartitionError(f"{source}: stage {stage} ends at {ranges[stage][1] - 1} but the model has only "
                             f"{num_layers} layers (0-{num_layers - 1})")
    if end < num_layers:
        raise PartitionError(f"{source}: the last stage ends at {end - 1} but the model has {num_layers} layers "
                             f"(0-{num_layers - 1}): the ranges must cover every layer")


def parse_layer_ranges(text: str, num_layers: int, source: str = "--pp-layers") -> list[tuple[int, int]]:
    """Inclusive ranges text -> contiguous half-open (start, end) pairs covering layers 0..num_layers-1."""
    ranges = parse_range_text(text, source)
    check_coverage(ranges, num_layers, source)
    return ranges


def format_range(start: int, end: int) -> str:
    """(12, 30) -> "12-29", the inclusive form that parse_range_text reads."""
    return f"{start}-{end - 1}"


# ---------------------------------------------------------------------------
# Costs from safetensors headers


@dataclass(frozen=True)
class StageCosts:
    """Parameter bytes of a checkpoint, grouped the way stages are charged."""

    model: str
    layers: tuple[int, ...]  # bytes of layer i's tensors
    embed: int  # model.embed_tokens.* (first stage)
    norm: int  # model.norm.* (last stage)
    head: int  # lm_head.*, or the embedding's bytes again when tied (last stage)
    tied: bool
    other: int = 0  # tensors outside these groups: not charged to any stage
    active: tuple[int, ...] = ()  # bytes a decode step reads of layer i's weights (by its kind); () = layers
    cache: tuple[int, ...] = ()  # cache bytes layer i holds and a decode step reads at the planned context
    kinds: tuple[str, ...] = ()  # layer i's kind ("mla+moe", ...), where config.json says
    # split points b (a stage starting at layer b) that the model forbids, and why (``joined_boundaries``)
    joined: frozenset[int] = frozenset()
    joined_why: str = ""
    # layers of which every stage must hold at least one, and why (``stage_rules.needed_layers``)
    needs: frozenset[int] = frozenset()
    needs_why: str = ""

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def by_kind(self) -> bool:
        """Whether the step cost differs from the resident bytes (experts or caches priced)."""
        return bool(self.cache and any(self.cache)) or bool(self.active and self.active != self.layers)

    def _ends(self, start: int, end: int) -> int:
        cost = self.embed if start == 0 else 0
        if end == self.num_layers:
            cost += self.norm
            if not (self.tied and start == 0):
                cost += self.head
        return cost

    def holds_needed(self, start: int, end: int) -> bool:
        """Whether a stage of layers [start, end) holds one of the layers every stage needs (``needs``)."""
        return not self.needs or any(start <= i < end for i in self.needs)

    def stage_step(self, start: int, end: int) -> int:
        """What one decode step of the stage holding layers [start, end) reads: its layers' active
        weights and caches, and the final norm and the head (a step gathers only its rows of the
        embedding, so the first stage is not charged it). Without kinds (``active`` empty): its bytes."""
        if not self.active:
            return self.stage_bytes(start, end)
        ends = self._ends(start, end) - (self.embed if start == 0 else 0)
        if start == 0 and end == self.num_layers and self.tied:
            ends += self.embed  # one stage: the tied head is the embedding, read whole
        return sum(self.active[start:end]) + sum(self.cache[start:end]) + ends

    @property
    def total(self) -> int:
        """Bytes of all the checkpoint's tensors (a tied embedding counted once)."""
        return sum(self.layers) + self.embed + self.norm + (0 if self.tied else self.head) + self.other

    def stage_bytes(self, start: int, end: int) -> int:
        """What the stage holding layers [start, end) holds: its weights and its layers' caches."""
        return sum(self.layers[start:end]) + sum(self.cache[start:end]) + self._ends(start, end)


def read_safetensors_header(path: Path) -> dict:
    """The JSON header of a .safetensors file (8-byte little-endian length, then JSON); no tensor data."""
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise PartitionError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        (size,) = struct.unpack("<Q", prefix)
        if size > MAX_HEADER_BYTES:
            raise PartitionError(f"{path}: not a safetensors file (header length {size} is over 100 MB)")
        raw = f.read(size)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        header = None
    if len(raw) != size or not isinstance(header, dict):
        raise PartitionError(f"{path}: not a safetensors file (unreadable JSON header)")
    return header


def _tensor_bytes(path: Path, name: str, info: object) -> int:
    try:
        start, end = info["data_offsets"]  # type: ignore[index]
        if not 0 <= start <= end:
            raise ValueError
        return int(end) - int(start)
    except (TypeError, KeyError, ValueError):
        raise PartitionError(f"{path}: tensor {name!r} has no valid data_offsets") from None


def _num_layers(model_dir: Path) -> int | None:
    config = _config(model_dir)
    if config is None:
        return None
    try:
        return layer_count(config)
    except ModelError:
        return None


def _config(model_dir: Path) -> dict | None:
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return config if isinstance(config, dict) else None


def layer_costs(model_dir: str | Path, *, context: int = 0, rows: int = 1) -> StageCosts:
    """Bytes per layer, embedding, final norm and head, from the headers of ``model_dir/*.safetensors``;
    with config.json, each layer's step bytes by its kind and its cache for ``rows`` sequences of
    ``context`` tokens (``layer_cost``)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise PartitionError(f"no such model directory: {model_dir}")
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise PartitionError(f"{model_dir}: no *.safetensors files")
    per_layer: dict[int, int] = {}
    experts: dict[int, int] = {}
    groups = {"embed": 0, "norm": 0, "head": 0, "other": 0}
    itemsize = 2
    for path in files:
        for name, info in read_safetensors_header(path).items():
            if name == "__metadata__":
                continue
            size = _tensor_bytes(path, name, info)
            name = unwrap(name)
            match = LAYER_KEY.match(name)
            if match:
                index = int(match.group(1))
                per_layer[index] = per_layer.get(index, 0) + size
                if is_expert_tensor(name):
                    experts[index] = experts.get(index, 0) + size
            else:
                groups[_group(name)] += size
                if name == NORM_PREFIX + "weight" and isinstance(info, dict):  # caches take the model's dtype
                    itemsize = _ITEMSIZE.get(info.get("dtype"), 2)
    layers = _ordered_layers(model_dir, per_layer)
    if groups["embed"] == 0:
        raise PartitionError(f"{model_dir}: no {EMBED_PREFIX}* tensors (not a llama-style checkpoint)")
    tied = groups["head"] == 0
    head = groups["embed"] if tied else groups["head"]
    costs = StageCosts(model=model_dir.resolve().name, layers=tuple(layers), embed=groups["embed"],
                       norm=groups["norm"], head=head, tied=tied, other=groups["other"])
    config = _config(model_dir)
    if config is None:
        return costs
    return priced_by_kind(costs, config, [experts.get(i, 0) for i in range(len(layers))],
                          context=context, rows=rows, itemsize=itemsize)


_ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2}


def joined_boundaries(config: dict) -> tuple[frozenset[int], str]:
    """The split points ``config`` forbids, and why (deepseek_v41's: ``stage_rules.deepseek_v41_joined``).
    gemma4_text's KV-shared layers (its last
    ``num_kv_shared_layers``) attend over the KV that the last earlier layer of their kind computes in
    the same step (mlx-lm's ``Gemma4TextModel.previous_kvs``), so no stage may start between the first
    such source layer and the last layer. Defaults as mlx-lm 0.32's gemma4_text ``ModelArgs``."""
    if text_config(config).get("model_type", config.get("model_type")) == "deepseek_v41":
        return deepseek_v41_joined(config)
    if config.get("model_type") != "gemma4_text":
        return frozenset(), ""
    layers, shared = int(config["num_hidden_layers"]), int(config.get("num_kv_shared_layers", 20))
    first_shared = layers - shared
    if shared <= 0 or first_shared <= 0:
        return frozenset(), ""
    pattern = int(config.get("sliding_window_pattern", 5))
    types = config.get("layer_types") or (["sliding_attention"] * (pattern - 1) + ["full_attention"]) * layers
    last_of = {kind: i for i, kind in enumerate(types[:first_shared])}
    source = min(last_of[kind] for kind in set(types[first_shared:layers]))
    why = (f"gemma4_text layers {first_shared}-{layers - 1} reuse the KV caches of earlier layers "
           f"(num_kv_shared_layers {shared}), so layers {source}-{layers - 1} stay on one stage")
    return frozenset(range(source + 1, layers)), why


def priced_by_kind(costs: StageCosts, config: dict, expert_bytes: Sequence[int], *, context: int = 0,
                   rows: int = 1, itemsize: int = 2) -> StageCosts:
    """``costs`` with each layer's step bytes and cache from its kind (``layer_kinds(config)``), given
    the bytes of its routed-expert tensors, and the split points the model forbids (``joined_boundaries``)."""
    joined, why = joined_boundaries(config)
    try:
        needs, needs_why = needed_layers(config)
    except ValueError as exc:
        raise PartitionError(f"{costs.model}: {exc}") from None
    costs = replace(costs, joined=joined, joined_why=why, needs=needs, needs_why=needs_why)
    try:
        kinds = layer_kinds(config)
    except (KeyError, TypeError, ValueError) as exc:
        raise PartitionError(f"{costs.model}: config.json cannot be priced by layer kind ({exc!r} missing or bad)") from None
    if len(kinds) != costs.num_layers:
        raise PartitionError(f"{costs.model}: config.json says {len(kinds)} layers but the weights hold {costs.num_layers}")
    names = tuple(k.name for k in kinds)
    if context == 0 and not any(k.experts for k in kinds):
        return replace(costs, kinds=names)  # dense, no cache planned: priced by its bytes, as it always was
    active = tuple(step_bytes(k, w, e, rows) for k, w, e in zip(kinds, costs.layers, expert_bytes))
    cache = tuple(cache_bytes(config, k, context=context, rows=rows, itemsize=itemsize) for k in kinds)
    return replace(costs, active=active, cache=cache, kinds=names)


def config_costs(config: dict, *, bits: float = 16, context: int = 0, rows: int = 1, itemsize: int = 2,
                 name: str = "config") -> StageCosts:
    """A checkpoint's costs from config.json arithmetic alone (no weights): each layer's weights by its
    kind at ``bits`` per parameter (``config_layer_bytes``), the embedding and head at the same rate."""
    kinds = layer_kinds(config)
    sized = [config_layer_bytes(config, k, bits=bits) for k in kinds]
    c = text_config(config)
    embed = int(c["vocab_size"]) * int(c["hidden_size"]) * bits // 8
    tied = bool(c.get("tie_word_embeddings", False))
    costs = StageCosts(model=name, layers=tuple(int(w) for w, _ in sized), embed=int(embed),
                       norm=int(c["hidden_size"]) * itemsize, head=int(embed), tied=tied)
    return priced_by_kind(costs, config, [e for _, e in sized], context=context, rows=rows, itemsize=itemsize)


# nemotron_h's text model is "backbone", its embedding "embeddings" and final norm "norm_f"
# (and bailing_hybrid's embedding "word_embeddings")
_BACKBONE = (("backbone.embeddings.", EMBED_PREFIX), ("backbone.norm_f.", NORM_PREFIX), ("backbone.", "model."),
             ("model.word_embeddings.", EMBED_PREFIX))


def unwrap(name: str) -> str:
    """A tensor name with a multimodal wrapper's prefix removed: "language_model.model.norm.weight" ->
    "model.norm.weight", "model.language_model.layers.0.x" -> "model.layers.0.x"; nemotron_h's backbone
    named as the others: "backbone.layers.0.x" -> "model.layers.0.x", "backbone.norm_f.weight" ->
    "model.norm.weight"."""
    for prefix, alias in _BACKBONE:
        if name.startswith(prefix):
            return alias + name[len(prefix):]
    match = _WRAPPED.match(name)
    if match is None:
        return name
    rest = name[match.end():]
    return rest if match.group(0).startswith("language_model.") else "model." + rest


def _group(name: str) -> str:
    for prefix, group in ((EMBED_PREFIX, "embed"), (NORM_PREFIX, "norm"), (HEAD_PREFIX, "head")):
        if name.startswith(prefix):
            return group
    return "other"


def _ordered_layers(model_dir: Path, per_layer: dict[int, int]) -> list[int]:
    if not per_layer:
        raise PartitionError(f"{model_dir}: no model.layers.<i>.* tensors (not a llama-style checkpoint)")
    count = max(per_layer) + 1
    missing = [i for i in range(count) if i not in per_layer]
    if missing:
        raise PartitionError(f"{model_dir}: no tensors for layer {missing[0]} (layers 0-{count - 1} expected)")
    expected = _num_layers(model_dir)
    if expected is not None and expected != count:
        raise PartitionError(f"{model_dir}: config.json says {expected} layers but the weights hold {count}")
    return [per_layer[i] for i in range(count)]


# ---------------------------------------------------------------------------
# Automatic split


@dataclass(frozen=True)
class Stage:
    """Stage ``index`` holds layers [start, end) and loads ``bytes`` of parameters."""

    index: int
    start: int
    end: int
    bytes: int
    step: int | None = None  # what one decode step reads (StageCosts.stage_step); None where not priced

    @property
    def layers(self) -> str:
        return format_range(self.start, self.end)


def stages_for_ranges(costs: StageCosts, ranges: Sequence[tuple[int, int]]) -> list[Stage]:
    """Price given ranges (e.g. from --pp-layers) as stages; PartitionError naming the first stage that
    starts at a split point the model forbids (``joined``) or holds none of the layers it needs (``needs``)."""
    check_coverage(ranges, costs.num_layers, "layer ranges")
    for index, (a, b) in enumerate(ranges):
        if a in costs.joined:
            raise PartitionError(f"stage {index} (layers {format_range(a, b)}) starts at layer {a}: {costs.joined_why}")
        if not costs.holds_needed(a, b):
            raise PartitionError(f"stage {index} (layers {format_range(a, b)}) holds none of the layers every stage "
                                 f"needs: {costs.needs_why}")
    return [_stage(costs, i, a, b) for i, (a, b) in enumerate(ranges)]


def _stage(costs: StageCosts, index: int, start: int, end: int) -> Stage:
    return Stage(index, start, end, costs.stage_bytes(start, end), costs.stage_step(start, end))


def plan_stages(costs: StageCosts, n: int, memory: Sequence[int] | None = None) -> list[Stage]:
    """Contiguous split into ``n`` stages that minimizes the heaviest stage's step cost
    (``StageCosts.stage_step``: its bytes, with MoE layers charged their active experts and every
    layer its cache; the bytes alone for a dense checkpoint at context 0).

    Exact dynamic programme over split points. Ties on the heaviest stage are
    broken by the smaller sum of squared stage costs (the more even split), then of
    squared resident bytes,
    then by the later split point (later stages, which also run the head, get
    the fewer layers), so the result is deterministic.
    ``memory``: each stage's usable bytes (one value per stage); a stage never
    gets more than its memory, and an impossible fit names the stage. No stage starts
    at a split point the model forbids (``StageCosts.joined``), and every stage holds one of the layers
    the model says each needs (``StageCosts.needs``: bailing_hybrid's MLA layers).
    """
    num_layers = costs.num_layers
    if not 1 <= n <= num_layers:
        raise PartitionError(f"cannot split {num_layers} layers into {n} stages (1 to {num_layers})")
    if n - 1 > num_layers - 1 - len(costs.joined):
        raise PartitionError(f"cannot split {num_layers} layers into {n} stages: {costs.joined_why}")
    if costs.needs and n > len(costs.needs):
        raise PartitionError(f"cannot split {num_layers} layers into {n} stages: {costs.needs_why}")
    limits = _limits(memory, n)
    _check_total(costs, limits)
    # best[k][j]: (heaviest step, sum of squared steps, sum of squared resident bytes, previous split) for
    # layers [0, j) in k stages; None if impossible.
    best: list[list[tuple[int, int, int, int] | None]] = [[None] * (num_layers + 1) for _ in range(n + 1)]
    best[0][0] = (0, 0, 0, 0)
    for k in range(1, n + 1):
        ends = [num_layers] if k == n else [j for j in range(k, num_layers - (n - k) + 1) if j not in costs.joined]
        for j in ends:
            best[k][j] = _best_split(costs, best[k - 1], k - 1, j, limits[k - 1])
        if not any(best[k]):
            raise _no_fit(costs, best[k - 1], k - 1, limits[k - 1], ends)
    return _backtrack(costs, best, n)


def _limits(memory: Sequence[int] | None, n: int) -> list[int | None]:
    if memory is None:
        return [None] * n
    if len(memory) != n:
        raise PartitionError(f"memory: {len(memory)} values for {n} stages (give one value, or one per stage)")
    if any(m <= 0 for m in memory):
        raise PartitionError("memory: every stage needs a positive amount of memory")
    return list(memory)


def _check_total(costs: StageCosts, limits: list[int | None]) -> None:
    if any(m is None for m in limits):
        return
    available = sum(m for m in limits if m is not None)
    one_stage = len(limits) == 1
    needed = (sum(costs.layers) + sum(costs.cache) + costs.embed + costs.norm
              + (0 if costs.tied and one_stage else costs.head))
    if needed > available:
        raise PartitionError(f"the model needs {human_bytes(needed)} across {len(limits)} stages, "
                             f"but their memory adds up to {human_bytes(available)}")


def _best_split(costs: StageCosts, previous: list, stage: int, j: int,
                limit: int | None) -> tuple[int, int, int, int] | None:
    best = None
    for i in range(stage, j):
        if previous[i] is None or not costs.holds_needed(i, j):
            continue
        resident = costs.stage_bytes(i, j)
        if limit is not None and resident > limit:
            continue
        cost = costs.stage_step(i, j)
        candidate = (max(previous[i][0], cost), previous[i][1] + cost * cost, previous[i][2] + resident * resident, i)
        if best is None or candidate[:3] <= best[:3]:
            best = candidate
    return best


def _no_fit(costs: StageCosts, previous: list, stage: int, limit: int | None,
            ends: Sequence[int]) -> PartitionError:
    """Name the stage that no layer range fits, with the least it would need."""
    needs = [(costs.stage_bytes(i, j), i, j) for j in ends for i in range(stage, j) if previous[i] is not None]
    need, i, j = min(needs)
    what = f"layer {i}" if j == i + 1 else f"layers {format_range(i, j)}"
    if i == 0:
        what += " and the embedding"
    if j == costs.num_layers:
        what += " and the final norm and head"
    return PartitionError(f"stage {stage} needs at least {human_bytes(need)} ({what}) "
                          f"but has {human_bytes(limit or 0)} of memory")


def _backtrack(costs: StageCosts, best: list, n: int) -> list[Stage]:
    bounds, j = [], costs.num_layers
    for k in range(n, 0, -1):
        entry = best[k][j]
        assert entry is not None
        bounds.append((entry[3], j))
        j = entry[3]
    bounds.reverse()
    return [_stage(costs, index, a, b) for index, (a, b) in enumerate(bounds)]


# ---------------------------------------------------------------------------
# Sizes for operators

_UNITS = {
    "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str, source: str = "--memory") -> int:
    """"8GiB" -> 8589934592; units B, KB/KiB, MB/MiB, GB/GiB, TB/TiB (any case); a bare number is bytes."""
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS and unit != "":
        raise PartitionError(f"{source}: {text.strip()!r} is not a size (expected e.g. 8GiB, 512MiB, 16GB)")
    value = int(float(match.group(1)) * _UNITS.get(unit, 1))
    if value <= 0:
        raise PartitionError(f"{source}: {text.strip()!r} must be more than 0 bytes")
    return value


def parse_memory_list(text: str, n: int, source: str = "--memory") -> list[int]:
    """"8GiB,16GiB" -> bytes per stage: one value per stage, or one value for every stage."""
    values = [parse_size(item, source) for item in text.split(",")]
    if len(values) == 1:
        return values * n
    if len(values) != n:
        raise PartitionError(f"{source}: {len(values)} values for {n} stages (give one value, or one per stage)")
    return values


def human_bytes(size: int) -> str:
    """1536 -> "1.5 KiB" (binary units, one decimal)."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{size} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
