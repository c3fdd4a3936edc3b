"""benchmarks/gpu_check.py: one line and status 2 without a GPU, and the wiring of its steps.

The real run needs CUDA; here each step's command line is checked against the program it
calls (their own argument parsers), and the runner and the summary on tiny commands.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from benchmarks import bench_gpu, gpu_check
from scripts import compare_inplace

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_check.py")


def _run(*args, env_cupy="cupy"):
    env = {**os.environ, "PYTHONPATH": ROOT, "INPLACE_LAB_CUPY": env_cupy}
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=120, env=env)


def test_without_a_gpu_it_exits_2_with_one_line():
    """Never the stand-in: even with INPLACE_LAB_CUPY=standin it asks real CuPy (none here)."""
    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("CuPy is installed here: whether it sees a GPU decides")
    r = _run(env_cupy="standin")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: gpu_check.py needs a CUDA GPU that CuPy can use")
    assert "CuPy is not installed" in r.stderr and "nothing was run" in r.stderr


def test_without_the_test_extra_it_says_which_install_it_needs(monkeypatch, capsys):
    """Issue 41: the GPU extras do not install pytest, and the first step runs the test
    suite. Without it: one line naming the install command, status 2, nothing run."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "pytest" else find_spec(name, *a))
    monkeypatch.setattr(gpu_check, "run_step", lambda *a: pytest.fail("a step ran"))
    assert gpu_check.main(["--out", "/tmp/x"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith("error: gpu_check.py's first step runs the test suite, which needs pytest (the test extra)")
    assert 'pip install -e ".[test,gpu-cuda13]"' in err and "nothing was run" in err


def test_list_prints_the_four_steps_without_running_them():
    r = _run("--list", "--out", "/tmp/x")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == ["gpu leg", "bench_gpu", "bench_gpu b64", "compare_inplace"]
    assert all(line.split(": ", 1)[1].startswith("INPLACE_LAB_CUPY=cupy ") for line in lines)
    assert " -m pytest -m gpu " in lines[0]
    assert lines[1].endswith("benchmarks/bench_gpu.py --count --json /tmp/x/bench_gpu.json")
    assert lines[2].endswith(
        "benchmarks/bench_gpu.py --models resnet20 --batch resnet20=64 --json /tmp/x/bench_gpu_b64.json"
    )
    assert lines[3].endswith(
        "scripts/compare_inplace.py --config configs/resnet20_synthetic.yaml --policies off,auto,on,on+abn "
        "--set device=cuda"
    )


def test_each_step_is_a_command_its_program_accepts(without_cupy):
    (_, leg), (_, bench), (_, bench64), (_, compare) = gpu_check.steps("/tmp/out")
    assert leg[1:5] == ["-m", "pytest", "-m", "gpu"]
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        assert '"gpu: the GPU leg' in f.read()  # the marker -m selects
    # bench_gpu parses its options, then stops at the missing GPU (status 2) before measuring
    assert os.path.exists(os.path.join(ROOT, bench[1])) and bench_gpu.main(bench[2:]) == 2
    assert bench64[1] == bench[1] and bench_gpu.main(bench64[2:]) == 2
    assert os.path.exists(os.path.join(ROOT, compare[1]))
    args = compare_inplace.parse_args(compare[2:])
    assert os.path.exists(os.path.join(ROOT, args.config)) and args.overrides == ["device=cuda"]
    assert compare_inplace.parse_policies(args.policies) == ["off", "auto", "on", "on+abn"]


def test_a_step_runs_with_its_output_and_the_summary_has_one_row_each(capsys):
    ok = gpu_check.run_step("ok", [sys.executable, "-c", "print('a'); print('3 passed')"], timeout=60)
    bad = gpu_check.run_step("bad", [sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"], timeout=60)
    hung = gpu_check.run_step("hung", [sys.executable, "-c", "import time; time.sleep(30)"], timeout=1)
    out = capsys.readouterr().out
    assert "3 passed" in out and "boom" in out
    assert (ok["exit"], ok["last line"]) == (0, "3 passed") and (bad["exit"], bad["last line"]) == (3, "boom")
    assert hung["exit"] != 0 and hung["seconds"] < 20 and hung["last line"].startswith("stopped after 1 s")
    table = gpu_check.summary([ok, bad]).splitlines()
    assert table[0] == "| step | exit | seconds | last line |" and len(table) == 4
    assert table[2].startswith("| ok | 0 |") and table[3].startswith("| bad | 3 |")


def test_nccl_versions_read_as_nccl_writes_them():
    assert gpu_check._nccl_version(22809) == "2.28.9"


def _extras() -> tuple[dict, str]:
    tomllib = pytest.importorskip("tomllib", reason="reads pyproject.toml with Python 3.11's tomllib")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    return project["optional-dependencies"], project["name"]


# The packages of one CUDA major the fused kernels compile with: the runtime headers and NVRTC.
HEADERS = {
    "12": ("nvidia-cuda-runtime-cu12", "nvidia-cuda-nvrtc-cu12"),
    "13": ("nvidia-cuda-runtime", "nvidia-cuda-nvrtc"),
}


def test_the_gpu_extras_name_a_cupy_its_headers_nccl_and_cudnn_of_one_cuda_version():
    """``pip install -e '.[gpu-cuda12]'`` or ``'.[gpu-cuda13]'``; ``gpu`` is the CUDA 12 set."""
    requirement = pytest.importorskip("packaging.requirements").Requirement
    extras, project = _extras()
    for cuda in ("12", "13"):
        wanted = [requirement(r) for r in extras[f"gpu-cuda{cuda}"]]
        assert {r.name for r in wanted} == {
            f"cupy-cuda{cuda}x",
            *HEADERS[cuda],
            f"nvidia-nccl-cu{cuda}",
            f"nvidia-cudnn-cu{cuda}",
            "nvidia-cudnn-frontend",
        }
        (cupy,) = [r for r in wanted if r.name.startswith("cupy")]
        assert cupy.extras == {"ctk"}  # the CUDA libraries CuPy loads (cuBLAS, cuRAND, NVRTC, ...)
    (alias,) = (requirement(r) for r in extras["gpu"])
    assert alias.name == project and alias.extras == {"gpu-cuda12"}


@pytest.mark.parametrize("cuda", ["12", "13"])
def test_each_gpu_extra_resolves_what_a_machine_with_only_the_driver_needs(cuda, tmp_path):
    """Issue 41: the extras installed no CUDA headers. pip resolves each extra as on a bare
    machine (``--ignore-installed``) and installs nothing (``--dry-run``); ``fast-deps`` reads
    each wheel's metadata with range requests instead of downloading the wheels (about 1 GB).
    The package index is needed: without it the test is skipped, except under CI=true."""
    from tests.conftest import in_ci  # noqa: PLC0415

    extras, _ = _extras()
    report = tmp_path / "report.json"
    argv = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet"]
    argv += ["--use-feature=fast-deps", "--report", str(report), *extras[f"gpu-cuda{cuda}"]]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=600, env={**os.environ, "PIP_NO_INPUT": "1"})
    unreachable = ("NewConnectionError", "Network is unreachable", "Temporary failure in name resolution")
    if r.returncode != 0 and any(u in r.stderr for u in unreachable) and not in_ci():
        pytest.skip(f"the package index cannot be reached: {r.stderr.strip().splitlines()[-1]}")
    assert r.returncode == 0, r.stderr
    assert "does not provide the extra" not in r.stderr, r.stderr  # a ctk extra pip would ignore
    with open(report) as f:
        got = {i["metadata"]["name"].lower(): i["metadata"] for i in json.load(f)["install"]}
    cupy = got[f"cupy-cuda{cuda}x"]
    assert int(cupy["version"].split(".")[0]) >= 14 and "ctk" in cupy.get("provides_extra", [])
    suffix = "-cu12" if cuda == "12" else ""
    for name in (*HEADERS[cuda], f"nvidia-cublas{suffix}"):  # headers, NVRTC, cuBLAS: of this major
        assert name in got and got[name]["version"].split(".")[0] == cuda, (name, got.get(name, {}).get("version"))
    assert f"nvidia-curand{suffix}" in got  # CuPy's random numbers (dropout masks)
