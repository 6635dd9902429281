"""Defaults, bounds and wire constants have one home each: ``mlxcel/config.py``, the wire modules
(``cluster/wire.py``, ``bringup/wire.py``, ``disagg/wire.py``) and the role names (``topology/names.py``).

A constant those modules define must not be assigned again anywhere else in the package (import it
instead), and the values whose copies used to drift are pinned where the behaviour depends on them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import mlxcel
from mlxcel import config
from mlxcel.bringup import wire as bringup_wire
from mlxcel.cluster import wire
from mlxcel.disagg import wire as disagg_wire
from mlxcel.topology import names

PACKAGE = Path(mlxcel.__file__).parent
HOMES = {PACKAGE / "config.py": config, PACKAGE / "cluster" / "wire.py": wire,
         PACKAGE / "bringup" / "wire.py": bringup_wire, PACKAGE / "disagg" / "wire.py": disagg_wire,
         PACKAGE / "topology" / "names.py": names}
OTHER_MEANING = {("mlxcel/models/gguf_header.py", "MAGIC")}  # the GGUF file magic, not the cluster's


def module_constants(path: Path) -> dict[str, int]:
    """UPPER_CASE names assigned at a module's top level -> line."""
    found: dict[str, int] = {}
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        for target in targets:
            if isinstance(target, ast.Name) and target.id.isupper():
                found[target.id] = node.lineno
    return found


def test_no_module_redefines_a_default_or_wire_constant():
    owned = {name: home for home in HOMES for name in module_constants(home)}
    copies = [f"{path.relative_to(PACKAGE.parent)}:{line} defines {name} (its home is {owned[name].name})"
              for path in sorted(PACKAGE.rglob("*.py")) if path not in HOMES
              for name, line in module_constants(path).items()
              if name in owned and (str(path.relative_to(PACKAGE.parent)), name) not in OTHER_MEANING]
    assert copies == []


def test_the_formerly_duplicated_values_are_used_from_their_home():
    from mlxcel.cli import build_parser
    from mlxcel.cluster.frames import FrameSealer
    from mlxcel.engine.generate import generate_tokens
    from mlxcel.engine.sampling import SamplingParams

    assert build_parser().parse_args(["generate", "-p", "hi"]).max_tokens == SamplingParams().max_tokens == config.DEFAULT_MAX_TOKENS
    assert generate_tokens.__kwdefaults__["prefill_chunk"] == config.PREFILL_STEP  # the server's chunk, too
    sealed = FrameSealer(wire.DEFAULT_SUITE, bytes(wire.KEY_LEN)).seal(wire.Kind.CONTROL, b"x" * 100)
    assert len(sealed) == 100 + wire.FRAME_OVERHEAD == 121  # what the pipeline's byte counters add per frame
