"""The README's promises that can be checked without running the long jobs."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _readme():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        return f.read()


def test_config_reference_matches_schema():
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "gen_config_reference.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr


def test_python_example_runs_and_fails_where_it_says(tmp_path):
    block = re.search(r"```python\n(import framework as fw.*?)```", _readme(), re.S).group(1)
    script = tmp_path / "example.py"
    script.write_text(block)
    r = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}
    )
    # The first half must succeed, the last line must raise the documented error.
    assert r.returncode == 1
    assert "RuntimeError: one of the variables needed for gradient computation" in r.stderr
    assert "input 'x' of SinBackward, is at version 1; expected version 0" in r.stderr
    assert f"It was modified by add_ at {script}:10 (version 1)" in r.stderr


@pytest.mark.parametrize(
    "command",
    [
        "pip install -e . && python scripts/train.py --config configs/quickstart.yaml",
        'pip install -e ".[test,mpi]" && python -m pytest',
    ],
)
def test_readme_and_ci_commands(command):
    assert command in _readme()
    with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as f:
        ci = f.read()
    if "pytest" in command:
        assert command in ci, ".ci/run must run the README's test command"
