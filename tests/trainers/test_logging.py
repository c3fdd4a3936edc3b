"""Tests for trainers.logging: run layout, TensorBoard events read back, progress, tables, plots."""

import io
import os
import struct
import subprocess
import sys
import types
import warnings

import pytest

from trainers.logging import (
    MB,
    Progress,
    RunLogger,
    default_run_name,
    format_summary,
    format_value,
    pareto_front,
    plot_comparison,
    plot_timeline,
    read_scalars,
    run_dir,
    timeline_positions,
)

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from tensorboard.plugins.hparams import plugin_data_pb2  # noqa: E402

TAGS = (
    "train/loss",
    "train/accuracy",
    "eval/accuracy",
    "perf/samples_per_sec",
    "perf/step_ms",
    "memory/peak_mb",
    "memory/allocated_mb",
    "memory/floor_mb",
)


def f32(x):
    """The value TensorBoard stores for x (scalars are float32 on disk)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def metrics_at(step, policy_offset=0.0):
    return {tag: 1.0 / (step + 3) + i * 10.5 + policy_offset for i, tag in enumerate(TAGS)}


def synthetic_timeline():
    # forward allocates activations, backward frees some and adds gradients, optimizer
    # adds state: a peak at the forward/backward boundary.
    events, alloc, t = [(0.0, 4 * MB, 0, "other", "")], 4 * MB, 0.0
    for phase, deltas in (("forward", [3, 3, 2]), ("backward", [-2, 4, -3]), ("optimizer", [1, -1])):
        for d in deltas:
            t += 0.001
            alloc += d * MB
            events.append((t, alloc, d * MB, "activations", phase))
    marks = [(0.0005, "forward"), (0.0035, "backward"), (0.0065, "optimizer")]
    return {"events": events, "marks": marks}


def accumulator(path):
    acc = EventAccumulator(path, size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    acc.Reload()
    return acc


def event_files(path):
    return [f for f in os.listdir(path) if ".out.tfevents." in f]


# ------------------------------------------------------------------------ layout


def test_module_imports_no_framework_and_defers_heavy_imports():
    import trainers.logging

    package = os.path.dirname(trainers.logging.__file__)
    modules = sorted(f for f in os.listdir(package) if f.endswith(".py"))
    assert modules == ["__init__.py", "events.py", "plots.py", "progress.py", "tables.py"]
    for name in modules:
        with open(os.path.join(package, name), encoding="utf-8") as f:
            code = f.read()
        for banned in ("import framework", "from framework", "import models", "from models", "sys.modules"):
            assert banned not in code, (name, banned)
    probe = (
        "import sys, trainers.logging; "
        "print(sorted(m for m in ('framework', 'tensorboardX', 'matplotlib', 'tqdm', "
        "'tensorboard') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        check=True,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )
    assert out.stdout.strip() == "[]"


def test_run_names_and_layout(tmp_path):
    assert default_run_name("on", 1) == "inplace-on_np1"
    assert default_run_name("off", 2) == "inplace-off_np2"
    assert default_run_name("on", 1, "inplace_abn") == "inplace-on_np1_inplace_abn"
    assert default_run_name("on", 2, None, "compiled") == "inplace-on_np2_compiled"
    assert default_run_name("off", 1, "inplace_abn", "compiled") == "inplace-off_np1_inplace_abn_compiled"
    assert run_dir(tmp_path, "mlp", "inplace-on_np1") == os.path.join(str(tmp_path), "mlp", "inplace-on_np1")
    for bad in ("", "..", "a/b"):
        with pytest.raises(ValueError, match="directory name"):
            run_dir(tmp_path, bad, "inplace-on_np1")
    with pytest.raises(ValueError, match="directory name"):
        default_run_name("on", 1, "x/y")
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="world_size"):
            default_run_name("on", bad)


# ------------------------------------------------------------------------ a full run


def write_run(path, policy):
    offset = 0.0 if policy == "on" else 100.0
    with RunLogger(path) as log:
        log.config_text(f"inplace: {policy}\noptim:\n  lr: 0.1\n")
        for step in range(0, 50, 10):
            log.scalars(step, metrics_at(step, offset))
        log.timeline_figure(40, synthetic_timeline(), floor_bytes=6 * MB)
        log.hparams(
            {"inplace": policy, "lr": 0.1, "batch_size": 32, "bn": True, "layers": [64, 32], "note": None},
            {"hparam/peak_mb": 12.0 + offset, "memory/peak_mb": 999.0},
        )


def test_full_run_reads_back_exactly(tmp_path):
    exp = tmp_path / "mlp"
    on, off = run_dir(tmp_path, "mlp", default_run_name("on", 1)), run_dir(tmp_path, "mlp", default_run_name("off", 1))
    with pytest.warns(RuntimeWarning, match="differs from the last value"):
        write_run(on, "on")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        write_run(off, "off")

    # Exactly two runs, no hparams sub-run, one event file per run.
    assert sorted(os.listdir(exp)) == ["inplace-off_np1", "inplace-on_np1"]
    for path in (on, off):
        names = os.listdir(path)
        assert not [n for n in names if os.path.isdir(os.path.join(path, n))]
        assert len(event_files(path)) == 1
        assert {"config.yaml", "timeline.png"} <= set(names)
        with open(os.path.join(path, "timeline.png"), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"

    for path, policy, offset in ((on, "on", 0.0), (off, "off", 100.0)):
        expected = {tag: [(s, f32(metrics_at(s, offset)[tag])) for s in range(0, 50, 10)] for tag in TAGS}
        # The hparams metric not logged by scalars() becomes a scalar at the last step;
        # memory/peak_mb keeps its own series (no extra point).
        expected["hparam/peak_mb"] = [(40, f32(12.0 + offset))]
        assert read_scalars(path) == dict(sorted(expected.items()))

        acc = accumulator(path)
        assert acc.Tags()["images"] == ["memory/timeline"]
        image = acc.Images("memory/timeline")[0]
        assert image.step == 40 and image.encoded_image_string.startswith(b"\x89PNG")
        assert (image.width, image.height) == (480, 320)  # about TensorBoard's card width: legible there
        text = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
        assert text == f"```yaml\ninplace: {policy}\noptim:\n  lr: 0.1\n```"
        with open(os.path.join(path, "config.yaml")) as f:
            assert f.read() == f"inplace: {policy}\noptim:\n  lr: 0.1\n"

        content = acc.PluginTagToContent("hparams")
        assert set(content) == {"_hparams_/experiment", "_hparams_/session_start_info", "_hparams_/session_end_info"}
        start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"]).session_start_info
        hp = {k: getattr(v, v.WhichOneof("kind")) for k, v in start.hparams.items()}
        assert hp == {
            "inplace": policy,
            "lr": 0.1,
            "batch_size": 32.0,
            "bn": True,
            "layers": "[64, 32]",
            "note": "None",
        }
        experiment = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
        assert [m.name.tag for m in experiment.metric_infos] == ["hparam/peak_mb", "memory/peak_mb"]


def test_flush_makes_events_readable_while_open(tmp_path):
    path = str(tmp_path / "run")
    log = RunLogger(path, flush_secs=3600)
    for step in range(20):
        log.scalars(step, {"train/loss": float(step)})
    log.flush()
    assert read_scalars(path) == {"train/loss": [(s, float(s)) for s in range(20)]}
    log.close()
    log.close()  # idempotent
    log.scalars(20, {"train/loss": 1.0})  # after close: a no-op, not an error


def test_flush_writes_every_event_so_far_and_logging_goes_on(tmp_path):
    # A run killed right after flush() keeps every point: the trainer flushes before
    # each checkpoint. (tensorboardX's FileWriter.flush() leaves queued events behind.)
    path = str(tmp_path / "run")
    log = RunLogger(path, flush_secs=3600)
    for step in range(300):
        log.scalars(step, {"train/loss": float(step), "memory/peak_mb": 1.0})
    log.flush()
    assert [s for s, _ in read_scalars(path)["train/loss"]] == list(range(300))
    log.scalars(300, {"train/loss": 3.0})
    log.close()
    assert read_scalars(path)["train/loss"][-1] == (300, 3.0)
    assert len(event_files(path)) == 1


def test_the_logger_starts_no_thread(tmp_path):
    # Events are written in the caller's thread: no writer thread competes with the
    # training loop for the GIL (benchmarks/bench_logging.py measures what that costs).
    import threading

    before = threading.active_count()
    with RunLogger(str(tmp_path / "run")) as log:
        log.scalars(0, {"train/loss": 1.0})
        assert threading.active_count() == before


def test_disabled_logger_creates_nothing(tmp_path):
    path = tmp_path / "exp" / "run"
    with RunLogger(path, enabled=False) as log:
        log.scalars(0, {"train/loss": 1.0})
        log.config_text("a: 1\n")
        assert log.timeline_figure(0, synthetic_timeline()) is None
        log.hparams({"lr": 0.1}, {"hparam/loss": 1.0})
        log.flush()
    assert list(tmp_path.iterdir()) == []


def test_non_finite_values_are_skipped_with_one_warning(tmp_path):
    path = str(tmp_path / "run")
    with pytest.warns(RuntimeWarning, match="non-finite") as record:
        with RunLogger(path) as log:
            log.scalars(0, {"train/loss": float("nan"), "perf/step_ms": 2.5})
            log.scalars(1, {"train/loss": float("inf"), "perf/step_ms": -float("inf")})
            log.scalars(2, {"train/loss": 0.5})
    assert sum("non-finite" in str(w.message) for w in record) == 1
    assert read_scalars(path) == {"perf/step_ms": [(0, 2.5)], "train/loss": [(2, 0.5)]}
    with RunLogger(str(tmp_path / "run2")) as log, pytest.raises(TypeError, match="train/loss"):
        log.scalars(0, {"train/loss": "low"})


def test_resume_with_purge_step_hides_later_points(tmp_path):
    path = str(tmp_path / "run")
    with RunLogger(path) as log:
        for step in range(10):
            log.scalars(step, {"train/loss": float(step)})
    with pytest.warns(RuntimeWarning, match="earlier run"):
        RunLogger(path).close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # purge_step: a resume, no warning
        with RunLogger(path, purge_step=5) as log:
            for step in range(5, 8):
                log.scalars(step, {"train/loss": step + 0.5})
    assert read_scalars(path)["train/loss"] == ([(s, float(s)) for s in range(5)] + [(s, s + 0.5) for s in range(5, 8)])


# ------------------------------------------------------------------------ timeline figure


def test_timeline_figure_from_object_and_empty(tmp_path):
    import matplotlib

    backend = matplotlib.get_backend()
    tl = types.SimpleNamespace(**synthetic_timeline())
    with RunLogger(str(tmp_path / "a")) as log:
        assert log.timeline_figure(3, tl).endswith("timeline.png")
        log.timeline_figure(4, {"events": [], "marks": []})
    assert matplotlib.get_backend() == backend
    assert [e.step for e in accumulator(str(tmp_path / "a")).Images("memory/timeline")] == [3, 4]


def test_timeline_figure_from_framework_record_timeline(tmp_path):
    np = pytest.importorskip("numpy")
    memory = pytest.importorskip("framework.memory")
    with memory.record_timeline() as tl:
        memory.mark("forward")
        a = memory.zeros((256, 256), np.float32, category="activations")
        memory.mark("backward")
        b = memory.zeros((128, 256), np.float32, category="gradients")
        del a
        memory.mark("optimizer")
        del b
    with RunLogger(str(tmp_path / "r")) as log:
        log.timeline_figure(0, tl, floor_bytes=tl.peak // 2)
    assert os.path.getsize(tmp_path / "r" / "timeline.png") > 1000


def test_timeline_positions_do_not_depend_on_time():
    tl = synthetic_timeline()
    x, mb, phases = timeline_positions(tl)
    assert phases == ["forward", "backward", "optimizer"]
    # The baseline counts as the first phase's; each phase spreads its events over one unit.
    assert x == [0.0, 0.25, 0.5, 0.75, 1.0, 1 + 1 / 3, 1 + 2 / 3, 2.0, 2.5]
    assert mb == [e[1] / MB for e in tl["events"]]
    slow = {
        "events": [(t * 2.7 + (0.01 if i % 2 else 0.0), *rest) for i, (t, *rest) in enumerate(tl["events"])],
        "marks": [(t * 2.7, p) for t, p in tl["marks"]],
    }
    assert timeline_positions(slow) == (x, mb, phases)  # a slower step draws the same curve
    assert timeline_positions({"events": [], "marks": []}) == ([], [], [""])


def test_timeline_figure_is_drawn_against_the_position_in_the_step():
    fig = plot_timeline(synthetic_timeline(), floor_bytes=6 * MB)
    ax = fig.axes[0]
    assert ax.get_xlim() == (0.0, 3.0)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["forward", "backward", "optimizer"]
    assert "position in the step" in ax.get_xlabel()


def _points(ax):
    """The Pareto panel's points: ``(x, y)`` of each error bar's data line, in order."""
    return [(c.lines[0].get_xdata()[0], c.lines[0].get_ydata()[0]) for c in ax.containers]


def test_comparison_figure_labels_peak_and_floor_and_puts_each_policy_at_its_speed_and_peak():
    tl = synthetic_timeline()
    runs = [
        {"name": "off", "peak_mb": 12.0, "floor_mb": 11.9, "samples_per_sec": [100, 120, 90], "timeline": tl},
        {"name": "on", "peak_mb": 10.0, "floor_mb": 9.5, "samples_per_sec": [95, 130, 99], "timeline": tl},
    ]
    fig = plot_comparison(runs, title="t")
    memory_ax, pareto_ax, timeline_ax = fig.axes
    labels = [t.get_text() for t in memory_ax.texts]
    assert labels == ["12.0", "10.0", "11.9", "9.5"]  # every bar labelled: a floor next to its peak
    floors = [p for p in memory_ax.patches if p.get_hatch()]
    assert [round(p.get_height(), 1) for p in floors] == [11.9, 9.5]
    # a point per policy at (median samples/s, peak MB), a bar over its rounds' range, its name beside
    assert _points(pareto_ax) == [(100, 12.0), (99, 10.0)]
    ranges = [c.lines[2][0].get_segments()[0] for c in pareto_ax.containers]
    assert [(seg[0][0], seg[1][0]) for seg in ranges] == [(90, 120), (95, 130)]
    assert [t.get_text() for t in pareto_ax.texts] == ["off", "on"]
    assert "peak" in pareto_ax.get_ylabel() and "samples / s" in pareto_ax.get_xlabel()
    # neither beats the other on both (off faster, on lower): both on the front, joined
    front = [line for line in pareto_ax.lines if line.get_linestyle() == ":"]
    assert len(front) == 1 and list(front[0].get_xdata()) == [99, 100]
    assert len(timeline_ax.lines) == 2 and timeline_ax.get_xlim() == (0.0, 3.0)
    fig.savefig(io.BytesIO(), format="png")


def test_the_pareto_front_keeps_the_variants_none_beats_on_both():
    # (samples/s, peak MB): the second is slower AND higher than the first; the last two tie
    points = [(100.0, 10.0), (90.0, 12.0), (120.0, 14.0), (80.0, 6.0), (80.0, 6.0)]
    assert pareto_front(points) == [3, 4, 0, 2]
    assert pareto_front([(1.0, 1.0)]) == [0] and pareto_front([]) == []


def test_comparison_figure_gives_each_policy_its_own_look_and_room_around_its_points():
    from matplotlib.colors import to_hex

    tl = synthetic_timeline()
    names = ["off", "auto", "on", "on+abn", "compiled", "mystery"]
    runs = [
        {"name": n, "peak_mb": 10.0 - i, "floor_mb": 9.0 - i, "samples_per_sec": [100 + i, 140], "timeline": tl}
        for i, n in enumerate(names)
    ]
    fig = plot_comparison(runs)
    memory_ax, speed_ax, timeline_ax = fig.axes
    # Equal timelines (off and auto compute the same) stay visible: each its colour, dashes and marker.
    looks = [(to_hex(line.get_color()), line.get_linestyle(), line.get_marker()) for line in timeline_ax.lines]
    assert len(looks) == len(names)
    for k in (0, 2):  # colours and markers: one per policy
        assert len({look[k] for look in looks}) == len(names), looks
    assert looks[0][1] != looks[1][1]  # off and auto: dashed over solid
    assert [t.get_text() for t in timeline_ax.get_legend().get_texts()] == names
    points = [c.lines[0] for c in speed_ax.containers]
    assert [to_hex(p.get_color()) for p in points] == [look[0] for look in looks]  # the same colour per policy
    assert [p.get_marker() for p in points] == [look[2] for look in looks]
    bars = [p for p in memory_ax.patches if not p.get_hatch()]
    assert [to_hex(b.get_facecolor()) for b in bars] == [look[0] for look in looks]
    # No point on the frame: the fastest round (140 samples/s) and the highest peak have room
    fig.canvas.draw()
    right, top = speed_ax.transData.transform((140, 10.0))
    assert speed_ax.bbox.x1 - right > 6 * fig.dpi / 72 and speed_ax.bbox.y1 - top > 6 * fig.dpi / 72
    assert speed_ax.get_ylim()[0] == 0 and speed_ax.get_xlim()[0] == 0


def test_the_timeline_image_reads_at_tensorboards_card_width_and_takes_a_shared_scale():
    fig = plot_timeline(synthetic_timeline(), floor_bytes=6 * MB, top_mb=40.0)
    width, height = fig.canvas.get_width_height()
    assert (width, height) == (480, 320)  # TensorBoard's image cards are 335 pixels or wider
    fig.canvas.draw()
    ax = fig.axes[0]
    texts = [ax.title, ax.xaxis.label, ax.yaxis.label, *ax.get_xticklabels(), *ax.get_yticklabels(), *ax.texts]
    assert min(t.get_fontsize() for t in texts if t.get_text()) >= 9
    assert ax.get_ylim()[1] >= 40.0  # the experiment's highest peak, not this one's
    own = plot_timeline(synthetic_timeline(), floor_bytes=6 * MB).axes[0]
    assert own.get_ylim()[1] < 40.0


def test_compare_logs_every_timeline_once_on_one_scale(tmp_path, monkeypatch):
    from scripts import compare_inplace
    from trainers.logging import events

    drawn = []
    real = events.plot_timeline
    monkeypatch.setattr(events, "plot_timeline", lambda *a, **k: drawn.append(k["top_mb"]) or real(*a, **k))
    tl = synthetic_timeline()
    small = {"events": [(t, b // 4, d, c, p) for t, b, d, c, p in tl["events"]], "marks": tl["marks"]}
    results = {
        name: types.SimpleNamespace(
            run_dir=str(tmp_path / name), timeline=timeline, timeline_step=2, timeline_floor_mb=1.0, peak_mb=99.0
        )
        for name, timeline in (("off", tl), ("on+abn", small))
    }
    compare_inplace.log_timelines(results)
    highest = max(e[1] for e in tl["events"]) / MB
    assert drawn == [highest, highest]
    compare_inplace.log_timelines(results)  # a --resume of the same comparison: nothing twice
    assert drawn == [highest, highest]
    for name in results:
        assert [e.step for e in accumulator(str(tmp_path / name)).Images("memory/timeline")] == [2]


# ------------------------------------------------------------------------ progress


def test_progress_disabled_is_a_no_op(capsys):
    bar = Progress(100, disable=True)
    assert bar.disabled
    for step in range(1, 31):
        bar.update(step, loss=1.0, samples_per_sec=10.0, peak_mb=3.0)
    bar.close()
    assert capsys.readouterr() == ("", "")


def test_progress_on_a_non_tty_stream():
    stream = io.StringIO()
    with Progress(25, log_every=10, file=stream, desc="train") as bar:
        assert not bar.disabled
        for step in range(1, 26):
            bar.update(step, loss=0.123456 + step, samples_per_sec=1234.56, peak_mb=12.345)
    out = stream.getvalue()
    final = out.rstrip("\n").split("\r")[-1]
    assert "25/25" in final
    assert "loss=25.12" in final and "samples/s=1234.6" in final and "peak_mb=12.3" in final
    # Not a terminal: redrawn at start and close only, not every log_every steps.
    assert out.count("\r") <= 3
    with pytest.raises(ValueError, match="log_every"):
        Progress(10, log_every=0, file=stream)


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_progress_prints_a_line_every_interval_when_not_a_terminal():
    # Under mpiexec rank 0 writes to a pipe: a redrawn bar would show nothing until the end.
    stream, clock = io.StringIO(), FakeClock()
    bar = Progress(1000, log_every=10, file=stream, desc="on+abn", interval=5.0, clock=clock)
    for step in range(10, 1001, 10):
        clock.now = step * 0.1  # 1 s per 10 steps
        bar.update(step, loss=1.0 / step, samples_per_sec=320.0, peak_mb=55.04)
    bar.close()
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue()
    assert [line.split()[1] for line in lines] == [f"{s}/1000" for s in range(50, 1001, 50)]
    assert lines[0] == "on+abn  50/1000  loss=0.02  samples/s=320.0  peak_mb=55.0"
    # A run that stops between lines still ends with its last state.
    stream, clock = io.StringIO(), FakeClock()
    with Progress(100, file=stream, interval=5.0, clock=clock) as bar:
        bar.update(30, loss=0.5)
    assert stream.getvalue().splitlines() == ["train  30/100  loss=0.5"]


def test_progress_counts_absolute_steps_when_called_on_logging_steps_only():
    stream = io.StringIO()
    bar = Progress(30, log_every=10, initial=5, file=stream)  # resumed at step 5
    for step in (10, 20, 30):
        bar.update(step, loss=float(step))
    assert bar.n == 30
    bar.close()
    assert "30/30" in stream.getvalue().split("\r")[-1]


# ------------------------------------------------------------------------ tables


def test_format_value_by_key():
    assert format_value("memory/peak_mb", 12.345) == "12.3"
    assert format_value("perf/samples_per_sec", 1234.56) == "1234.6"
    assert format_value("train/loss", 0.0123456) == "0.01235"
    assert format_value("eval/accuracy", 0.97312) == "97.31%"
    assert format_value("saving_pct", 23.456) == "23.5%"
    assert format_value("perf/step_ms", 1.2345) == "1.23"
    assert format_value("peak_floor_ratio", 1.5) == "1.50x"
    assert format_value("steps", 100) == "100"
    assert format_value("policy", "on") == "on"
    assert format_value("train/loss", None) == "-"
    assert format_value("train/loss", float("nan")) == "nan"


def test_format_summary_aligns_columns():
    rows = [
        {
            "run": "inplace-on_np1",
            "peak_mb": 12.345,
            "samples_per_sec": 1234.56,
            "loss": 0.0123456,
            "accuracy": 0.97312,
        },
        {"run": "inplace-off_np1", "peak_mb": 120.0, "samples_per_sec": 987.0, "loss": 0.5, "saving_pct": 9.5},
    ]
    columns = [
        ("run", "run"),
        ("peak_mb", "peak MB"),
        ("samples_per_sec", "samples/s"),
        ("loss", "loss"),
        ("accuracy", "acc"),
        ("saving_pct", "saved"),
    ]
    assert format_summary(rows, columns) == "\n".join(
        [
            "run              peak MB  samples/s     loss     acc  saved",
            "---------------  -------  ---------  -------  ------  -----",
            "inplace-on_np1      12.3     1234.6  0.01235  97.31%      -",
            "inplace-off_np1    120.0      987.0      0.5       -   9.5%",
        ]
    )
    assert format_summary([], [("run", "run")]) == "run\n---"


def test_format_summary_with_human_keys():
    rows = [
        {
            "policy": "on",
            "peak MB": 10.04,
            "saved %": 16.5,
            "samples/s": 812.25,
            "final loss": 0.31234,
            "eval accuracy": 0.9,
        },
        {
            "policy": "off",
            "peak MB": 12.0,
            "saved %": 0.0,
            "samples/s": 790.0,
            "final loss": 0.31229,
            "eval accuracy": None,
        },
    ]
    assert format_summary(rows, [(k, k) for k in rows[0]]).splitlines() == [
        "policy  peak MB  saved %  samples/s  final loss  eval accuracy",
        "------  -------  -------  ---------  ----------  -------------",
        "on         10.0    16.5%      812.2      0.3123         90.00%",
        "off        12.0     0.0%      790.0      0.3123              -",
    ]


def test_format_summary_ends_with_the_legend_of_the_columns_it_shows():
    rows = [{"policy": "on", "peak MB": 10.0, "saved %": 16.5}]
    legend = [("peak MB", "the step's peak"), ("saved MB, saved %", "against off"), ("auto MB/step", "not shown")]
    assert format_summary(rows, [(k, k) for k in rows[0]], legend).splitlines()[3:] == ["peak MB: the step's peak"]
    rows[0]["saved MB"] = 2.0
    assert format_summary(rows, [(k, k) for k in rows[0]], legend).splitlines()[3:] == [
        "peak MB: the step's peak",
        "saved MB, saved %: against off",
    ]


def test_layout_writes_the_custom_scalars_tab(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.custom_scalar import layout_pb2

    with RunLogger(tmp_path / "run") as log:
        log.layout({"memory": {"peak": [r"^memory/peak_mb$"], "floor": [r"^memory/floor_mb$"]}})
        log.scalars(1, {"memory/peak_mb": 1.0})
    acc = EventAccumulator(str(tmp_path / "run"), size_guidance={"tensors": 0})
    acc.Reload()
    (event,) = acc.Tensors("custom_scalars__config__")
    layout = layout_pb2.Layout.FromString(event.tensor_proto.string_val[0])
    (category,) = layout.category
    assert category.title == "memory"
    assert [(c.title, list(c.multiline.tag)) for c in category.chart] == [
        ("peak", [r"^memory/peak_mb$"]),
        ("floor", [r"^memory/floor_mb$"]),
    ]
    assert RunLogger(tmp_path / "off", enabled=False).layout({"x": {"y": ["z"]}}) is None


def test_logging_leaves_other_imports_alone(tmp_path):
    # The logger once hid torch from tensorboardX by putting None into sys.modules while
    # importing it, which made an import of torch in another thread fail meanwhile. A
    # finder that looks at sys.modules while tensorboardX's modules are being imported
    # sees whether anything is blocked; an installed torch (a stand-in) still imports.
    (tmp_path / "torch.py").write_text("MARK = 'stand-in'\n\n\nclass Tensor:\n    pass\n")
    probe = (
        "import sys, tempfile\n"
        "seen = []\n"
        "class Watch:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.startswith('tensorboardX'):\n"
        "            seen.append(sys.modules.get('torch', 'absent') is None)\n"
        "        return None\n"
        "sys.meta_path.insert(0, Watch())\n"
        "import trainers.logging as L\n"
        "with L.RunLogger(tempfile.mkdtemp()) as log:\n"
        "    log.scalars(0, {'a': 1.0})\n"
        "import torch\n"
        "print(len(seen) > 0, any(seen), torch.MARK)\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, str(tmp_path)])}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=root, env=env)
    assert out.stdout.split() == ["True", "False", "stand-in"]
