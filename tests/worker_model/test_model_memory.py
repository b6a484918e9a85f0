"""The worker's large CPU buffers: the KV cache in transparent huge pages (`memory.huge_page_zeros`)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from worker.model.memory import HUGE_PAGE, huge_page_zeros

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def anon_huge_kb() -> int:
    rollup = Path("/proc/self/smaps_rollup").read_text()
    return int(re.search(r"AnonHugePages:\s+(\d+) kB", rollup).group(1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_huge_page_zeros_is_a_zeroed_writable_tensor_aligned_to_2mb(dtype):
    t, _ = huge_page_zeros((3, 2, 100, 16, 3, 64), dtype)
    assert t.shape == (3, 2, 100, 16, 3, 64) and t.dtype == dtype and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE == 0
    assert not t.any()
    t[1, 0, 7] = 2.5
    assert t.sum().item() == 2.5 * 16 * 3 * 64


def test_an_empty_shape_needs_no_mapping():
    t, advised = huge_page_zeros((0, 4), torch.bfloat16)
    assert t.shape == (0, 4) and not advised


@pytest.mark.skipif(
    not THP.is_file() or "[never]" in THP.read_text(), reason="transparent huge pages are off on this machine"
)
def test_the_kv_cache_memory_is_in_huge_pages():
    """The pages are faulted in when the tensor is made (zeroed), in 2 MB pages, and go when it goes."""
    before = anon_huge_kb()
    t, advised = huge_page_zeros((16 * HUGE_PAGE // 2,), torch.bfloat16)
    assert advised
    grown = anon_huge_kb() - before
    assert grown >= 2048, f"no 2 MB page backs the 32 MB buffer (AnonHugePages grew by {grown} kB)"
    del t
    assert anon_huge_kb() - before < grown
