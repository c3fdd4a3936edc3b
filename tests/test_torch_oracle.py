"""The PyTorch oracle cannot be skipped in CI: one mechanism (tests/conftest.py's
``require_torch`` and the ``torch`` fixture) decides, and every comparison goes through it."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests import conftest

ROOT = Path(__file__).resolve().parents[1]


def _without_torch(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError


def test_a_missing_torch_fails_under_ci(monkeypatch):
    _without_torch(monkeypatch)
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true and the PyTorch oracle cannot run"):
        conftest.require_torch()


def test_a_missing_torch_skips_outside_ci(monkeypatch):
    _without_torch(monkeypatch)
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="PyTorch is not installed"):
        conftest.require_torch()


def test_another_torch_version_fails_under_ci(monkeypatch):
    fake = type(sys)("torch")
    fake.__version__ = "2.5.1+cpu"
    monkeypatch.setitem(sys.modules, "torch", fake)
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="PyTorch 2.5.1"):
        conftest.require_torch()


def test_the_oracle_version_is_the_extras():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'oracle = ["torch=={conftest.TORCH_ORACLE_VERSION}"]' in pyproject


def test_every_comparison_with_pytorch_takes_the_fixture():
    """No test imports torch on its own (an importorskip would skip in silence in CI)."""
    offenders = []
    for path in (ROOT / "tests").rglob("*.py"):
        text = path.read_text()
        if re.search(r"importorskip\(\s*[\"']torch[\"']", text) and path.name != Path(__file__).name:
            offenders.append(str(path.relative_to(ROOT)))
    assert not offenders, offenders


def test_the_fixture_marks_the_test(request, torch):
    assert request.node.get_closest_marker("torch_oracle") is not None
    assert torch.__version__.split("+")[0] == conftest.TORCH_ORACLE_VERSION
