"""Scheduler: token budget, running-first, chunked prefill, prefix hits, preemption, pause, priority, stops."""

from __future__ import annotations

import pytest
from worker.core.config import EngineConfig
from worker.core.outputs import SchedulerOutput
from worker.core.request import Request, RequestStatus, SamplingParams
from worker.core.scheduler import QueueFullError, Scheduler
from worker.engine.toy import EOS, ToyRunner, toy_next_token

GREEDY = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)


def _sched(
    num_blocks: int = 64, max_model_len: int = 1000, next_token=toy_next_token, **cfg
) -> tuple[Scheduler, ToyRunner]:
    cfg.setdefault("block_size", 4)
    config = EngineConfig(**cfg)
    runner = ToyRunner(num_blocks, config.block_size, max_model_len, next_token)
    return Scheduler(config, num_blocks, max_model_len), runner


def _req(rid: str, n_prompt: int = 10, params: SamplingParams = GREEDY, priority: int = 0, base: int = 0) -> Request:
    prompt = [(base + i) % 200 + 1 for i in range(n_prompt)]
    return Request(request_id=rid, prompt_token_ids=prompt, sampling_params=params, eos_token_id=EOS, priority=priority)


def _step(sched: Scheduler, runner: ToyRunner) -> SchedulerOutput:
    out = sched.schedule()
    sched.update_from_output(out, runner.execute_model(out))
    return out


def _plan(out: SchedulerOutput) -> dict[str, int]:
    return {s.req_id: len(s.token_ids) for s in out.seqs}


def test_budget_and_chunked_prefill() -> None:
    sched, runner = _sched(max_num_seqs=2, max_num_batched_tokens=16)
    for i in range(3):
        sched.add_request(_req(f"r{i}", 10, base=10 * i))
    out = _step(sched, runner)
    assert _plan(out) == {"r0": 10, "r1": 6}  # r1's prefill is chunked to fit the budget
    assert out.num_batched_tokens == 16
    assert [s.sample for s in out.seqs] == [True, False]
    out = _step(sched, runner)
    assert _plan(out) == {"r0": 1, "r1": 4}  # r2 waits: max_num_seqs
    assert out.seqs[1].start_pos == 6 and out.seqs[1].sample


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_step() -> None:
    sched, runner = _sched(max_num_seqs=4, max_num_batched_tokens=16, enable_chunked_prefill=False, max_model_len=16)
    sched.add_request(_req("a", 10))
    sched.add_request(_req("b", 10, base=50))
    assert _plan(_step(sched, runner)) == {"a": 10}
    assert _plan(_step(sched, runner)) == {"a": 1, "b": 10}


def test_running_requests_are_scheduled_before_waiting_ones() -> None:
    sched, runner = _sched(max_num_seqs=8, max_num_batched_tokens=12)
    sched.add_request(_req("old", 10))
    _step(sched, runner)
    sched.add_request(_req("new", 20, base=30))
    out = _step(sched, runner)
    assert [s.req_id for s in out.seqs] == ["old", "new"]
    assert _plan(out) == {"old": 1, "new": 11}


def test_prefix_hit_skips_the_cached_blocks() -> None:
    sched, runner = _sched()
    sched.add_request(_req("a", 14))
    _step(sched, runner)
    sched.add_request(_req("b", 14))
    out = _step(sched, runner)
    b = next(s for s in out.seqs if s.req_id == "b")
    assert (b.start_pos, len(b.token_ids)) == (12, 2)  # 3 whole blocks of 4 served from the cache
    assert sched.requests["b"].num_cached_tokens == 12
    assert (sched.kv.prefix_cache_queries, sched.kv.prefix_cache_hits) == (28, 12)


def test_preemption_takes_the_newest_request_and_it_recomputes() -> None:
    # 6 blocks of 4 = 24 slots; two prompts of 8 (2 blocks each); decoding runs out of blocks.
    sched, runner = _sched(num_blocks=6, max_num_seqs=4, max_num_batched_tokens=64, enable_prefix_caching=False)
    sched.add_request(_req("old", 8))
    sched.add_request(_req("new", 8, base=40))
    preempted = []
    for _ in range(12):
        out = _step(sched, runner)
        preempted += out.preempted_req_ids
        if preempted:
            break
    assert preempted == ["new"]
    assert sched.requests["new"].status is RequestStatus.PREEMPTED
    assert sched.requests["new"].num_computed_tokens == 0
    assert sched.num_preemptions_total == 1
    n_known = sched.requests["new"].num_tokens
    # Once "old" is done, "new" is recomputed: prompt and generated tokens in one go, then it samples.
    for _ in range(200):
        out = _step(sched, runner)
        if "new" in _plan(out) and _plan(out)["new"] > 1:
            assert _plan(out)["new"] == n_known and out.seqs[-1].sample
            break
    else:
        pytest.fail("the preempted request never resumed")


def test_a_victim_scheduled_earlier_in_the_step_gives_its_budget_back() -> None:
    # priority policy: the low-priority request runs first in the list but is the victim.
    sched, runner = _sched(
        num_blocks=4,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        scheduling_policy="priority",
        enable_prefix_caching=False,
    )
    sched.add_request(_req("low", 5, priority=5))
    _step(sched, runner)  # low: 2 blocks, room up to position 7
    sched.add_request(_req("high", 8, priority=0, base=60))
    assert _plan(_step(sched, runner)) == {"low": 1, "high": 8}  # the cache is now full
    # low decodes first (position 6 fits) but high then needs a block: low is the victim.
    out = _step(sched, runner)
    assert out.preempted_req_ids == {"low"}
    assert _plan(out) == {"high": 1}
    assert out.num_batched_tokens == sum(_plan(out).values())


