"""kimi_k3's attention residuals across real stage processes: a boundary carries more than h.

With attention residuals every layer mixes the summaries of the blocks begun so far, so a stage
boundary carries them beside h: [rows, n, (1 + blocks) * hidden]. Three stages split 0-1 / 2 / 3 of a
4-layer checkpoint with blocks of 2 layers: 1 block crosses the first boundary, 2 the second. The
text through the coordinator equals the single device's; each stage checks the width it takes.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.pipeline.cluster import LocalCluster
from tests.pipeline.test_remote import PROMPTS, reference_tokens, remote_tokens

pytestmark = [pytest.mark.timeout(180), pytest.mark.proc]


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    from mlxcel.models.random_checkpoint import make_random_checkpoint

    return make_random_checkpoint(tmp_path_factory.mktemp("kimi"), family="kimi_k3", layers=4)


def test_stage_widths_grow_with_the_blocks_begun_before_them(kimi):
    from mlxcel.engine.executor import slice_runner
    from mlxcel.error_codes import ErrorCode
    from mlxcel.models.loading import load_checkpoint
    from mlxcel.pipeline.protocol import ProtocolError, check_hidden
    from tests.pipeline.test_protocol import _activation

    model = load_checkpoint(kimi).model
    widths = [slice_runner(model, a, b, max_rows=4).input_width for a, b in [(0, 2), (2, 3), (3, 4)]]
    assert widths == [None, 2 * 64, 3 * 64]  # h + 1 block, h + 2 blocks; the first stage takes token ids
    check_hidden(_activation(np.zeros((1, 1, 3 * 64), np.float32)), max_rows=4, width=widths[2])
    with pytest.raises(ProtocolError) as exc:  # a plain hidden state is refused where blocks must come too
        check_hidden(_activation(np.zeros((1, 1, 64), np.float32)), max_rows=4, width=widths[2])
    assert exc.value.code == ErrorCode.BAD_TENSOR


def test_three_remote_stages_of_kimi_k3_equal_single_device(tmp_path, kimi):
    c = LocalCluster(tmp_path, kimi, stages=3, layers=["0-1", "2-2", "3-3"]).start()
    try:
        for prompt in PROMPTS[:2]:
            assert remote_tokens(c.url, prompt, 8) == reference_tokens(kimi, prompt, 8)
        assert [s.health().json()["layers"] for s in c.stages] == [[0, 2], [2, 3], [3, 4]]
    finally:
        c.stop()
