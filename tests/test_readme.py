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
    assert "input 'x' of SinBackward0, is at version 1; expected version 0" in r.stderr
    assert f"It was modified by add_ at {script}:10 (version 1)" in r.stderr


MAIN_JOB = (
    "pip install -e . && python scripts/compare_inplace.py --config configs/quickstart_inplace.yaml "
    "--policies off,auto,on+abn"
)


@pytest.mark.parametrize("command", [MAIN_JOB, 'pip install -e ".[test,mpi,oracle,nvrtc]" && python -m pytest -n auto'])
def test_readme_and_ci_commands(command):
    assert command in _readme()
    with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as f:
        ci = f.read()
    if "pytest" in command:
        assert command in ci, ".ci/run must run the README's test command"


def test_the_main_job_is_the_first_command_and_the_front_page_is_short():
    text = _readme()
    first = re.search(r"```bash\n(.*?)\n```", text, re.S).group(1)
    assert first == MAIN_JOB
    assert len(text.splitlines()) <= 150


def test_the_main_job_shows_the_saving_the_readme_claims(tmp_path):
    """The README's table comes from the main job: its peaks (which do not depend on the
    machine's load) are what a short run of the same config measures, in a fresh process
    as the reader's (arrays another test left alive would count in this one's peak)."""
    shown = {}
    for line in _readme().splitlines():
        m = re.match(r"(off|auto|on\+abn) +([0-9.]+) +([0-9.]+) +([0-9.]+) +([0-9.]+)%", line)
        if m:
            shown[m.group(1)] = (float(m.group(2)), float(m.group(3)))
    assert set(shown) == {"off", "auto", "on+abn"}
    assert shown["on+abn"][0] <= 0.7 * shown["off"][0]  # the best policy saves >= 30% of off's peak
    for policy, norm in (("off", "bn"), ("on", "inplace_abn")):
        overrides = [
            f"inplace={policy}",
            f"model.args.norm={norm}",
            "train.max_steps=3",
            "train.log_every=1",
            "logging.progress=false",
            "logging.timeline=false",
            f"logging.logdir={tmp_path / 'runs'}",
            f"checkpoint.dir={tmp_path / 'ckpt'}",
        ]
        code = (
            "import sys; from trainers.config import load_config; from trainers.trainer import Trainer; "
            "r = Trainer(load_config(sys.argv[1], sys.argv[2:])).fit(); print(r.peak_mb, r.floor_mb)"
        )
        config = os.path.join(ROOT, "configs", "quickstart_inplace.yaml")
        out = subprocess.run(
            [sys.executable, "-c", code, config, *overrides], capture_output=True, text=True, cwd=ROOT, check=True
        ).stdout
        peak, floor = map(float, out.split()[-2:])
        name = "off" if policy == "off" else "on+abn"
        assert (round(peak, 1), round(floor, 1)) == shown[name], name
