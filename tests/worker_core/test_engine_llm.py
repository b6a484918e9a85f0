"""The offline `LLM` API and `EngineCore` over the toy runner: shapes of the results, text, seeds, stops."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from worker import LLM, SamplingParams
from worker.core.config import EngineConfig
from worker.core.request import FinishReason
from worker.core.scheduler import QueueFullError
from worker.engine.core import EngineCore
from worker.engine.toy import ByteTokenizer, ToyRunner

TOK = ByteTokenizer()


def _llm(**engine_args) -> LLM:
    engine_args.setdefault("block_size", 4)
    runner = ToyRunner(num_blocks=engine_args.pop("runner_blocks", 128), block_size=engine_args["block_size"])
    return LLM(runner=runner, **engine_args)


def test_generate_returns_one_completion_per_prompt_in_order(kit) -> None:
    llm = _llm(max_num_seqs=2, max_num_batched_tokens=8)
    params = SamplingParams(max_tokens=12, temperature=0.0)
    prompts = ["hello there", [5, 6, 7], "héllo wörld"]
    outs = llm.generate(prompts, params)
    assert [o.prompt_token_ids for o in outs] == [TOK.encode("hello there"), [5, 6, 7], TOK.encode("héllo wörld")]
    for out in outs:
        tokens, reason = kit.reference(out.prompt_token_ids, params)
        assert out.token_ids == tokens and out.finish_reason is reason
        shown = tokens[:-1] if reason is FinishReason.STOP else tokens  # EOS shows no text
        assert out.text == TOK.decode(shown)
        assert out.logprobs is None


def test_single_prompt_forms_and_per_prompt_params() -> None:
    llm = _llm()
    assert len(llm.generate("one prompt")) == 1
    assert len(llm.generate([1, 2, 3])) == 1  # token ids of one prompt
    outs = llm.generate(["a", "b"], [SamplingParams(max_tokens=1), SamplingParams(max_tokens=3, ignore_eos=True)])
    assert [len(o.token_ids) for o in outs] == [1, 3]
    with pytest.raises(ValueError, match="2 prompts but 1 sampling params"):
        llm.generate(["a", "b"], [SamplingParams()])
    with pytest.raises(TypeError, match="string or a list of token ids"):
        llm.generate([1.5])


def test_seeded_sampling_is_reproducible_and_seeds_differ() -> None:
    llm = _llm()
    p1 = SamplingParams(max_tokens=20, temperature=1.0, seed=1, ignore_eos=True)
    p2 = SamplingParams(max_tokens=20, temperature=1.0, seed=2, ignore_eos=True)
    first = llm.generate(["x", "x", "x"], [p1, p1, p2])
    again = llm.generate(["x"], p1)
    assert first[0].token_ids == first[1].token_ids == again[0].token_ids
    assert first[2].token_ids != first[0].token_ids


def test_stop_strings_end_with_reason_stop_and_free_the_request(kit) -> None:
    llm = _llm()
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    (full,) = llm.generate(["abc"], greedy)
    stop = full.text[10:12]
    assert len(stop) == 2 and stop not in full.text[:11]  # the toy output has such a pair
    (cut,) = llm.generate(["abc"], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=(stop,)))
    assert cut.text == full.text[: full.text.index(stop)]
    assert cut.finish_reason is FinishReason.STOP and cut.stop_reason == stop
    n_until_stop = next(n for n in range(len(full.token_ids)) if stop in TOK.decode(full.token_ids[:n]))
    assert cut.token_ids == full.token_ids[:n_until_stop]
    kit.assert_pool_empty(llm.engine.scheduler)


def test_logprobs_and_cached_tokens_are_reported() -> None:
    llm = _llm()
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=True)
    prompt = list(range(1, 30))
    (a,) = llm.generate([prompt], params)
    (b,) = llm.generate([prompt], params)
    assert len(a.logprobs) == 5 and all(lp <= 0 for lp in a.logprobs)
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == 28  # 7 whole blocks of 4
    assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


def test_a_failing_runner_leaves_no_request_holding_blocks(kit) -> None:
    class Exploding(ToyRunner):
        def execute_model(self, scheduler_output):
            if self.num_steps == 2:
                raise RuntimeError("boom")
            return super().execute_model(scheduler_output)

    llm = LLM(runner=Exploding(num_blocks=32, block_size=4), block_size=4)
    with pytest.raises(RuntimeError, match="boom"):
        llm.generate(["abc", "def"], SamplingParams(max_tokens=10, ignore_eos=True))
    assert not llm.engine.has_unfinished_requests()
    kit.assert_pool_empty(llm.engine.scheduler)


def test_bad_engine_arguments_are_reported() -> None:
    with pytest.raises(ValidationError, match=r"max_num_seq\n.*Extra inputs are not permitted"):
        _llm(max_num_seq=3)  # typo: unknown argument
    with pytest.raises(ValueError, match="no model given"):
        LLM()
    with pytest.raises(ValueError, match="block_size"):
        EngineCore.from_config(EngineConfig(block_size=8), ToyRunner(block_size=4))


def test_engine_core_rejects_what_it_cannot_serve() -> None:
    core = EngineCore.from_config(EngineConfig(block_size=4, max_waiting=1), ToyRunner(num_blocks=4, block_size=4))
    with pytest.raises(ValueError, match="at most 16 tokens"):
        core.add_request("long", "x" * 16, SamplingParams())
    core.add_request("a", "x", SamplingParams())
    with pytest.raises(QueueFullError):
        core.add_request("b", "x", SamplingParams())

    class NoTokenizer(ToyRunner):
        tokenizer = None

        def __init__(self) -> None:
            super().__init__(num_blocks=8, block_size=4)
            self.tokenizer = None

    core = EngineCore.from_config(EngineConfig(block_size=4), NoTokenizer())
    with pytest.raises(ValueError, match="no tokenizer"):
        core.add_request("a", "text", SamplingParams())
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        core.add_request("a", [1, 2], SamplingParams(stop=("x",)))
    assert not core.has_unfinished_requests()


def test_the_runner_learns_of_every_finished_request() -> None:
    runner = ToyRunner(num_blocks=64, block_size=4)
    llm = LLM(runner=runner, block_size=4)
    llm.generate(["a", "b", "c"], SamplingParams(max_tokens=4, temperature=1.0, seed=3, ignore_eos=True))
    assert runner.num_request_states == 3  # the last step's finishes are reported with the next step
    assert llm.engine.step() == []  # nothing to run, but the finished ids reach the runner
    assert runner.num_request_states == 0
