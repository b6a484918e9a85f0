"""LoRA adapter slots (pure LRU bookkeeping) and how the scheduler admits requests by adapter: a request waits
while every slot is held by running requests, an idle adapter is evicted least recently used first, a running
request's adapter never is, and prefix-cache blocks are keyed by adapter."""

from __future__ import annotations

import pytest
from worker.core.config import EngineConfig
from worker.core.lora import LoraSlots, LoraSpec
from worker.core.request import Request, RequestStatus, SamplingParams
from worker.core.scheduler import Scheduler
from worker.engine.toy import EOS, ToyRunner

GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)

# (operations, expected results): "+N" acquires adapter N (result: slot or None), "-N" releases it, "xN" discards
SLOT_CASES = [
    ("hit keeps the slot", 2, ["+1", "+1", "-1", "+1"], [0, 0, None, 0]),
    ("free slots are used before eviction", 2, ["+1", "-1", "+2"], [0, None, 1]),
    ("all held: refused", 2, ["+1", "+2", "+3"], [0, 1, None]),
    ("least recently released is evicted", 2, ["+1", "+2", "-2", "-1", "+3"], [0, 1, None, None, 1]),
    ("held adapters are never evicted", 2, ["+1", "+2", "-1", "+3", "+4"], [0, 1, None, 0, None]),
    ("a discarded idle adapter frees its slot", 1, ["+1", "-1", "x1", "+2"], [0, None, None, 0]),
    ("a discarded held adapter frees it on release", 1, ["+1", "x1", "+2", "-1", "+2"], [0, None, None, None, 0]),
]


@pytest.mark.parametrize(("max_loras", "ops", "expected"), [c[1:] for c in SLOT_CASES], ids=[c[0] for c in SLOT_CASES])
def test_slots(max_loras: int, ops: list[str], expected: list[int | None]) -> None:
    slots = LoraSlots(max_loras)
    results: list[int | None] = []
    for op in ops:
        kind, lora_id = op[0], int(op[1:])
        if kind == "+":
            results.append(slots.acquire(lora_id))
        elif kind == "-":
            slots.release(lora_id)
            results.append(None)
        else:
            slots.discard(lora_id)
            results.append(None)
    assert results == expected


def test_slot_counters_and_release_errors() -> None:
    slots = LoraSlots(1)
    assert slots.acquire(1) == 0
    slots.release(1)
    assert slots.acquire(2) == 0
    assert (slots.loads_total, slots.evictions_total) == (2, 1)
    with pytest.raises(ValueError, match="released more often"):
        slots.release(1)
    with pytest.raises(ValueError, match="max_loras"):
        LoraSlots(0)


def _sched(max_loras: int = 1, **cfg) -> tuple[Scheduler, ToyRunner]:
    config = EngineConfig(block_size=4, enable_lora=True, max_loras=max_loras, **cfg)
    return Scheduler(config, 64, 1000), ToyRunner(64, 4, 1000)


def _req(rid: str, lora: LoraSpec | None, n_prompt: int = 10) -> Request:
    prompt = [i % 200 + 1 for i in range(n_prompt)]
    return Request(request_id=rid, prompt_token_ids=prompt, sampling_params=GREEDY, eos_token_id=EOS, lora=lora)


A, B = LoraSpec("a", 1, "/a"), LoraSpec("b", 2, "/b")


def test_a_request_whose_adapter_has_no_slot_waits_and_others_pass_it() -> None:
    sched, runner = _sched(max_loras=1)
    for rid, lora in [("r1", A), ("r2", B), ("r3", None), ("r4", A)]:
        sched.add_request(_req(rid, lora))
    out = sched.schedule()
    assert {s.req_id: (s.lora, s.lora_slot) for s in out.seqs} == {
        "r1": (A, 0),
        "r3": (None, -1),
        "r4": (A, 0),
    }
    assert sched.num_waiting == 1  # r2: b has no slot while a's requests run
    stats = sched.lora_stats()
    assert stats is not None and (stats.running, stats.waiting) == (("a",), ("b",))
    for _ in range(20):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        sched.update_from_output(out, runner.execute_model(out))
    assert not sched.has_unfinished_requests()
    stats = sched.lora_stats()
    assert stats is not None and (stats.loads_total, stats.evictions_total) == (2, 1)


def test_preemption_gives_the_slot_back() -> None:
    sched, _ = _sched(max_loras=1)
    req = _req("r1", A)
    sched.add_request(req)
    sched.schedule()
    assert sched.lora_slots is not None and sched.lora_slots.refs(A.lora_id) == 1
    sched._preempt(req, 0)
    assert sched.lora_slots.refs(A.lora_id) == 0 and req.lora_slot is None
    sched.finish_requests(["r1"], RequestStatus.FINISHED_ABORTED)


def test_adapters_need_lora_enabled() -> None:
    sched = Scheduler(EngineConfig(block_size=4), 64, 1000)
    with pytest.raises(ValueError, match="enable_lora"):
        sched.add_request(_req("r1", A))


def test_prefix_blocks_are_keyed_by_adapter() -> None:
    sched, runner = _sched(max_loras=2)
    first = _req("r1", A, n_prompt=17)
    sched.add_request(first)
    while sched.has_unfinished_requests():
        out = sched.schedule()
        sched.update_from_output(out, runner.execute_model(out))
    for rid, lora, hit in [("same", A, 16), ("other", B, 0), ("base", None, 0)]:
        req = _req(rid, lora, n_prompt=17)
        _, tokens = sched.kv.get_computed_blocks(req)
        assert tokens == hit, rid
