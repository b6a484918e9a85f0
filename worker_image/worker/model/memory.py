"""How the worker asks the OS for its large CPU buffers.

Why it exists: two allocation choices measurably change the engine's speed on CPU, and both are OS-level calls
that torch does not make for us:

* `keep_freed_memory_mapped`: glibc returns large freed blocks to the OS, so every step's large temporaries
  (gathered K/V, activations) would fault their pages in again on first touch.
* `huge_page_zeros`: the KV cache in transparent huge pages. Decode attention reads each sequence's blocks
  wherever they lie in the cache; with 4 KB pages nearly every block costs a TLB miss and a page walk. With 2 MB
  pages W's bf16 decode attention took 4.09-4.10 s against 4.15 s (`bench/engine_parts.py`: the run 12.83 ->
  12.67-12.69 s); an earlier A/B through torch's own switch (THP_MEM_ALLOC_ENABLE=1, every large allocation)
  gave 4.14-4.15 s against 4.27-4.40 s, and no change for the weights.

May import torch and the standard library only.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import mmap
import os

import torch

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
HUGE_PAGE = 2 * 1024 * 1024


def keep_freed_memory_mapped() -> bool:
    """Ask glibc to keep freed large blocks instead of returning them to the OS.

    Every step allocates the same large temporaries (gathered K/V, activations); with glibc's defaults each one
    is a fresh mmap whose pages fault in on first touch, which made a 37 MB gather 3x slower than the copy
    itself. Process-wide and idempotent; a no-op where glibc is absent.
    """
    name = ctypes.util.find_library("c")
    if os.name != "posix" or not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 1 << 31))
    except (OSError, AttributeError):
        return False


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, bool]:
    """(a zero-filled CPU tensor, whether the OS was asked to back it with transparent huge pages).

    The memory is a fresh private anonymous mapping, its start aligned to 2 MB and advised MADV_HUGEPAGE before any
    page is touched; then it is zeroed, so the pages fault in now (2 MB at a time where the kernel's THP mode is
    `always` or `madvise`), not during the first steps that write the cache (those steps took 0.4-0.9 s longer on
    W when they did). Where the advice is unavailable (not Linux, THP off) the tensor is the same, in ordinary
    pages. The tensor keeps its mapping alive; the mapping is unmapped when the tensor is freed."""
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype), False
    buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # shared memory gets no THP
    start = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    offset = -start % HUGE_PAGE
    advised = False
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buf.madvise(mmap.MADV_HUGEPAGE, offset, nbytes)
            advised = True
        except OSError:
            advised = False
    flat = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=offset)
    flat.zero_()  # fault every page in now, as torch.zeros would: not on the first steps that write the cache
    return flat.view(dtype).view(shape), advised
