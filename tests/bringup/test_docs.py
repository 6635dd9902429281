"""docs/bringup.md's texts an outside implementer relies on: the model identity's byte layout and
vector (recomputed from the doc's own text), the coordinator's version refusal, the ordering of an
activated peer's closes, and the JSON type of every ``code`` field in the docs of the cluster."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from mlxcel.bringup.push import version_mismatch
from mlxcel.models.identity import model_identity

DOCS = Path(__file__).resolve().parents[2] / "docs"
BRINGUP = DOCS / "bringup.md"


def identity_vector() -> tuple[bytes, list[tuple[str, int]], bytes, str]:
    block = re.search(r"```identity-vector\n(.*?)```", BRINGUP.read_text(), re.S)
    assert block, "docs/bringup.md lost its identity-vector block"
    config, files, hashed, identity = b"", [], b"", ""
    for line in block.group(1).splitlines():
        key, value = (part.strip() for part in line.split("=", 1))
        if key == "config":
            config = value.encode()
        elif key == "file":
            name, size = value.rsplit(" ", 1)
            files.append((name, int(size)))
        elif key == "hashed":
            hashed = bytes.fromhex(value)
        elif key == "identity":
            identity = value
    return config, files, hashed, identity


def layout_from_the_doc(config: bytes, files: list[tuple[str, int]], layers: int) -> bytes:
    """The bytes of docs/bringup.md §5.5, field by field as its table states them."""
    out = b"mlxcel-model-identity-v1" + len(config).to_bytes(8, "big") + config
    for name, size in sorted((n.encode(), s) for n, s in files if n.endswith(".safetensors")):
        out += len(name).to_bytes(2, "big") + name + size.to_bytes(8, "big")
    return out + layers.to_bytes(4, "big")


def test_the_identity_vector_is_the_documented_layout_and_what_mlxcel_computes(tmp_path):
    config, files, hashed, identity = identity_vector()
    assert len(config) == 44 and "`mlxcel-model-identity-v1`" in BRINGUP.read_text()
    assert layout_from_the_doc(config, files, layers=2) == hashed
    assert hashlib.sha256(hashed).hexdigest() == identity
    (tmp_path / "config.json").write_bytes(config)
    for name, size in files:
        with open(tmp_path / name, "wb") as f:
            f.truncate(size)
    assert model_identity(tmp_path) == identity


def test_the_version_refusal_and_the_activate_ordering_are_documented():
    text = " ".join(BRINGUP.read_text().split())  # the doc's line breaks do not matter
    assert version_mismatch("X", "Y") in text
    assert f"`<peer> did not commit: {version_mismatch('X', 'Y')}`" in text  # the failure table's row
    assert "The listener must be closed **before** the connection" in text
    assert "wait until each peer closed the connection" in text


def test_every_code_field_states_its_json_type():
    for doc in ("bringup.md", "disagg.md", "pipeline.md"):
        text = " ".join((DOCS / doc).read_text().split())
        for m in re.finditer(r"`code`", text):
            window = text[m.end():m.end() + 40]
            assert "integer" in window or "field" in window, f"{doc}: `code` without its JSON type: ...{text[m.start():m.end() + 60]}"
