"""A prompt with token ids outside the vocabulary is refused up front; it must never kill the engine."""

from __future__ import annotations

import pytest

pytest.importorskip("worker.model.testing")

from worker import LLM, SamplingParams
from worker.model.testing import make_tiny_llama


@pytest.mark.parametrize("bad", [[5, 10_000_000], [-1, 3]])
def test_out_of_vocabulary_ids_are_refused_and_the_engine_keeps_serving(tmp_path, bad) -> None:
    path = make_tiny_llama(tmp_path / "m")
    llm = LLM(model=str(path), dtype="float32", num_blocks=64)
    with pytest.raises(ValueError, match="token ids must be in"):
        llm.generate([bad], SamplingParams(max_tokens=2, temperature=0))
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    assert len(out[0].token_ids) == 2
