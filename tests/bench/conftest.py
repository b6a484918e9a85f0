"""The benchmarks' helpers are modules in bench/ (not a package): put bench/ on the path, as running
`python bench/SCRIPT.py` does, so their tests import them by name."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = str(Path(__file__).resolve().parents[2] / "bench")
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)
