"""One tiny ``make-random`` checkpoint per family, built once per test session and shared by the family tables.

``family_checkpoint`` is a session fixture: ``family_checkpoint("qwen3_next")`` is the path of a 4-layer
checkpoint of that family (``mlxcel models make-random --family F``: mlx-lm's own classes, the real
tokenizer files). Import it into a test module to use it (``from tests.family_checkpoints import
family_checkpoint  # noqa: F401``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest


@pytest.fixture(scope="session")
def family_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    from mlxcel.models.random_checkpoint import make_random_checkpoint

    made: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in made:
            made[family] = make_random_checkpoint(tmp_path_factory.mktemp(f"family-{family}"), family=family, layers=4)
        return made[family]

    return get
