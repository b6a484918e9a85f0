"""Outputs do not depend on how requests were scheduled: batched, chunked, prefix-cached, preempted or alone.

The toy runner derives each token from the whole context read back through the block table, so any scheduling
mistake (wrong block, stale KV, lost tokens on recompute) changes the output. Every run must also return every
KV block to the pool, including for aborted and preempted requests.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from worker.core.request import RequestStatus, SamplingParams

SHARED = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]


def _workload(n: int, seed: int) -> list[tuple[list[int], SamplingParams]]:
    rnd = random.Random(seed)
    work = []
    for i in range(n):
        head = SHARED[: rnd.choice([0, 5, 8, 14])]
        prompt = head + [rnd.randrange(1, 250) for _ in range(rnd.randrange(1, 30))]
        temperature = 0.0 if i % 3 else 0.8
        params = SamplingParams(
            max_tokens=rnd.randrange(1, 40),
            temperature=temperature,
            seed=i if temperature else None,
            ignore_eos=i % 4 == 0,
            stop_token_ids=(ord("q"),) if i % 5 == 0 else (),
            min_tokens=2 if i % 7 == 0 else 0,
            logprobs=i % 2 == 0,
        )
        work.append((prompt, params))
    return work


CONFIGS = {
    "alone": dict(max_num_seqs=1, max_num_batched_tokens=4096, num_blocks=512, enable_prefix_caching=False),
    "big-batch": dict(max_num_seqs=32, max_num_batched_tokens=4096, num_blocks=512),
    "chunked": dict(max_num_seqs=8, max_num_batched_tokens=8, num_blocks=512),
    "no-chunking": dict(max_num_seqs=8, max_num_batched_tokens=80, num_blocks=512, enable_chunked_prefill=False),
    "tight-memory": dict(max_num_seqs=16, max_num_batched_tokens=64, num_blocks=20),
    "tight-no-cache": dict(max_num_seqs=16, max_num_batched_tokens=64, num_blocks=20, enable_prefix_caching=False),
    "priority": dict(max_num_seqs=6, max_num_batched_tokens=32, num_blocks=24, scheduling_policy="priority"),
    "block-16": dict(max_num_seqs=8, max_num_batched_tokens=48, num_blocks=12, block_size=16),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_outputs_equal_the_reference_under_every_configuration(name: str, kit) -> None:
    cfg = dict(CONFIGS[name])
    core = kit.make_core(max_model_len=80, **cfg)
    max_len = core.scheduler.max_request_len
    work = _workload(24, seed=1)
    for round_ in range(2):  # the second round finds the first round's prefixes in the cache
        reqs = [
            core.add_request(f"r{round_}-{i}", prompt, params, priority=i % 3)
            for i, (prompt, params) in enumerate(work)
        ]
        for _ in range(100_000):
            if not core.has_unfinished_requests():
                break
            core.step()
            kit.assert_refcounts_consistent(core.scheduler)
        for req, (prompt, params) in zip(reqs, work, strict=True):
            tokens, reason = kit.reference(prompt, params, max_len)
            assert req.output_token_ids == tokens, req.request_id
            assert req.status.finish_reason is reason
            assert len(req.output_logprobs) == (len(tokens) if params.logprobs else 0)
        kit.assert_pool_empty(core.scheduler)
    stats = core.stats()
    # Make sure the mechanisms under test really ran.
    if name.startswith("tight"):
        assert stats.num_preemptions_total > 0
    if cfg.get("enable_prefix_caching", True):
        assert stats.prefix_cache_hits_total > 0
    else:
        assert stats.prefix_cache_queries_total == 0


@st.composite
def _scenarios(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    max_num_seqs = draw(st.integers(1, 8))
    cfg = dict(
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=draw(st.integers(max_num_seqs, 40)),
        enable_prefix_caching=draw(st.booleans()),
        scheduling_policy=draw(st.sampled_from(["fcfs", "priority"])),
    )
    num_blocks = draw(st.integers(max(2, 12 // block_size), 60 // block_size + 2))
    n = draw(st.integers(1, 10))
    prompts = [
        draw(st.lists(st.integers(1, 4), min_size=1, max_size=24)) for _ in range(n)
    ]  # a 4-token alphabet: many shared prefixes
    events = []
    for i, prompt in enumerate(prompts):
        params = SamplingParams(
            max_tokens=draw(st.integers(1, 20)),
            temperature=draw(st.sampled_from([0.0, 0.7])),
            seed=i,
            ignore_eos=draw(st.booleans()),
        )
        events.append(
            dict(
                arrive=draw(st.integers(0, 15)),
                abort=draw(st.one_of(st.none(), st.integers(0, 30))),
                prompt=prompt,
                params=params,
                priority=draw(st.integers(0, 2)),
            )
        )
    pause = draw(st.one_of(st.none(), st.tuples(st.integers(0, 20), st.integers(1, 10))))
    return cfg, num_blocks, events, pause


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario=_scenarios())
def test_random_workloads_match_the_reference_and_free_every_block(scenario, kit) -> None:
    cfg, num_blocks, events, pause = scenario
    core = kit.make_core(num_blocks=num_blocks, max_model_len=64, **cfg)
    sched = core.scheduler
    max_len = sched.max_request_len
    added = {}
    aborted = set()
    for step in range(2000):
        for i, ev in enumerate(events):
            if ev["arrive"] == step:
                if len(ev["prompt"]) >= max_len:
                    with pytest.raises(ValueError):
                        core.add_request(f"r{i}", ev["prompt"], ev["params"], ev["priority"])
                    continue
                added[i] = core.add_request(f"r{i}", ev["prompt"], ev["params"], ev["priority"])
            if ev["abort"] == step and i in added and not added[i].is_finished:
                outs = core.abort_requests([f"r{i}"])
                assert [o.finish_reason.value for o in outs] == ["abort"]
                aborted.add(i)
        if pause is not None:
            if step == pause[0]:
                core.pause()
            if step == pause[0] + pause[1]:
                core.resume()
        if step > 15 and not core.has_unfinished_requests():
            break
        if sched.has_schedulable_requests():
            core.step()
        kit.assert_refcounts_consistent(sched)
    else:
        pytest.fail("workload did not finish")
    for i, req in added.items():
        if i in aborted:
            assert req.status is RequestStatus.FINISHED_ABORTED
            continue
        tokens, reason = kit.reference(events[i]["prompt"], events[i]["params"], max_len)
        assert req.output_token_ids == tokens
        assert req.status.finish_reason is reason
    kit.assert_pool_empty(sched)
