"""The command-line entry points as a user runs them: exit codes, one-line errors, outputs."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TINY = """\
experiment: cli
threads: 1
data: {name: digits, batch_size: 64}
model: {name: mlp, args: {hidden: [8]}}
train: {max_steps: 4, eval_every: 2, log_every: 2}
logging: {progress: false, timeline: false}
"""


def run(tmp_path, script, *args, timeout=240):
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", script), *args],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=timeout,
    )


def config(tmp_path, text=TINY, name="c.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def assert_one_line_error(r, code, *fragments):
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, r.stderr
    for fragment in fragments:
        assert fragment in errors[0], errors[0]


def test_train_succeeds_and_prints_the_summary(tmp_path):
    r = run(tmp_path, "train.py", "--config", config(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "inplace-auto_np1" in r.stdout and "peak MB" in r.stdout and "floor MB" in r.stdout
    assert os.path.isdir(tmp_path / "runs" / "cli" / "inplace-auto_np1")
    assert os.path.isfile(tmp_path / "checkpoints" / "cli" / "inplace-auto_np1" / "step_00000004.ckpt")


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["--config", "missing.yaml"], ["missing.yaml"]),
        (["--set", "optim.lrr=0.1"], ["optim.lrr", "did you mean 'optim.lr'"]),
        (["--set", "optim.lr=abc"], ["optim.lr", "float"]),
        (["--set", "inplace=sometimes"], ["inplace", "on", "off"]),
        (["--set", "data.batch_size=0"], ["data.batch_size"]),
        (["--set", "nonsense"], ["nonsense", "="]),
        (["--resume", "nowhere.ckpt"], ["nowhere.ckpt", "does not exist"]),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, fragments):
    base = [] if "--config" in args else ["--config", config(tmp_path)]
    assert_one_line_error(run(tmp_path, "train.py", *base, *args), 2, *fragments)


def test_bad_yaml_names_the_line(tmp_path):
    path = config(tmp_path, "data:\n  name: digits\n  batch_size: [\n", "bad.yaml")
    assert_one_line_error(run(tmp_path, "train.py", "--config", path), 2, "bad.yaml", "line")


def test_unknown_model_and_model_argument_exit_3_with_a_suggestion(tmp_path):
    r = run(tmp_path, "train.py", "--config", config(tmp_path), "--set", "model.name=mpl")
    assert_one_line_error(r, 3, "mpl", "Did you mean 'mlp'")
    r = run(tmp_path, "train.py", "--config", config(tmp_path), "--set", "model.args.hiden=[4]")
    assert_one_line_error(r, 3, "hiden", "hidden")


def test_diverging_run_stops_with_the_step_and_exit_3(tmp_path):
    r = run(tmp_path, "train.py", "--config", config(tmp_path), "--set", "optim.lr=1e12",
            "--set", "train.epochs=3", "--set", "train.max_steps=60")
    assert_one_line_error(r, 3, "loss is", "at step", "optim.lr")
    assert "RuntimeWarning" not in r.stderr


def test_compare_inplace_runs_each_policy_into_one_experiment(tmp_path):
    r = run(tmp_path, "compare_inplace.py", "--config", config(tmp_path), "--policies", "off,on,auto",
            "--set", "logging.timeline=true")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    header = next(line for line in lines if line.startswith("policy"))
    for column in ("peak MB", "floor MB", "saved MB", "saved %", "samples/s", "auto ops/step", "final loss",
                   "eval accuracy"):
        assert column in header
    assert any(line.startswith("off ") for line in lines) and any(line.startswith("on ") for line in lines)
    experiment = tmp_path / "runs" / "cli"
    assert any(line.startswith("auto ") for line in lines)
    assert sorted(os.listdir(experiment)) == ["compare.png", "inplace-auto_np1", "inplace-off_np1", "inplace-on_np1"]


def test_compare_rejects_unknown_policy(tmp_path):
    r = run(tmp_path, "compare_inplace.py", "--config", config(tmp_path), "--policies", "off,sideways")
    assert_one_line_error(r, 2, "sideways", "on+abn")
