"""One request must never kill the engine (issue #18, finding 1): what the model cannot take is refused at
admission, and a failure that belongs to one request (its sampling, its detokenisation) ends that request with
finish reason `error` while the requests batched with it run on, token for token as if it had never been there."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
from worker import LLM
from worker.core.config import EngineConfig
from worker.core.request import FinishReason, RequestStatus, SamplingParams
from worker.engine.async_engine import AsyncEngine
from worker.engine.core import EngineCore
from worker.engine.toy import ByteTokenizer, ToyRunner, toy_next_token

POISON = 255  # a prompt ending in this byte makes the poisoned parts below fail for that request only
LONG = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def poisoned_next_token(context: Sequence[int], draw: int) -> int:
    if POISON in context[:8]:
        raise RuntimeError("this request's sampling state is broken")
    return toy_next_token(context, draw)


class PoisonedTokenizer(ByteTokenizer):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if POISON in ids:
            raise UnicodeError("this request's tokens cannot be decoded")
        return super().decode(ids, skip_special_tokens)


def make_core(runner: ToyRunner) -> EngineCore:
    return EngineCore.from_config(EngineConfig(block_size=4), runner)


def run(core: EngineCore, max_steps: int = 1_000) -> dict[str, list]:
    """Step until idle (bounded); every delta per request id."""
    deltas: dict[str, list] = {}
    for _ in range(max_steps):
        if not core.has_unfinished_requests():
            return deltas
        for out in core.step():
            deltas.setdefault(out.request_id, []).append(out)
    raise AssertionError(f"not finished after {max_steps} steps")


@pytest.mark.parametrize("where", ["sampling", "detokenizing"])
def test_a_failing_request_ends_alone_and_its_batch_mates_are_unaffected(kit, where) -> None:
    runner = ToyRunner(num_blocks=64, block_size=4)
    if where == "sampling":
        runner = ToyRunner(num_blocks=64, block_size=4, next_token=poisoned_next_token)
    else:
        runner.tokenizer = PoisonedTokenizer()
    core = make_core(runner)
    good_prompt = [104, 105, 32]
    core.add_request("good", good_prompt, LONG)
    core.add_request("bad", [104, 105, POISON], LONG)
    deltas = run(core)
    bad = deltas["bad"][-1]
    assert bad.finished and bad.finish_reason is FinishReason.ERROR
    assert "cannot be decoded" in bad.error if where == "detokenizing" else "sampling state is broken" in bad.error
    assert [d.finished for d in deltas["bad"]].count(True) == 1
    good = [t for d in deltas["good"] for t in d.new_token_ids]
    assert (good, deltas["good"][-1].finish_reason) == kit.reference(good_prompt, LONG)
    assert deltas["good"][-1].error is None
    kit.assert_pool_empty(core.scheduler)
    assert runner.num_request_states == 0
    # and the engine takes the next request as if nothing happened
    core.add_request("after", good_prompt, LONG)
    assert [t for d in run(core)["after"] for t in d.new_token_ids] == good


async def test_the_async_engine_survives_a_failing_request(kit) -> None:
    engine = AsyncEngine(
        EngineConfig(block_size=4), runner=ToyRunner(num_blocks=64, block_size=4, next_token=poisoned_next_token)
    )
    await engine.start()
    try:

        async def collect(prompt: list[int], rid: str) -> list:
            return [out async for out in engine.generate(prompt, LONG, rid)]

        good, bad = await asyncio.wait_for(
            asyncio.gather(collect([1, 2, 3], "good"), collect([1, 2, POISON], "bad")), 10
        )
        assert bad[-1].finish_reason is FinishReason.ERROR and "broken" in bad[-1].error
        assert ([t for o in good for t in o.new_token_ids], good[-1].finish_reason) == kit.reference([1, 2, 3], LONG)
        again = await asyncio.wait_for(collect([1, 2, 3], "again"), 10)
        assert again[-1].finish_reason is FinishReason.LENGTH
    finally:
        await engine.shutdown()


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([1, 2, 300], {}, "prompt token ids must be in 0..256"),
        ([1, 2, True], {}, "must be integers"),
        ([1, 2], {"stop_token_ids": (257,), "min_tokens": 1}, "stop_token_ids must name token ids in 0..256"),
        ([1, 2], {"logit_bias": {1000: 5.0}}, "logit_bias must name token ids in 0..256"),
    ],
)
def test_what_the_model_cannot_take_is_refused_at_admission(kit, prompt, params, message) -> None:
    core = kit.make_core()
    with pytest.raises(ValueError, match=message):
        core.add_request("r", prompt, SamplingParams(**params))
    assert not core.has_unfinished_requests()
    core.add_request("ok", [1, 2], LONG)
    assert run(core)["ok"][-1].finish_reason is FinishReason.LENGTH


def test_the_scheduler_never_caches_the_kv_of_a_failed_step(kit) -> None:
    """A request the runner failed may have no KV for this step's tokens: its blocks must not enter the prefix
    cache, or the next request with the same prefix would read garbage."""
    runner = ToyRunner(num_blocks=64, block_size=4, next_token=poisoned_next_token)
    core = EngineCore.from_config(EngineConfig(block_size=4, enable_prefix_caching=True), runner)
    prompt = [POISON, 1, 2, 3, 4, 5, 6, 7, 8]
    core.add_request("bad", prompt, LONG)
    assert run(core)["bad"][-1].finish_reason is FinishReason.ERROR
    assert core.scheduler.kv.prefix_cache_hits == 0
    req = core.add_request("next", prompt, LONG)
    core.step()
    assert req.num_cached_tokens == 0 and req.status is RequestStatus.FINISHED_ERROR


def test_a_request_failing_on_its_last_token_ends_with_the_error(kit) -> None:
    """The scheduler ends a request at max_tokens in the same step whose detokenisation fails: the offline API
    reports the error, not `length`."""
    runner = ToyRunner(num_blocks=64, block_size=4)
    runner.tokenizer = PoisonedTokenizer()
    llm = LLM(runner=runner, block_size=4)
    bad, good = llm.generate([[1, 2, POISON], [1, 2, 3]], SamplingParams(max_tokens=1, temperature=0.0))
    assert (bad.finish_reason, good.finish_reason) == (FinishReason.ERROR, FinishReason.LENGTH)
    assert "cannot be decoded" in bad.error and good.error is None
