"""OpenBLAS preloading changes speed, not results."""

import json
import os
import subprocess
import sys

import pytest

from mlxcel.blas import blas_in_use

SCRIPT = """
import json, sys
import mlxcel
import mlx.core as mx
from mlxcel.blas import blas_in_use
from mlxcel.models.loading import load_checkpoint
m = load_checkpoint(sys.argv[1])
logits = m.model(mx.array([[1, 5, 9, 200, 7, 3, 11, 42]]))
print(json.dumps({"blas": blas_in_use(), "logits": logits[0, -1, :16].tolist()}))
"""


def run(tiny, **env):
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, **env}, check=True)
    return json.loads(out.stdout)


@pytest.mark.skipif(not blas_in_use().startswith("openblas"), reason="no OpenBLAS extracted (scripts/setup.sh)")
def test_openblas_gives_the_same_logits(tiny_llama):
    fast = run(tiny_llama)
    reference = run(tiny_llama, MLXCEL_BLAS="reference")
    assert fast["blas"].startswith("openblas")
    assert reference["blas"] == "reference"
    assert fast["logits"] == pytest.approx(reference["logits"], rel=1e-4, abs=1e-5)
