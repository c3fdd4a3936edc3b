"""The command-line entry points as a user runs them: exit codes, one-line errors, outputs."""

import os
import re
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
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=timeout,
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
    assert os.path.isfile(tmp_path / "checkpoints" / "cli" / "inplace-auto_np1" / "step_00000004.npz")
    assert "final loss: train/loss's last point" in r.stdout  # the table's legend


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
        (["--set", "precision=fp8"], ["precision", "fp32, bf16, fp16"]),
        (
            ["--set", "precision=bf16", "--set", "compile=true"],
            ["precision: bf16 cannot run compiled", "compile: false"],
        ),
        (["--set", "distributed.zero=1"], ["distributed.zero: 1", "this run has one", "mpiexec -n N"]),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, fragments):
    base = [] if "--config" in args else ["--config", config(tmp_path)]
    assert_one_line_error(run(tmp_path, "train.py", *base, *args), 2, *fragments)


def test_bad_yaml_names_the_line(tmp_path):
    path = config(tmp_path, "data:\n  name: digits\n  batch_size: [\n", "bad.yaml")
    assert_one_line_error(run(tmp_path, "train.py", "--config", path), 2, "bad.yaml", "line")


def test_unknown_model_and_model_argument_exit_2_with_a_suggestion(tmp_path):
    r = run(tmp_path, "train.py", "--config", config(tmp_path), "--set", "model.name=mpl")
    assert_one_line_error(r, 2, "model.name", "mpl", "Did you mean 'mlp'")
    r = run(tmp_path, "train.py", "--config", config(tmp_path), "--set", "model.args.hiden=[4]")
    assert_one_line_error(r, 2, "model.args", "hiden", "hidden")


def test_diverging_run_stops_with_the_step_and_exit_3(tmp_path):
    r = run(
        tmp_path,
        "train.py",
        "--config",
        config(tmp_path),
        "--set",
        "optim.lr=1e12",
        "--set",
        "train.epochs=3",
        "--set",
        "train.max_steps=60",
    )
    assert_one_line_error(r, 3, "loss is", "at step", "optim.lr")
    assert "RuntimeWarning" not in r.stderr


