"""The last layer's pruning: a step runs the last layer's o projection, MLP and final norm only on the rows it reads
(`runner.read_rows`, `LlamaModel.forward(rows=...)`), and that changes no token, no logprob and no cached K or V
against the same engine computing every row (`LlamaModel.prune_last_layer = False`)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from worker import LLM
from worker.core.config import SpeculativeConfig
from worker.core.outputs import ScheduledSeq, SchedulerOutput
from worker.core.request import SamplingParams
from worker.model.runner import ModelRunner, read_rows

GREEDY = SamplingParams(temperature=0.0)


def seq(req_id: str, n: int, *, targets: int = 0, drafts: int = 0) -> ScheduledSeq:
    return ScheduledSeq(
        req_id,
        [5] * n,
        0,
        [0],
        True,
        GREEDY,
        prompt_targets=(7,) * targets,
        draft_token_ids=(9,) * drafts,
    )


LP3 = seq("lp", 3, targets=3)
PLAIN = seq("plain", 1)
SPEC2 = seq("spec", 3, drafts=2)


@pytest.mark.parametrize(
    "prompt_rows,sampled,expected",
    [
        ([], [], []),  # a mid-prompt chunk alone: no row is read
        ([], [(PLAIN, 4)], [4]),
        ([(LP3, 2)], [], [2, 3, 4]),  # prompt logprobs of a chunk that does not end its prompt
        ([(LP3, 2)], [(LP3, 4)], [2, 3, 4]),  # ... that does: its last row once
        ([], [(SPEC2, 9), (PLAIN, 3)], [3, 7, 8, 9]),  # drafts: the rows before the last too; ascending
        ([(LP3, 0)], [(PLAIN, 6), (SPEC2, 12)], [0, 1, 2, 6, 10, 11, 12]),
    ],
)
def test_read_rows(prompt_rows, sampled, expected) -> None:
    assert read_rows(prompt_rows, [(s, row, None) for s, row in sampled]) == expected


class RowsSeen:
    """Wraps a linear and records the row count of every call."""

    def __init__(self, linear) -> None:
        self.linear, self.rows = linear, []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.rows.append(x.shape[0])
        return self.linear(x)


def watch_o_proj(model, i: int) -> RowsSeen:
    """Layer i's o projection wrapped in a RowsSeen (the layers are frozen: the layer is replaced)."""
    seen = RowsSeen(model.layers[i].o_proj)
    model.layers[i] = dataclasses.replace(model.layers[i], o_proj=seen)
    return seen


def mixed_steps() -> list[SchedulerOutput]:
    """Two steps over a runner with 12 blocks of 4: a prompt chunk that does not end its prompt ("long"), one with
    prompt logprobs that does ("lp"), a whole prompt ("plain"); then "long"'s last chunk beside their decode rows."""
    lp = SamplingParams(temperature=0.0, logprobs=True, prompt_logprobs=2)
    long_prompt = list(range(20, 37))
    first = SchedulerOutput(
        [
            ScheduledSeq("long", long_prompt[:9], 0, [0, 1, 2, 3, 4], False, GREEDY),
            ScheduledSeq("lp", [40, 41, 42, 43, 44, 45], 0, [5, 6], True, lp, prompt_targets=(41, 42, 43, 44, 45)),
            ScheduledSeq("plain", [50, 51, 52], 0, [7], True, GREEDY),
        ],
        18,
    )
    second = SchedulerOutput(
        [
            ScheduledSeq("long", long_prompt[9:], 9, [0, 1, 2, 3, 4], True, GREEDY),
            ScheduledSeq("lp", [60], 6, [5, 6], True, lp, num_output_tokens=1),
            ScheduledSeq("plain", [61], 3, [7], True, GREEDY, num_output_tokens=1),
        ],
        10,
    )
    return [first, second]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pruned_steps_equal_full_ones_and_skip_the_unread_rows(tiny_dir, dtype) -> None:
    runs = {}
    for prune in (False, True):
        runner = ModelRunner(str(tiny_dir), dtype=dtype, num_blocks=12, block_size=4)
        model = runner.model
        model.prune_last_layer = prune
        first_o, last_o = watch_o_proj(model, 0), watch_o_proj(model, -1)
        outs = [runner.execute_model(step) for step in mixed_steps()]
        runs[prune] = (outs, runner.kv_cache.clone(), first_o.rows, last_o.rows)
    (full, full_kv, full_first, full_last), (pruned, pruned_kv, first, last) = runs[False], runs[True]
    assert torch.equal(pruned_kv, full_kv)  # every row's K and V, in every layer
    for p, f in zip(pruned, full, strict=True):
        assert p.sampled_token_ids == f.sampled_token_ids and not p.failed
        assert p.logprobs == pytest.approx(f.logprobs, abs=1e-5)
        assert p.prompt_logprobs.keys() == f.prompt_logprobs.keys()
        for req_id, entries in p.prompt_logprobs.items():
            expected = f.prompt_logprobs[req_id]
            assert [e.logprob for e in entries] == pytest.approx([e.logprob for e in expected], abs=1e-5)
            assert [[t for t, _ in e.top] for e in entries] == [[t for t, _ in e.top] for e in expected]
    assert first == full_first == full_last == [18, 10]  # the first layer, and the last without pruning: every row
    # pruned, the last layer's o projection: step 1 "lp"'s 6 rows (5 predict its prompt targets, the last samples)
    # + "plain"'s last, not "long"'s 9 nor "plain"'s first 2; step 2 the three rows it samples
    assert last == [7, 3]


def test_a_step_that_reads_no_row_still_fills_the_cache(tiny_dir) -> None:
    step = SchedulerOutput([ScheduledSeq("long", list(range(20, 29)), 0, [0, 1, 2], False, GREEDY)], 9)
    caches = []
    for prune in (False, True):
        runner = ModelRunner(str(tiny_dir), num_blocks=4, block_size=4)
        runner.model.prune_last_layer = prune
        last_o = watch_o_proj(runner.model, -1)
        out = runner.execute_model(step)
        assert not out.sampled_token_ids and not out.failed
        assert last_o.rows == ([] if prune else [9])
        caches.append(runner.kv_cache.clone())
    assert torch.equal(caches[0], caches[1])


def test_engine_output_is_the_same_pruned_or_not(tiny_dir) -> None:
    """Chunked prefill, prompt logprobs, logprobs and speculative decoding through the whole engine."""
    spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1)
    prompts = [list(range(30, 60)) + list(range(30, 40)), [7, 8, 9, 7, 8, 9, 7, 8], list(range(100, 117))]
    params = [
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=True),
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, prompt_logprobs=1),
    ]
    results = []
    for prune in (False, True):
        llm = LLM(
            str(tiny_dir), block_size=4, num_blocks=64, max_num_seqs=3, max_num_batched_tokens=16, speculative=spec
        )
        llm.engine.runner.model.prune_last_layer = prune
        results.append(llm.generate(prompts, params))
    for full, pruned in zip(*results, strict=True):
        assert pruned.token_ids == full.token_ids
        assert (pruned.logprobs is None) == (full.logprobs is None)
        assert pruned.logprobs is None or pruned.logprobs == pytest.approx(full.logprobs, abs=1e-5)
        assert (pruned.prompt_logprobs is None) == (full.prompt_logprobs is None)
        if full.prompt_logprobs is not None:
            assert [e.logprob for e in pruned.prompt_logprobs] == pytest.approx(
                [e.logprob for e in full.prompt_logprobs], abs=1e-5
            )
