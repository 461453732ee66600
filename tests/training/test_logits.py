"""Log-probs and entropy from the actor's logits in sequence chunks (`actor.logits_chunk_tokens`):
the same values and parameter gradients as from whole logits, with the output layer never producing
more than one chunk of logits at a time, under TP 2 with sequence parallelism (gloo, tiny Qwen3-MoE)."""

from __future__ import annotations

import pytest
import torch

from megatron_sao.platform import run_distributed
from tests.training.logits_worker import BATCH, SEQ, chunked_vs_whole


# TP 2 with sequence parallelism (chunks hold rows of every TP slice) in the default suite, computed
# in the `two_ranks` process pair (tests/conftest.py).
@pytest.mark.parametrize("ranks", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_chunked_logprobs_equal_whole_logits(ranks, request):
    if ranks == 2:
        result = request.getfixturevalue("two_ranks")[0]["logits_tp2"]
    else:
        result = run_distributed(chunked_vs_whole, ranks, str(request.getfixturevalue("tiny_hf_dir")))[0]
    whole = result["whole"]
    for name in ("one_chunk", "chunked"):
        logprobs, entropy, grads = result[name]
        torch.testing.assert_close(logprobs, whole[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(entropy, whole[1], rtol=0, atol=1e-6)
        assert grads.keys() == whole[2].keys()
        for key, grad in grads.items():
            # The output layer's gradient is summed chunk by chunk: round-off of that order only.
            scale = float(whole[2][key].abs().max())
            torch.testing.assert_close(grad, whole[2][key], rtol=0, atol=1e-6 * scale, msg=f"{name} {key}")
    # 12 tokens a chunk = 6 positions x 2 rows (under SP each TP rank's 6 rows of each slice):
    # no output-layer call ever sees more, in the forward or in the backward's recomputation.
    rows = result["chunked_rows"]
    assert max(rows) <= 12 and sum(rows) == 2 * BATCH * SEQ
