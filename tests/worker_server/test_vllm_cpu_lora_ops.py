"""vLLM 0.32's own CPU LoRA ops (no engine): base-model rows (slot index -1) get the last slot's adapter, and
`skip_no_lora_rows_in_cpu_lora_ops` makes them skip those rows in every place the CPU punica wrapper looks them up.

Runs only where vLLM is installed (`make test-vllm`)."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.vllm]

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from vllm.lora.ops import torch_ops  # noqa: E402
from vllm.lora.ops.torch_ops import lora_ops  # noqa: E402
from vllm.lora.punica_wrapper import punica_cpu  # noqa: E402
from worker.backends.vllm import skip_no_lora_rows_in_cpu_lora_ops  # noqa: E402

OPS = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")
ROWS = [-1, 0, 0, -1, 1]  # base, adapter in slot 0 (twice), base, adapter in slot 1


def _lora_layer():
    """Two slots of one LoRA layer as vLLM stacks them: A [slots, 1, r, in], B [slots, 1, out, r]."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(len(ROWS), 16, generator=gen)
    a = torch.randn(2, 1, 4, 16, generator=gen)
    b = torch.randn(2, 1, 8, 4, generator=gen)
    y = torch.randn(len(ROWS), 8, generator=gen)
    return x, a, b, y


def _apply(module, x, a, b, y, indices):
    """y += (x @ A^T) @ B^T per row, with `module`'s bgmv ops (as PunicaWrapperCPU's decode path runs them)."""
    buffer = torch.zeros(x.shape[0], 4)
    module.bgmv_shrink(x, a, buffer, indices, 1.0)
    module.bgmv_expand(buffer, b, y, indices, True)
    return y


@pytest.fixture
def patched(monkeypatch):
    """The fix applied, undone after the test (the modules are process-wide)."""
    for module in (lora_ops, torch_ops, punica_cpu):
        for name in OPS:
            monkeypatch.setattr(module, name, getattr(module, name))
    wrapped = skip_no_lora_rows_in_cpu_lora_ops()
    yield wrapped


def test_vllms_cpu_ops_give_base_rows_the_last_slots_adapter() -> None:
    x, a, b, y = _lora_layer()
    got = _apply(lora_ops, x, a, b, y.clone(), torch.tensor(ROWS))
    assert not torch.allclose(got[0], y[0])  # the bug: a base row changed
    assert torch.allclose(got[0], y[0] + b[1, 0] @ (a[1, 0] @ x[0]), atol=1e-5)  # by slot 1's adapter


def test_fixed_ops_leave_base_rows_and_compute_adapter_rows(patched) -> None:
    assert sorted(patched) == sorted(f"{m.__name__}.{op}" for m in (lora_ops, torch_ops, punica_cpu) for op in OPS)
    assert skip_no_lora_rows_in_cpu_lora_ops() == []  # idempotent
    x, a, b, y = _lora_layer()
    for module in (lora_ops, punica_cpu):
        got = _apply(module, x, a, b, y.clone(), torch.tensor(ROWS))
        for i, slot in enumerate(ROWS):
            expected = y[i] if slot < 0 else y[i] + b[slot, 0] @ (a[slot, 0] @ x[i])
            assert torch.allclose(got[i], expected, atol=1e-5), (module.__name__, i)


def test_the_prefill_ops_take_the_fix_too(patched) -> None:
    """sgmv_* (vLLM v1 runs them for every step on CPU) look bgmv_* up as module globals of lora_ops."""
    x, a, b, y = _lora_layer()
    indices = torch.tensor(ROWS)
    lora_indices, seq_lens = torch.unique_consecutive(indices, return_counts=True)
    starts = torch.cumsum(seq_lens, 0) - seq_lens
    meta = (starts, seq_lens, lora_indices, len(seq_lens), int(seq_lens.max()), len(ROWS))
    buffer = torch.zeros(len(ROWS), 4)
    lora_ops.sgmv_shrink(x, a, buffer, *meta, 1.0)
    got = y.clone()
    lora_ops.sgmv_expand_slice(buffer, b, got, *meta, 0, 8, True)
    assert torch.equal(got[0], y[0]) and torch.equal(got[3], y[3])
    assert torch.allclose(got[4], y[4] + b[1, 0] @ (a[1, 0] @ x[4]), atol=1e-5)
