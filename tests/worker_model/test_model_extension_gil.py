"""The extension's functions run without Python's GIL (`kernels.MODULE_DEF`): while the engine thread is inside a
kernel, the worker's other threads (the HTTP server's event loop, the tokenizer's) keep running Python."""

from __future__ import annotations

import sys
import threading
import time

import torch
from worker.model.kernels import FUNCTIONS, MODULE_DEF
from worker.model.linear import pack_panels


def test_every_function_is_bound_without_the_gil():
    for name in FUNCTIONS:
        assert f'm.def("{name}", torch::wrap_pybind_function_no_gil({name}), "{name}");' in MODULE_DEF
    assert MODULE_DEF.count("m.def(") == len(FUNCTIONS) == len(set(FUNCTIONS))


def test_python_threads_run_while_a_kernel_does(panels):
    """A ~0.1-1 s panel linear on a helper thread; this thread counts its loop turns strictly inside the call's
    span (a margin of several switch intervals on each side). Holding the GIL, the call would leave it none."""
    cols = panels.f32_panel_cols()
    weight = torch.randn(cols * 256, 1024)
    packed = pack_panels(weight, cols)
    x = torch.randn(1024, 1024)
    span: list[float] = []

    def kernel() -> None:
        span.append(time.perf_counter())
        panels.panel_linear_f32(x, packed, weight.shape[0], None)
        span.append(time.perf_counter())

    before = sys.getswitchinterval()
    sys.setswitchinterval(0.001)
    try:
        helper = threading.Thread(target=kernel)
        turns: list[float] = []
        helper.start()
        while helper.is_alive():
            turns.append(time.perf_counter())
        helper.join()
    finally:
        sys.setswitchinterval(before)
    start, end = span
    margin = 0.02
    assert end - start > 4 * margin, "the kernel ran too briefly to tell"
    inside = [t for t in turns if start + margin < t < end - margin]
    assert len(inside) > 100