def test_a_request_alone_that_outgrows_the_cache_ends_with_length() -> None:
    sched, runner = _sched(num_blocks=3, max_num_batched_tokens=64)  # 12 token slots
    sched.add_request(_req("a", 5, SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)))
    for _ in range(20):
        if not sched.has_unfinished_requests():
            break
        _step(sched, runner)
    assert not sched.has_unfinished_requests()
    assert sched.num_preemptions_total == 0


@pytest.mark.parametrize(
    ("n_prompt", "message"),
    [(0, "prompt is empty"), (12, "at most 12 tokens"), (40, "at most 12 tokens")],
)
def test_prompts_that_can_never_run_are_refused_with_a_reason(n_prompt: int, message: str) -> None:
    sched, _ = _sched(num_blocks=3)
    with pytest.raises(ValueError, match=message):
        sched.add_request(_req("a", n_prompt))
    assert not sched.has_unfinished_requests()


def test_duplicate_ids_and_queue_cap() -> None:
    sched, _ = _sched(max_waiting=2)
    sched.add_request(_req("a"))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(_req("a"))
    sched.add_request(_req("b"))
    with pytest.raises(QueueFullError):
        sched.add_request(_req("c"))


def test_paused_admits_nothing_new_but_finishes_what_runs() -> None:
    sched, runner = _sched(max_num_batched_tokens=64)
    sched.add_request(_req("running", 6, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)))
    _step(sched, runner)
    sched.pause()
    sched.add_request(_req("new", 6, base=20))
    steps = 0
    while sched.has_schedulable_requests():
        assert "new" not in _plan(_step(sched, runner))
        steps += 1
    assert steps == 2 and "running" not in sched.requests
    assert sched.requests["new"].status is RequestStatus.WAITING
    assert sched.schedule().is_empty
    sched.resume()
    assert _plan(_step(sched, runner)) == {"new": 6}


def test_paused_still_resumes_preempted_requests() -> None:
    sched, runner = _sched(num_blocks=6, max_num_batched_tokens=64, enable_prefix_caching=False)
    sched.add_request(_req("old", 8, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)))
    sched.add_request(_req("new", 8, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), base=40))
    for _ in range(20):
        if _step(sched, runner).preempted_req_ids:
            break
    sched.pause()
    for _ in range(100):
        if not sched.has_schedulable_requests():
            break
        _step(sched, runner)
    assert not sched.has_unfinished_requests()


@pytest.mark.parametrize(
    ("policy", "expected"),
    [("fcfs", ["p5", "p0", "p9", "p1"]), ("priority", ["p0", "p1", "p5", "p9"])],
)
def test_admission_order(policy: str, expected: list[str]) -> None:
    sched, runner = _sched(max_num_seqs=1, max_num_batched_tokens=64, scheduling_policy=policy)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    for name in ["p5", "p0", "p9", "p1"]:
        sched.add_request(_req(name, 4, params, priority=int(name[1:]), base=int(name[1:]) * 7))
    order = [next(iter(_plan(_step(sched, runner)))) for _ in range(4)]
    assert order == expected


def test_abort_frees_blocks_and_is_reported_to_the_runner() -> None:
    sched, runner = _sched(max_num_seqs=1, max_num_batched_tokens=64)
    sched.add_request(_req("run", 9))
    sched.add_request(_req("wait", 9, base=30))
    _step(sched, runner)
    assert sched.kv.pool.num_free_blocks < 64
    ended = sched.finish_requests(["run", "wait", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in ended] == ["run", "wait"]
    assert sched.num_waiting == 0 and sched.num_running == 0
    assert sched.kv.pool.num_free_blocks == 64
    out = sched.schedule()
    assert out.is_empty and out.finished_req_ids == {"run", "wait"}
    assert sched.schedule().finished_req_ids == frozenset()  # reported once


def test_finish_requests_needs_a_finished_status() -> None:
    sched, _ = _sched()
    with pytest.raises(ValueError, match="not a finished status"):
        sched.finish_requests(["a"], RequestStatus.RUNNING)


def _scripted(tokens: list[int], n_prompt: int):
    return lambda context, draw: tokens[len(context) - n_prompt]


STOPPED, LENGTH = RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH


@pytest.mark.parametrize(
    ("params", "max_model_len", "script", "n_out", "status", "stop_reason"),
    [
        (SamplingParams(max_tokens=10, temperature=0), 100, [5, EOS, 6], 2, STOPPED, None),
        (SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), 100, [5, EOS, 6], 3, LENGTH, None),
        (SamplingParams(max_tokens=10, temperature=0, min_tokens=3), 100, [EOS, EOS, EOS, 7], 3, STOPPED, None),
        (SamplingParams(max_tokens=10, temperature=0, stop_token_ids=(7,)), 100, [5, 7, 8], 2, STOPPED, 7),
        (SamplingParams(max_tokens=4, temperature=0), 100, [5, 6, 8, 9, 10], 4, LENGTH, None),
        # the context limit (prompt 5 + 3 = max_model_len 8) ends it before max_tokens
        (SamplingParams(max_tokens=10, temperature=0), 8, [5, 6, 8, 9, 10], 3, LENGTH, None),
    ],
)
def test_token_level_stop_conditions(params, max_model_len, script, n_out, status, stop_reason) -> None:
    sched, runner = _sched(max_model_len=max_model_len, next_token=_scripted(script, 5))
    req = _req("a", 5, params)
    sched.add_request(req)
    for _ in range(20):
        if not sched.has_unfinished_requests():
            break
        _step(sched, runner)
    assert req.output_token_ids == script[:n_out]
    assert req.status is status and req.stop_reason == stop_reason
    assert sched.kv.pool.num_free_blocks == 64
