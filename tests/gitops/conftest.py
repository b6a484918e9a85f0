"""Gives tests/gitops tests the kstatus port, the Argo CD Lua runner and the captured fixtures (`gitops`)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest


@pytest.fixture(scope="session")
def gitops() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gitops_health", Path(__file__).with_name("health.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
