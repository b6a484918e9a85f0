"""Speculative decoding at the scheduler level, on the toy runner: drafts, verification, rollback, stop rules.

The toy model here mostly copies its context with a period of 5 tokens (so prompt-lookup drafts are often right)
and deviates at about one position in six (so drafts are also rejected, mid-draft and at the first token). The
toy runner writes every scheduled token, drafts included, into its paged "KV cache" and reads the context back
through the block table, so a rejected draft counted as computed, a stale slot read, or a rejected token that
reached the prefix cache changes the output. Every run is compared with the same engine without speculation.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from worker.core.config import EngineConfig, SpeculativeConfig
from worker.core.kv_cache_manager import token_slice
from worker.core.request import RequestStatus, SamplingParams
from worker.core.scheduler import Scheduler
from worker.engine.core import EngineCore
from worker.engine.toy import EOS, ToyRunner, context_hash, toy_next_token

PERIOD = 5


def copying_next_token(context: Sequence[int], draw: int = 0) -> int:
    h = context_hash(context) + draw
    if h % 6 == 0 or len(context) < PERIOD:
        return toy_next_token(context, draw)
    return context[-PERIOD]


def make_core(spec: SpeculativeConfig | None, num_blocks: int = 128, block_size: int = 4, **config) -> EngineCore:
    cfg = EngineConfig(block_size=block_size, speculative=spec, **config)
    runner = ToyRunner(num_blocks=num_blocks, block_size=block_size, max_model_len=96, next_token=copying_next_token)
    return EngineCore.from_config(cfg, runner)


def workload(n: int, seed: int) -> list[tuple[list[int], SamplingParams]]:
    rnd = random.Random(seed)
    work = []
    for i in range(n):
        unit = [rnd.choice(b"abcdefgh") for _ in range(PERIOD)]
        prompt = (unit * 4)[: rnd.randrange(3, 20)] + [rnd.choice(b"xyz") for _ in range(rnd.randrange(0, 4))]
        temperature = 0.0 if i % 3 else 0.8
        max_tokens = rnd.randrange(1, 40)
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            seed=i if temperature else None,
            ignore_eos=i % 4 == 0,
            stop_token_ids=(ord("q"),) if i % 5 == 0 else (),
            min_tokens=min(3, max_tokens) if i % 7 == 0 else 0,
            logprobs=i % 8 == 1,  # such requests are never speculated
            stop=(bytes(unit[1:3]).decode(),) if i % 6 == 2 else (),
        )
        work.append((prompt, params))
    return work


def run(core: EngineCore, work, prefix: str) -> list:
    reqs = [core.add_request(f"{prefix}{i}", prompt, params) for i, (prompt, params) in enumerate(work)]
    texts = {r.request_id: "" for r in reqs}
    for _ in range(10_000):
        if not core.has_unfinished_requests():
            break
        for out in core.step():
            texts[out.request_id] += out.new_text
        assert_consistent(core.scheduler)
    else:
        pytest.fail("not finished")
    return [(r.output_token_ids, r.status, r.stop_reason, texts[r.request_id]) for r in reqs]


def assert_consistent(sched: Scheduler) -> None:
    """Ref counts match the block tables, and every cached block of a running request holds its real tokens."""
    counts: dict[int, int] = {}
    bs = sched.kv.block_size
    for req in sched.running:
        assert req.num_computed_tokens <= req.num_tokens
        blocks = sched.kv._blocks.get(req.request_id, [])
        for i, block in enumerate(blocks):
            counts[block.block_id] = counts.get(block.block_id, 0) + 1
            if block.block_hash is not None:
                assert (i + 1) * bs <= req.num_computed_tokens
                assert block.block_hash.token_ids == tuple(token_slice(req, i * bs, (i + 1) * bs))
    for block in sched.kv.pool.blocks:
        assert block.ref_cnt == counts.get(block.block_id, 0)


SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1, disable_by_batch_size=64)
CONFIGS = {
    "alone": dict(max_num_seqs=1, max_num_batched_tokens=512, enable_prefix_caching=False),
    "batch": dict(max_num_seqs=32, max_num_batched_tokens=512),
    "small-budget": dict(max_num_seqs=4, max_num_batched_tokens=6),
    "tight-memory": dict(max_num_seqs=16, max_num_batched_tokens=64, num_blocks=24),
    "block-1": dict(max_num_seqs=8, max_num_batched_tokens=64, block_size=1, num_blocks=400),
    "block-8-priority": dict(max_num_seqs=6, max_num_batched_tokens=32, block_size=8, scheduling_policy="priority"),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_outputs_equal_decoding_without_speculation(name: str) -> None:
    cfg = CONFIGS[name]
    work = workload(30, seed=3)
    plain, spec = make_core(None, **cfg), make_core(SPEC, **cfg)
    for round_ in range(2):  # the second round hits the prefix cache the first one filled
        expected = run(plain, work, f"r{round_}-")
        got = run(spec, work, f"r{round_}-")
        for i, (e, g) in enumerate(zip(expected, got, strict=True)):
            assert g == e, (i, work[i])
        for core in (plain, spec):
            pool = core.scheduler.kv.pool
            assert pool.num_free_blocks == pool.num_blocks
    stats = spec.stats().spec_decode
    assert stats is not None and plain.stats().spec_decode is None
    # both outcomes really happened: accepted drafts and rejected ones
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    if name == "tight-memory":
        assert spec.stats().num_preemptions_total > 0


def test_speculation_gains_several_tokens_per_step_and_respects_max_tokens() -> None:
    core = make_core(SPEC, max_num_seqs=1, max_num_batched_tokens=512)
    prompt = list(b"abcde" * 4)
    req = core.add_request("a", prompt, SamplingParams(max_tokens=23, temperature=0.0, ignore_eos=True))
    plain = make_core(None, max_num_seqs=1, max_num_batched_tokens=512)
    ref = plain.add_request("a", prompt, SamplingParams(max_tokens=23, temperature=0.0, ignore_eos=True))
    steps = 0
    while core.has_unfinished_requests():
        sched_out = core.scheduler.schedule()
        for seq in sched_out.seqs:  # drafts never reach past max_tokens: k <= remaining - 1
            assert len(seq.draft_token_ids) <= req.sampling_params.max_tokens - req.num_output_tokens - 1
        core.scheduler.update_from_output(sched_out, core.runner.execute_model(sched_out))
        steps += 1
    while plain.has_unfinished_requests():
        plain.step()
    assert req.output_token_ids == ref.output_token_ids and len(req.output_token_ids) == 23
    assert steps < 23 - 5  # the prefill step, then clearly fewer steps than tokens


def test_no_drafts_above_the_batch_limit_nor_for_logprobs_requests() -> None:
    spec = SpeculativeConfig(
        num_speculative_tokens=3, prompt_lookup_max=2, prompt_lookup_min=1, disable_by_batch_size=2
    )
    core = make_core(spec, max_num_seqs=8, max_num_batched_tokens=256)
    prompt = list(b"abcde" * 3)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    for i in range(3):
        core.add_request(f"r{i}", prompt, params)
    core.step()  # prefill all three
    out = core.scheduler.schedule()
    assert len(out.seqs) == 3 and all(not s.draft_token_ids for s in out.seqs)  # 3 decoding > limit 2
    core.scheduler.update_from_output(out, core.runner.execute_model(out))
    core.abort_requests(["r0"])
    out = core.scheduler.schedule()
    assert len(out.seqs) == 2 and all(s.draft_token_ids for s in out.seqs)
    assert out.num_batched_tokens == sum(len(s.token_ids) for s in out.seqs)
    core.scheduler.update_from_output(out, core.runner.execute_model(out))

    lp = make_core(spec, max_num_seqs=8, max_num_batched_tokens=256)
    lp.add_request("lp", prompt, SamplingParams(max_tokens=10, temperature=0.0, logprobs=True, ignore_eos=True))
    lp.add_request("pl", prompt, SamplingParams(max_tokens=10, temperature=0.0, prompt_logprobs=1, ignore_eos=True))
    for _ in range(12):
        out = lp.scheduler.schedule()
        assert all(not s.draft_token_ids for s in out.seqs)
        if out.is_empty:
            break
        lp.scheduler.update_from_output(out, lp.runner.execute_model(out))


@pytest.mark.parametrize(
    ("params", "n_out", "status"),
    [
        # EOS inside the verified tokens: stops there, the rest is dropped
        (SamplingParams(max_tokens=40, temperature=0.0), None, RequestStatus.FINISHED_STOPPED),
        # a stop token id inside a run of accepted drafts
        (SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=(ord("c"),)), 3, RequestStatus.FINISHED_STOPPED),
        # min_tokens defers it
        (
            SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=(ord("c"),), min_tokens=4),
            8,
            RequestStatus.FINISHED_STOPPED,
        ),
        (SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True), 7, RequestStatus.FINISHED_LENGTH),
    ],
)
def test_stop_rules_apply_to_each_verified_token(params: SamplingParams, n_out, status) -> None:
    def script(context: Sequence[int], draw: int = 0) -> int:  # copies with period 5, EOS at output 11
        return EOS if len(context) == 20 + 11 else context[-PERIOD]

    results = []
    for spec in (None, SPEC):
        cfg = EngineConfig(block_size=4, speculative=spec, max_num_seqs=4, max_num_batched_tokens=64)
        core = EngineCore.from_config(cfg, ToyRunner(num_blocks=64, block_size=4, next_token=script))
        req = core.add_request("a", list(b"abcde" * 4), params)
        while core.has_unfinished_requests():
            core.step()
        results.append((req.output_token_ids, req.status))
    assert results[0] == results[1]
    tokens, got_status = results[1]
    assert got_status is status
    assert len(tokens) == (12 if n_out is None else n_out)
    assert core.stats().spec_decode.num_accepted_tokens > 0


def test_a_runner_answer_that_does_not_fit_the_drafts_is_refused() -> None:
    core = make_core(SPEC, max_num_seqs=1, max_num_batched_tokens=64)
    core.add_request("a", list(b"abcde" * 4), SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    core.step()
    out = core.scheduler.schedule()
    (seq,) = out.seqs
    assert seq.draft_token_ids
    runner_out = core.runner.execute_model(out)
    runner_out.verified_token_ids["a"] = [1] * (len(seq.draft_token_ids) + 2)
    with pytest.raises(ValueError, match="verified"):
        core.scheduler.update_from_output(out, runner_out)


def reference(prompt: Sequence[int], params: SamplingParams, max_len: int) -> list[int]:
    """The copying toy model run alone, one token at a time, with the token-level stop rules."""
    context, out = list(prompt), []
    rng = None if params.greedy else random.Random(params.seed)
    while True:
        token = copying_next_token(context, 0 if rng is None else rng.randrange(1 << 30))
        out.append(token)
        context.append(token)
        if len(out) >= params.min_tokens and (
            (token == EOS and not params.ignore_eos) or token in params.stop_token_ids
        ):
            return out
        if len(out) >= params.max_tokens or len(context) >= max_len:
            return out


@st.composite
def _scenarios(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    max_num_seqs = draw(st.integers(1, 6))
    cfg = dict(
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=draw(st.integers(max_num_seqs, 24)),
        enable_prefix_caching=draw(st.booleans()),
        num_blocks=draw(st.integers(max(2, 24 // block_size), 80 // block_size + 2)),
    )
    spec = SpeculativeConfig(
        num_speculative_tokens=draw(st.integers(1, 6)),
        prompt_lookup_max=draw(st.integers(1, 4)),
        prompt_lookup_min=1,
        disable_by_batch_size=draw(st.integers(1, 6)),
    )
    events = []
    for i in range(draw(st.integers(1, 8))):
        unit = draw(st.lists(st.integers(97, 100), min_size=1, max_size=PERIOD))
        prompt = (unit * 6)[: draw(st.integers(1, 20))]
        max_tokens = draw(st.integers(1, 24))
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=draw(st.sampled_from([0.0, 0.7])),
            seed=i,
            ignore_eos=draw(st.booleans()),
            min_tokens=draw(st.integers(0, min(3, max_tokens))),
            stop_token_ids=draw(st.sampled_from([(), (ord("a"),)])),
        )
        events.append((draw(st.integers(0, 10)), draw(st.one_of(st.none(), st.integers(0, 20))), prompt, params))
    pause = draw(st.one_of(st.none(), st.tuples(st.integers(0, 12), st.integers(1, 6))))
    return cfg, spec, events, pause


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario=_scenarios())
def test_random_workloads_with_aborts_and_pauses_match_the_reference(scenario) -> None:
    cfg, spec, events, pause = scenario
    core = make_core(spec, **cfg)
    sched = core.scheduler
    max_len = sched.max_request_len
    added, aborted = {}, set()
    for step in range(2000):
        for i, (arrive, abort, prompt, params) in enumerate(events):
            if arrive == step and len(prompt) < max_len:
                added[i] = core.add_request(f"r{i}", prompt, params)
            if abort == step and i in added and not added[i].is_finished:
                core.abort_requests([f"r{i}"])
                aborted.add(i)
        if pause is not None and step == pause[0]:
            core.pause()
        if pause is not None and step == pause[0] + pause[1]:
            core.resume()
        if step > 10 and not core.has_unfinished_requests():
            break
        if sched.has_schedulable_requests():
            core.step()
        assert_consistent(sched)
    else:
        pytest.fail("workload did not finish")
    for i, req in added.items():
        if i not in aborted:
            assert req.output_token_ids == reference(events[i][2], events[i][3], max_len), i
    pool = sched.kv.pool
    assert pool.num_free_blocks == pool.num_blocks
    stats = sched.spec_decode_stats
    event(
        f"drafts verified: {stats.num_draft_tokens > 0}, some rejected: {stats.num_accepted_tokens < stats.num_draft_tokens}"
    )
    event(f"preempted: {sched.num_preemptions_total > 0}")