def test_compare_inplace_runs_each_policy_into_one_experiment(tmp_path):
    r = run(
        tmp_path,
        "compare_inplace.py",
        "--config",
        config(tmp_path),
        "--policies",
        "off,on,auto",
        "--set",
        "logging.timeline=true",
        "--set",
        "logging.progress=true",
        "--rounds",
        "3",
        "--round-steps",
        "2",
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    header = next(line for line in lines if line.startswith("policy"))
    for column in (
        "peak MB",
        "floor MB",
        "saved MB",
        "saved %",
        "samples/s",
        "spread %",
        "vs off",
        "auto ops/step",
        "auto MB/step",
        "final loss",
        "eval accuracy",
    ):
        assert column in header
    rows = {line.split()[0]: line for line in lines[lines.index(header) + 2 :][:3]}
    assert set(rows) == {"off", "on", "auto"}
    # The legend follows the rows: what saved is measured against, what auto counts, which loss.
    legend = lines[lines.index(header) + 5 :]
    assert any(line.startswith("saved MB, saved %: peak MB below off's") for line in legend)
    assert any(line.startswith("samples/s: median of 3 rounds of 2 training steps") for line in legend)
    assert any(line.startswith("auto ops/step, auto MB/step: ") for line in legend)
    assert any(line.startswith("final loss: train/loss's last point") for line in legend)
    assert "#custom_scalars" in lines[-1]
    experiment = tmp_path / "runs" / "cli"
    assert sorted(os.listdir(experiment)) == ["compare.png", "inplace-auto_np1", "inplace-off_np1", "inplace-on_np1"]
    # Each progress display names its policy (not a terminal here: one line per run at the end).
    progress = [line.split()[0] for line in r.stderr.splitlines() if "/4" in line and "loss=" in line]
    assert progress == ["off", "on", "auto"]


def test_compare_prints_only_the_columns_of_the_policies_it_ran(tmp_path):
    r = run(
        tmp_path,
        "compare_inplace.py",
        "--config",
        config(tmp_path),
        "--policies",
        "off,on+abn",
        "--set",
        "logging.run_name=fixed",
        "--rounds",
        "2",
        "--round-steps",
        "1",
    )
    assert r.returncode == 0, r.stderr
    header = next(line for line in r.stdout.splitlines() if line.startswith("policy"))
    assert "auto" not in header and "vs off" in header
    assert sorted(os.listdir(tmp_path / "runs" / "cli")) == [
        "compare.png",
        "inplace-off_np1",
        "inplace-on_np1_inplace_abn",
    ]


def test_compare_rejects_unknown_policy(tmp_path):
    r = run(tmp_path, "compare_inplace.py", "--config", config(tmp_path), "--policies", "off,sideways")
    assert_one_line_error(r, 2, "sideways", "on+abn")


@pytest.mark.parametrize(
    "override, fragments",
    [
        ("model.args.hidden=foo", ["model.args", "hidden", "'foo'"]),
        ("model.args.hidden=[8, 0]", ["model.args", "hidden", "[8, 0]"]),
        ("model.args.activation=relux", ["model.args", "activation", "relux"]),
        ("model.args.in_features=32", ["does not fit data 'digits'", "in_features=32"]),
        ("model.args.num_classes=5", ["num_classes", "(10,)"]),
    ],
)
def test_bad_model_arguments_are_bad_input_naming_the_argument(tmp_path, override, fragments):
    r = run(tmp_path, "train.py", "--config", config(tmp_path), "--set", override)
    assert_one_line_error(r, 2, *fragments)
    assert "got 'f'" not in r.stderr


def test_naming_another_model_does_not_hand_it_the_first_models_arguments(tmp_path):
    # The config's model.args ({hidden: [8]}) belong to the MLP: --set model.name=convnet
    # replaces them (the conv net's defaults fit the 8x8 digits) instead of merging them in.
    r = run(tmp_path, "train.py", "--config", config(tmp_path), "--set", "model.name=convnet")
    assert r.returncode == 0, r.stderr


def write_evil_pickle(path, marker):
    import pickle

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    path.write_bytes(pickle.dumps({"step": 1, "model": Evil()}))


def test_resume_refuses_a_crafted_pickle_and_runs_nothing(tmp_path):
    marker = tmp_path / "code_ran"
    evil = tmp_path / "step_00000001.ckpt"
    write_evil_pickle(evil, marker)
    r = run(tmp_path, "train.py", "--config", config(tmp_path), "--resume", str(evil))
    assert_one_line_error(r, 2, "pickle", "not read", "--trust-pickle")
    assert not marker.exists()
    assert not os.path.exists(tmp_path / "runs")  # nothing was trained or logged


def test_resume_refuses_truncated_and_corrupted_checkpoints(tmp_path):
    assert run(tmp_path, "train.py", "--config", config(tmp_path)).returncode == 0
    (good,) = (tmp_path / "checkpoints" / "cli").glob("*/step_00000004.npz")
    data = good.read_bytes()
    cut = tmp_path / "cut.npz"
    cut.write_bytes(data[: len(data) // 3])
    r = run(tmp_path, "train.py", "--config", config(tmp_path), "--resume", str(cut))
    assert_one_line_error(r, 2, "cut.npz", "truncated or corrupted")
    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(b"PK\x03\x04" + bytes(range(256)) * 4)
    r = run(tmp_path, "train.py", "--config", config(tmp_path), "--resume", str(garbage))
    assert_one_line_error(r, 2, "garbage.npz")


def test_resuming_a_finished_run_says_so_and_changes_nothing(tmp_path):
    assert run(tmp_path, "train.py", "--config", config(tmp_path)).returncode == 0

    def snapshot():
        files = {}
        for root in ("runs", "checkpoints"):
            for folder, _, names in os.walk(tmp_path / root):
                for name in names:
                    path = os.path.join(folder, name)
                    with open(path, "rb") as f:
                        files[path] = (f.read(), os.stat(path).st_mtime_ns)
        return files

    before = snapshot()
    r = run(tmp_path, "train.py", "--config", config(tmp_path), "--resume")
    assert r.returncode == 0, r.stderr
    assert "already finished" in r.stdout and "step 4 of 4" in r.stdout
    assert "nan" not in r.stdout
    assert snapshot() == before


def test_a_bad_override_names_the_value_of_the_config_in_use(tmp_path):
    path = config(tmp_path, TINY.replace("batch_size: 64", "batch_size: 32"))
    r = run(tmp_path, "train.py", "--config", path, "--set", "data.batch_size=abc")
    assert_one_line_error(r, 2, "data.batch_size must be an int", "the config in use has 32")


def test_resume_with_nothing_to_resume_says_so_and_writes_nothing(tmp_path):
    r = run(tmp_path, "train.py", "--config", config(tmp_path), "--resume")
    assert_one_line_error(r, 2, "--resume: no checkpoint of run inplace-auto_np1 in checkpoints/cli/inplace-auto_np1")
    assert not os.path.exists(tmp_path / "runs") and not os.path.exists(tmp_path / "checkpoints")
    # checkpoint.resume: auto is for job scripts that run the same command again: it starts, and says so.
    r = run(tmp_path, "train.py", "--config", config(tmp_path), "--set", "checkpoint.resume=auto")
    assert r.returncode == 0, r.stderr
    assert "checkpoint.resume: no checkpoint in checkpoints/cli/inplace-auto_np1 yet; training from step 0" in r.stdout
    r = run(tmp_path, "train.py", "--config", config(tmp_path), "--set", "train.max_steps=6", "--resume")
    assert r.returncode == 0, r.stderr
    assert "resumed from step 4 (checkpoints/cli/inplace-auto_np1/step_00000004.npz)" in r.stdout


def test_the_progress_line_and_the_summary_table_show_the_same_peak(tmp_path):
    # The quickstart's first window has the highest peak (1.4 MB against 1.3 later).
    quickstart = os.path.join(ROOT, "configs", "quickstart.yaml")
    r = run(tmp_path, "train.py", "--config", quickstart, "--set", "train.max_steps=4", "--set", "train.log_every=2")
    assert r.returncode == 0, r.stderr
    last = [line for line in r.stderr.splitlines() if line.startswith("train  4/4")][-1]
    shown = last.split("peak_mb=")[1].split()[0]
    lines = r.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("run"))
    row = dict(zip(re.split(r"\s{2,}", lines[header]), re.split(r"\s{2,}", lines[header + 2])))
    assert row["peak MB"] == shown  # one source, one rounding
    assert float(shown) > 0
