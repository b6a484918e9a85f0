"""The vLLM backend's LoRA pieces that need no vLLM: flag mapping, the rank rule, vLLM's error text as our 400
reason, the CPU fix of vLLM's LoRA ops (on torch tensors, against a stand-in op with vLLM's semantics), the slot
counters, the adapter checks vLLM leaves out, and the stats snapshot. The engine itself is tested with vLLM in
test_server_vllm.py and test_vllm_cpu_lora_ops.py (marker `vllm`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
testing = pytest.importorskip("worker.model.testing")

from pydantic import ValidationError  # noqa: E402
from worker.backends.vllm import (  # noqa: E402
    LORA_WORKER_EXTENSION,
    SlotCounts,
    VllmEngine,
    _skip_no_lora_rows,
    _Snapshot,
    adapter_shape_error,
    checked_adapter_folder,
    count_slot_loads,
    vllm_engine_args,
    vllm_finish_reason,
    vllm_lora_error,
)
from worker.core.lora import LoraStats  # noqa: E402
from worker.core.request import FinishReason  # noqa: E402
from worker.server.settings import VLLM_MAX_LORA_RANKS, WorkerSettings  # noqa: E402


def _settings(**fields) -> WorkerSettings:
    return WorkerSettings(**({"model": "/m", "engine": "vllm", "served_model_name": "tiny"} | fields))


# ---- flags ---------------------------------------------------------------------------------------------------------


def test_lora_flags_map_to_vllms_engine_args() -> None:
    args = vllm_engine_args(_settings(enable_lora=True, max_loras=4, max_lora_rank=32), "/m", device_is_cpu=True)
    assert (args["enable_lora"], args["max_loras"], args["max_lora_rank"]) == (True, 4, 32)
    assert args["worker_extension_cls"] == LORA_WORKER_EXTENSION == "worker.backends.vllm.LoraWorkerExtension"
    # unset sizes keep vLLM's defaults (1 adapter, rank 16, as ours); GPUs get the extension too (slot counters)
    args = vllm_engine_args(_settings(enable_lora=True), "/m", device_is_cpu=False)
    assert args["enable_lora"] is True and "max_loras" not in args and "max_lora_rank" not in args
    assert args["worker_extension_cls"] == LORA_WORKER_EXTENSION
    plain = vllm_engine_args(_settings(), "/m", device_is_cpu=True)
    assert not {"enable_lora", "max_loras", "max_lora_rank", "worker_extension_cls"} & set(plain)


def test_lora_flags_are_not_extra_engine_flags() -> None:
    settings = _settings(enable_lora=True, engine_extra_args={"worker_extension_cls": "my.Ext"})
    with pytest.raises(ValueError, match=r"\['worker_extension_cls'\] are set by the worker itself"):
        vllm_engine_args(settings, "/m", device_is_cpu=True)


def test_enable_lora_is_taken_with_the_vllm_engine() -> None:
    settings = _settings(enable_lora=True, max_loras=2, max_lora_rank=8, lora_modules={"sql": "/a/sql"})
    assert settings.enable_lora and settings.lora_modules == {"sql": "/a/sql"}


@pytest.mark.parametrize(
    ("rank", "message"),
    [
        (12, "--max-lora-rank 12: the vllm engine takes one of 1, 8, 16, 32, 64, 128, 256, 320, 512"),
        (12, "use 16 (adapters of lower rank are served too)"),
        (2, "use 8"),
        (600, "use at most 512"),
    ],
)
def test_ranks_vllm_does_not_take_are_refused_with_the_next_one(rank, message) -> None:
    with pytest.raises(ValidationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _settings(enable_lora=True, max_lora_rank=rank)
    assert WorkerSettings(model="/m", enable_lora=True, max_lora_rank=rank).max_lora_rank == rank  # builtin: any


@pytest.mark.parametrize("rank", VLLM_MAX_LORA_RANKS)
def test_ranks_vllm_takes(rank) -> None:
    assert vllm_engine_args(_settings(enable_lora=True, max_lora_rank=rank), "/m", True)["max_lora_rank"] == rank


def test_cli_refuses_a_rank_vllm_does_not_take() -> None:
    from typer.testing import CliRunner

    from llmfleet.cli import app

    args = ["worker", "--model", "/nonexistent/m", "--engine", "vllm", "--host", "127.0.0.1", "--port", "0"]
    result = CliRunner().invoke(app, [*args, "--enable-lora", "--max-lora-rank", "12"])
    assert result.exit_code == 2 and "use 16" in result.output


# ---- vLLM's errors as our reasons ----------------------------------------------------------------------------------

WRAPPED = "Call to add_lora method failed: Worker failed with error '{}', please check the stack trace above for the root cause"


@pytest.mark.parametrize(
    ("raised", "reason"),
    [
        (
            WRAPPED.format("LoRA rank 32 is greater than max_lora_rank 8."),
            "LoRA rank 32 is greater than max_lora_rank 8.",
        ),
        (
            WRAPPED.format("Loading lora x failed: No adapter found for /a/x"),
            "Loading lora x failed: No adapter found for /a/x",
        ),
        ("Call to add_lora method failed: boom", "boom"),  # a single-process executor does not wrap it twice
        (
            WRAPPED.format(
                "The size of tensor a (64) must match the size of tensor b (128) at non-singleton dimension 1"
            ),
            "its tensor shapes do not fit this base model (The size of tensor a (64) must match",
        ),
        ("something else", "something else"),
    ],
)
def test_vllm_lora_error_keeps_vllms_reason(raised, reason) -> None:
    assert vllm_lora_error(Exception(raised)).startswith(reason)


# ---- the CPU fix: rows without an adapter (-1) keep their output ---------------------------------------------------


def bgmv_like_vllm(inputs, weights, output, indices, scaling=1.0, add=True):
    """vLLM 0.32's torch `bgmv_*` in one: gather each row's slot weights by index (-1 gathers the LAST slot)."""
    out = scaling * torch.einsum("bi,boi->bo", inputs, weights[indices])
    if add:
        output[:, : out.shape[1]] += out
    else:
        output[:, : out.shape[1]] = out


def _case(rows: list[int], slots: int = 2):
    gen = torch.Generator().manual_seed(0)
    inputs = torch.randn(len(rows), 6, generator=gen)
    weights = torch.randn(slots, 4, 6, generator=gen)
    output = torch.randn(len(rows), 4, generator=gen)
    return inputs, weights, output, torch.tensor(rows)


def test_the_op_vllm_ships_gives_base_rows_the_last_slots_adapter() -> None:
    inputs, weights, output, indices = _case([-1, 0, 1, -1])
    before = output.clone()
    bgmv_like_vllm(inputs, weights, output, indices)
    assert not torch.equal(output[0], before[0])  # the bug the fix is for
    assert torch.allclose(output[0], before[0] + weights[1] @ inputs[0])  # slot -1 is slot 1


@pytest.mark.parametrize("rows", [[-1, 0, 1, -1], [0, -1], [-1, -1, 1], [1, 0, 1]])
@pytest.mark.parametrize("add", [True, False])
def test_fixed_op_leaves_base_rows_and_computes_adapter_rows(rows, add) -> None:
    inputs, weights, output, indices = _case(rows)
    expected = output.clone()
    bgmv_like_vllm(inputs, weights, expected, indices, 0.5, add)
    got = output.clone()
    result = _skip_no_lora_rows(bgmv_like_vllm)(inputs, weights, got, indices, 0.5, add=add)
    assert result is None
    for i, slot in enumerate(rows):
        if slot < 0:
            assert torch.equal(got[i], output[i]), f"base row {i} changed"
        else:
            assert torch.allclose(got[i], expected[i]), f"adapter row {i} differs from the op's own result"


def test_fixed_op_without_adapter_rows_does_not_call_the_op() -> None:
    calls = []
    fixed = _skip_no_lora_rows(lambda *a, **k: calls.append(a))
    inputs, weights, output, indices = _case([-1, -1])
    before = output.clone()
    fixed(inputs, weights, output, indices, 1.0)
    assert calls == [] and torch.equal(output, before)


def test_fixed_op_passes_through_extra_arguments_and_other_shapes() -> None:
    seen = []

    def op(inputs, weights, output, indices, offset, size, add_inputs=True):
        seen.append((inputs.shape[0], indices.tolist(), offset, size, add_inputs))

    fixed = _skip_no_lora_rows(op)
    inputs, weights, output, indices = _case([1, -1, 0])
    fixed(inputs, weights, output, indices, 2, 3, add_inputs=False)  # bgmv_expand_slice's arguments
    assert seen == [(2, [1, 0], 2, 3, False)]
    fixed(inputs[:1], weights, output, indices, 0, 4)  # one row broadcast (bgmv_expand's `limit`): vLLM's op
    assert seen[-1][0] == 1 and seen[-1][1] == [1, -1, 0]
    assert getattr(fixed, "llmfleet_skips_no_lora_rows", False)


# ---- slot counters ---------------------------------------------------------------------------------------------------


class FakeWorkerManager:
    """vLLM's LRUCacheWorkerLoRAManager.add_adapter, reduced: a cache of `slots` registered adapters, each in a
    slot of the model (`_adapter_manager.lora_index_to_id`); adding one to a full cache first drops the least
    recently used (out of its slot too); `remove_adapter` is an unload."""

    def __init__(self, slots: int) -> None:
        self._adapter_manager = SimpleNamespace(lora_index_to_id=[None] * slots)
        self._lru: list[int] = []

    def add_adapter(self, request) -> bool:
        lora_id, table = request.lora_int_id, self._adapter_manager.lora_index_to_id
        if lora_id in self._lru:
            self._lru.remove(lora_id)
            self._lru.append(lora_id)
            return False
        if len(self._lru) == len(table):
            self.remove_adapter(self._lru[0])
        table[table.index(None)] = lora_id
        self._lru.append(lora_id)
        return True

    def remove_adapter(self, lora_id: int) -> bool:
        self._lru.remove(lora_id)
        table = self._adapter_manager.lora_index_to_id
        table[table.index(lora_id)] = None
        return True


def test_slot_loads_and_evictions_are_counted() -> None:
    manager, counts = FakeWorkerManager(2), SlotCounts()
    count_slot_loads(manager, counts)
    count_slot_loads(manager, counts)  # idempotent: not counted twice
    results = [manager.add_adapter(SimpleNamespace(lora_int_id=i)) for i in (1, 2, 1, 3, 3, 2)]
    assert results == [True, True, False, True, False, True]
    assert (counts.loads, counts.evictions) == (4, 2)  # 3 evicts 2 (1 was used later), 2 evicts 1
    assert manager._adapter_manager.lora_index_to_id == [2, 3]
    manager.remove_adapter(3)  # an unload
    assert (counts.loads, counts.evictions) == (4, 2)


# ---- the adapter checks vLLM leaves out ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-lora")
    model = testing.make_tiny_llama(root / "model", hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
    other = testing.make_tiny_llama(root / "other", hidden_size=64, num_attention_heads=1, num_key_value_heads=1)
    testing.make_random_lora(root / "good", model, rank=8, targets=("q_proj", "v_proj", "down_proj"))
    testing.make_random_lora(root / "wrong", other, rank=8)
    deep = testing.make_tiny_llama(root / "deep", hidden_size=128, num_attention_heads=2, num_hidden_layers=3)
    testing.make_random_lora(root / "deep-adapter", deep, rank=8, targets=("o_proj",))
    (root / "no-weights").mkdir()
    return root


def test_an_adapter_of_the_base_model_passes(tiny) -> None:
    assert adapter_shape_error(tiny / "good", tiny / "model") is None
    assert checked_adapter_folder(str(tiny / "good"), str(tiny / "model")) == str(tiny / "good")


def test_an_adapter_of_another_model_is_refused_as_our_engine_does(tiny) -> None:
    error = adapter_shape_error(tiny / "wrong", tiny / "model")
    assert error is not None and error.startswith("layer 0 ")
    assert "do not fit the base model, which needs" in error and "trained on another base model" in error
    with pytest.raises(ValueError, match="do not fit the base model"):
        checked_adapter_folder(str(tiny / "wrong"), str(tiny / "model"))
    deeper = adapter_shape_error(tiny / "deep-adapter", tiny / "model")
    assert deeper is not None and "layer 2 does not exist, the base model has 2 layers" in deeper


def test_what_the_check_cannot_judge_is_left_to_vllm(tiny, tmp_path) -> None:
    assert adapter_shape_error(tiny / "no-weights", tiny / "model") is None  # vLLM says what is missing
    (tmp_path / "config.json").write_text('{"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 8}')
    assert adapter_shape_error(tiny / "wrong", tmp_path) is None  # a base model our loader does not read


def test_a_missing_folder_is_refused_before_vllm_sees_it(tiny, monkeypatch) -> None:
    with pytest.raises(ValueError, match="adapter folder /nonexistent/a does not exist"):
        checked_adapter_folder("/nonexistent/a", str(tiny / "model"))
    monkeypatch.chdir(tiny)
    assert checked_adapter_folder("good", str(tiny / "model")) == str(tiny / "good")  # never a hub repo id


# ---- stats ------------------------------------------------------------------------------------------------------------


def test_snapshot_keeps_adapters_with_requests() -> None:
    snapshot = _Snapshot()
    stats = SimpleNamespace(
        num_running_reqs=2,
        num_waiting_reqs=1,
        kv_cache_usage=0.5,
        prefix_cache_stats=None,
        running_lora_adapters={"sql": 1, "poet": 0, "chat": 1},
        waiting_lora_adapters={"sql": 0, "poet": 1, "chat": 0},
    )
    snapshot.record(stats, None)
    assert (snapshot.lora_running, snapshot.lora_waiting) == (("chat", "sql"), ("poet",))


def test_engine_stats_carry_lora_only_when_enabled() -> None:
    plain = VllmEngine(vllm_engine_args(_settings(), "/m", True))
    assert not plain.lora_enabled and plain.stats().lora is None and plain.lora_adapters() == {}
    engine = VllmEngine(vllm_engine_args(_settings(enable_lora=True, max_loras=3), "/m", True))
    assert engine.lora_enabled and engine.stats().lora == LoraStats(max_loras=3)


@pytest.mark.parametrize(
    "reason,ours",
    [
        ("stop", FinishReason.STOP),
        ("length", FinishReason.LENGTH),
        ("abort", FinishReason.ABORT),
        ("error", FinishReason.ERROR),  # vLLM failed this request: the server answers 500, not a finished answer
        ("repetition", FinishReason.STOP),  # its repeated-pattern detector stopped the answer
        ("something-new", FinishReason.STOP),
        (None, FinishReason.STOP),
    ],
)
def test_vllm_finish_reasons_as_ours(reason: str | None, ours: FinishReason) -> None:
    assert vllm_finish_reason(reason) is ours
