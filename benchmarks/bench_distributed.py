"""Data-parallel benchmarks over MPI: allreduce bandwidth, gradient memory, weak scaling.

Runs on 2 ranks. Started without MPI (``python benchmarks/bench_distributed.py``) it
re-launches itself as ``mpiexec -n 2 <this python> <this file> ...`` (the ``mpiexec``
beside ``sys.executable``, else the one on PATH) with one BLAS thread per rank; started
under ``mpiexec`` it runs directly. Rank 0 prints the tables.

1. Allreduce of ResNet-20's gradients (width 16: its real parameter shapes, float32).
   Every timed call is preceded (untimed) by a barrier; a repeat's time is the MAX over
   the ranks; min and median over repeats, all variants interleaved round by round.

   - raw ``Allreduce(MPI.IN_PLACE, buf)`` of one flat buffer holding all the bytes;
   - ``iallreduce_`` + ``wait`` on DataParallel's bucket buffers (25 MiB buckets);
   - ``DataParallel.finish()`` with 25 MiB and 1 MiB buckets (policy on: bucket views),
     and 25 MiB buckets under policy off (packed copies). Untimed before each call: a
     forward+backward inside ``dp.no_sync()`` (gradients accumulate into the buckets,
     no hook launches anything), then a synced forward of one sample without backward
     (so that ``finish()`` has a step to complete). The timed ``finish()`` then launches
     every bucket's non-blocking allreduce, waits for all of them and divides by the
     world size (policy off: also packs into a send buffer and unpacks into new
     gradient arrays). No overlap with backward is measured here: only communication
     and the wrapper's own work;
   - one ``allreduce_`` per parameter (separate contiguous arrays).

   Algorithm bandwidth = gradient bytes / time (GB = 1e9 bytes).

2. Gradient memory of one DataParallel step (ResNet-20, small batch, SGD without
   momentum), policy on vs off: ``framework.memory`` live bytes of category
   ``gradients`` after the step and its per-category peak during the step (after a
   warmup step, from ``reset_peak()``), on rank 0. Backward's intermediate gradients
   are counted in the same category, so the peak is more than the parameters' gradients.

3. Weak scaling 1 -> 2 ranks: samples/s of a training step (forward, backward,
   ``finish()``, SGD step) at a fixed per-rank batch. 1 rank: rank 0 runs the plain
   model while rank 1 sleeps (polling a non-blocking barrier every 10 ms, so it takes
   no core); 2 ranks: both run the DataParallel step. The two phases alternate round by
   round. Efficiency = throughput(2) / (2 x throughput(1)).

4. Overlap of the allreduce with backward. A model whose communication is comparable to
   its backward (an MLP 1024-2048-2048-10, 6.3M parameters = 25 MB of float32
   gradients, batch 8 per rank, 4 MiB buckets: 7 of them) and three timings, medians
   over interleaved repeats, slowest rank:
   - compute: forward + backward inside ``no_sync()`` (no communication);
   - comm: ``finish()`` alone, every bucket launched by it (after a ``no_sync``
     backward and a synced forward);
   - step: forward + backward with the hooks launching each bucket as it completes,
     then ``finish()``; once with ``poll_in_hooks`` (each later hook tests the launched
     buckets, the default) and once without.
   Overlap = (compute + comm - step) / comm: 0 when nothing overlaps, 1 when the
   communication is hidden entirely.

Run:  python benchmarks/bench_distributed.py [--quick] [--json PATH] [--repeats N]
"""

from __future__ import annotations

import os
import sys

# One BLAS thread per rank: set before NumPy is imported (the launcher passes it on too).
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import gc  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import framework as fw  # noqa: E402
from benchmarks import common  # noqa: E402
from framework import memory, nn, optim  # noqa: E402
from framework.distributed.comm import find_mpiexec  # noqa: E402
from models import build_model  # noqa: E402

MB = 2**20
RANKS = 2
TARGETS = {"bucketed_over_raw": 0.9, "bucketed_over_per_param": 5.0, "weak_scaling": 0.85}
_LOAD_ENV = "INPLACE_BENCH_LOAD_BEFORE"
_MPI_ENV = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS")


# -- launching ----------------------------------------------------------------------------


def under_mpiexec() -> bool:
    return any(v in os.environ for v in _MPI_ENV)


def have_mpi4py() -> bool:
    import importlib.util  # noqa: PLC0415

    return importlib.util.find_spec("mpi4py") is not None


def launch(argv: list[str]) -> int:
    """Re-runs this file under ``mpiexec -n 2``; returns its exit code."""
    mpiexec = find_mpiexec()
    if mpiexec is None or not have_mpi4py():
        print("bench_distributed: needs mpi4py and mpiexec (pip install mpi4py)", file=sys.stderr)
        return 2
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = "1"
    try:
        env[_LOAD_ENV] = load_str()
    except OSError:
        pass
    cmd = [mpiexec, "-n", str(RANKS), sys.executable, os.path.abspath(__file__), *argv]
    return subprocess.call(cmd, env=env)


# -- helpers ------------------------------------------------------------------------------


def load_str() -> str:
    """The 1, 5 and 15 minute load averages, e.g. ``"0.52 / 0.80 / 1.01"``."""
    try:
        return " / ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "n/a"


def gather_max(comm, times: dict[str, list[float]]) -> dict[str, list[float]]:
    """Per repeat, the slowest rank's time (a collective is done when every rank is)."""
    every = comm.allgather_object(times)
    return {k: [max(t[k][i] for t in every) for i in range(len(times[k]))] for k in times}


def idle_wait(comm) -> None:
    """Waits for the other ranks without spinning a core (MPI barriers busy-poll)."""
    req = comm.mpi_comm.Ibarrier()
    while not req.Test():
        time.sleep(0.01)


def make_batch(batch: int, seed: int):
    rng = np.random.default_rng(seed)
    x = fw.tensor(rng.standard_normal((batch, 3, 32, 32)).astype(np.float32))
    y = fw.tensor(rng.integers(0, 10, size=batch).astype(np.int64))
    return x, y


def ms(s: float) -> str:
    return f"{s * 1e3:.3f}"


# -- 1. allreduce bandwidth ---------------------------------------------------------------


def bench_allreduce(comm, repeats: int, batch: int) -> dict:
    from framework.distributed.data_parallel import DataParallel  # noqa: PLC0415

    MPI = comm._MPI
    loss_fn = nn.CrossEntropyLoss()
    x, y = make_batch(batch, seed=comm.rank)
    x1, _ = make_batch(1, seed=100 + comm.rank)

    dps = {}
    for key, policy, bucket_mb in (("on25", "on", 25.0), ("on1", "on", 1.0), ("off25", "off", 25.0)):
        with fw.inplace.policy(policy):
            fw.manual_seed(0)
            dps[key] = (DataParallel(build_model("resnet20", width=16), comm, bucket_mb=bucket_mb), policy)
    params = [p for p in dps["on25"][0].module.parameters() if p.requires_grad]
    numel = sum(p.numel() for p in params)
    nbytes = numel * 4
    # zeros: repeated sums stay finite (the values do not change the cost of the reduction)
    flat = np.zeros(numel, np.float32)
    per_param = [np.zeros(p.shape, np.float32) for p in params]
    bucket_bufs = [b.buffer for b in dps["on25"][0].buckets]

    def prepare(key, synced_forward=True):
        dp, policy = dps[key]
        with fw.inplace.policy(policy):
            with dp.no_sync():
                loss_fn(dp(x), y).backward()
            if synced_forward:
                dp(x1)  # a synced forward, no backward: finish() completes this step

    def raw():
        comm.mpi_comm.Allreduce(MPI.IN_PLACE, flat, op=MPI.SUM)

    def buckets_direct():
        for h in [comm.iallreduce_(b) for b in bucket_bufs]:
            h.wait()

    def finisher(key):
        dp, policy = dps[key]

        def fn():
            with fw.inplace.policy(policy):
                dp.finish()

        return fn

    def per_parameter():
        for a in per_param:
            comm.allreduce_(a)

    variants = {
        "raw MPI Allreduce(IN_PLACE), 1 flat buffer": raw,
        "iallreduce_ + wait on bucket buffers (25 MiB)": buckets_direct,
        "same, right after a forward+backward": buckets_direct,
        "DataParallel.finish(), on, 25 MiB buckets": finisher("on25"),
        "DataParallel.finish(), on, 1 MiB buckets": finisher("on1"),
        "DataParallel.finish(), off (packed copies), 25 MiB": finisher("off25"),
        "allreduce_ per parameter": per_parameter,
    }
    n_calls = {
        "raw MPI Allreduce(IN_PLACE), 1 flat buffer": 1,
        "iallreduce_ + wait on bucket buffers (25 MiB)": len(bucket_bufs),
        "same, right after a forward+backward": len(bucket_bufs),
        "DataParallel.finish(), on, 25 MiB buckets": len(dps["on25"][0].buckets),
        "DataParallel.finish(), on, 1 MiB buckets": len(dps["on1"][0].buckets),
        "DataParallel.finish(), off (packed copies), 25 MiB": len(dps["off25"][0].buckets),
        "allreduce_ per parameter": len(per_param),
    }
    keys = {
        "DataParallel.finish(), on, 25 MiB buckets": "on25",
        "DataParallel.finish(), on, 1 MiB buckets": "on1",
        "DataParallel.finish(), off (packed copies), 25 MiB": "off25",
    }

    def setup(name):
        if name in keys:
            prepare(keys[name])
        elif name == "same, right after a forward+backward":
            prepare("on25", synced_forward=False)  # the buckets just written, caches as finish() finds them
        comm.barrier()

    times = gather_max(comm, common.interleaved(variants, repeats, warmup=2, setup=setup))
    rows = {}
    for name, t in times.items():
        s = common.summarize(t)
        rows[name] = {
            **s,
            "collectives": n_calls[name],
            "bytes": nbytes,
            "gbps_at_min": nbytes / s["min"] / 1e9,
            "gbps_at_median": nbytes / s["median"] / 1e9,
        }
    raw_min = rows["raw MPI Allreduce(IN_PLACE), 1 flat buffer"]["min"]
    raw_med = rows["raw MPI Allreduce(IN_PLACE), 1 flat buffer"]["median"]
    pp = rows["allreduce_ per parameter"]
    for r in rows.values():
        r["over_raw_min"] = raw_min / r["min"]
        r["over_raw_median"] = raw_med / r["median"]
        r["speedup_vs_per_param_min"] = pp["min"] / r["min"]
        r["speedup_vs_per_param_median"] = pp["median"] / r["median"]
    return {"numel": numel, "bytes": nbytes, "num_params": len(params), "rows": rows}


# -- 2. gradient memory ----------------------------------------------------------------------


def _grad_memory_one(comm, policy: str, x, y) -> tuple[dict, int]:
    from framework.distributed.data_parallel import DataParallel  # noqa: PLC0415

    loss_fn = nn.CrossEntropyLoss()
    with fw.inplace.policy(policy):
        fw.manual_seed(0)
        dp = DataParallel(build_model("resnet20", width=16), comm)
        opt = optim.SGD(dp.parameters(), lr=0.01)

        def step(reset_before_finish=False):
            opt.zero_grad()
            loss_fn(dp(x), y).backward()
            if reset_before_finish:
                memory.reset_peak()
            dp.finish()
            opt.step()

        step()  # warmup: gradients exist from now on
        gc.collect()
        before = memory.breakdown()["gradients"]
        memory.reset_peak()
        step()
        out = {
            "live_before_mb": before / MB,
            "live_after_mb": memory.breakdown()["gradients"] / MB,
            "peak_mb": memory.peak_breakdown()["gradients"] / MB,
            "total_peak_mb": memory.max_allocated_bytes() / MB,
        }
        gc.collect()
        step(reset_before_finish=True)  # the gradient sync alone: finish() + optimizer step
        out["sync_peak_mb"] = memory.peak_breakdown()["gradients"] / MB
        numel = sum(p.numel() for p in dp.parameters())
    return out, numel


def bench_grad_memory(comm, batch: int) -> dict:
    x, y = make_batch(batch, seed=comm.rank)
    out = {}
    for policy in ("off", "on"):  # one model alive at a time
        gc.collect()
        out[policy], numel = _grad_memory_one(comm, policy, x, y)
        gc.collect()
    out["one_gradient_copy_mb"] = numel * 4 / MB
    out["peak_saving_mb"] = out["off"]["peak_mb"] - out["on"]["peak_mb"]
    out["sync_saving_mb"] = out["off"]["sync_peak_mb"] - out["on"]["sync_peak_mb"]
    return out


# -- 3. weak scaling --------------------------------------------------------------------------


def bench_weak_scaling(comm, rounds: int, steps: int, batch: int, width: int) -> dict:
    from framework.distributed.data_parallel import DataParallel  # noqa: PLC0415

    loss_fn = nn.CrossEntropyLoss()
    x, y = make_batch(batch, seed=comm.rank)
    with fw.inplace.policy("on"):
        fw.manual_seed(0)
        single = build_model("resnet20", width=width)
        opt1 = optim.SGD(single.parameters(), lr=0.01, momentum=0.9)
        fw.manual_seed(0)
        dp = DataParallel(build_model("resnet20", width=width), comm)
        opt2 = optim.SGD(dp.parameters(), lr=0.01, momentum=0.9)

    def step1():
        opt1.zero_grad()
        loss_fn(single(x), y).backward()
        opt1.step()

    def step2():
        opt2.zero_grad()
        loss_fn(dp(x), y).backward()
        dp.finish()
        opt2.step()

    def run_steps(fn, n):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return time.perf_counter() - t0

    t1, t2 = [], []
    with fw.inplace.policy("on"):
        for r in range(-1, rounds):  # round -1 is warmup
            n = 1 if r < 0 else steps
            # phase 1: rank 0 alone
            if comm.rank == 0:
                dt = run_steps(step1, n)
                req = comm.mpi_comm.Ibarrier()
                req.Wait()
            else:
                idle_wait(comm)
                dt = 0.0
            if r >= 0:
                t1.append(dt)
            # phase 2: both ranks
            comm.barrier()
            dt = run_steps(step2, n)
            if r >= 0:
                t2.append(dt)
    t2 = gather_max(comm, {"t": t2})["t"]
    t1 = comm.allgather_object(t1)[0]
    thr1 = [batch * steps / t for t in t1]
    thr2 = [comm.size * batch * steps / t for t in t2]
    best1, best2 = max(thr1), max(thr2)
    med1, med2 = statistics.median(thr1), statistics.median(thr2)
    return {
        "width": width,
        "batch_per_rank": batch,
        "steps_per_round": steps,
        "rounds": rounds,
        "samples_per_s_1": {"best": best1, "median": med1},
        "samples_per_s_2": {"best": best2, "median": med2},
        "efficiency_best": best2 / (comm.size * best1),
        "efficiency_median": med2 / (comm.size * med1),
    }


# -- 4. overlap with backward ----------------------------------------------------------------


def bench_overlap(comm, repeats: int, batch: int) -> dict:
    from framework.distributed.data_parallel import DataParallel  # noqa: PLC0415

    loss_fn = nn.CrossEntropyLoss()
    rng = np.random.default_rng(comm.rank)
    x = fw.tensor(rng.standard_normal((batch, 1024)).astype(np.float32))
    y = fw.tensor(rng.integers(0, 10, size=batch).astype(np.int64))
    with fw.inplace.policy("on"):
        fw.manual_seed(0)
        dp = DataParallel(build_model("mlp", in_features=1024, hidden=(2048, 2048)), comm, bucket_mb=4.0)
    nbytes = sum(p.numel() for p in dp.parameters()) * 4

    def compute():
        with dp.no_sync():
            loss_fn(dp(x), y).backward()

    def comm_only():
        dp.finish()

    def step(poll):
        def fn():
            object.__setattr__(dp, "poll_in_hooks", poll)
            loss_fn(dp(x), y).backward()
            dp.finish()

        return fn

    variants = {
        "compute": compute,
        "comm": comm_only,
        "step (poll in hooks)": step(True),
        "step (no polling)": step(False),
    }

    def setup(name):
        dp.zero_grad()
        if name == "comm":
            compute()
            dp(x[:1])  # a synced forward without backward: finish() has a step to complete
        comm.barrier()

    with fw.inplace.policy("on"):
        times = gather_max(comm, common.interleaved(variants, repeats, warmup=2, setup=setup))
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {"bytes": nbytes, "buckets": len(dp.buckets), "batch_per_rank": batch, "median_s": med}
    for k in ("step (poll in hooks)", "step (no polling)"):
        out[f"overlap, {k}"] = (med["compute"] + med["comm"] - med[k]) / med["comm"]
    return out


# -- main ---------------------------------------------------------------------------------------


def report(res: dict, info: dict) -> None:
    a = res["allreduce"]
    print(
        f"## Allreduce of ResNet-20's gradients ({a['num_params']} tensors, {a['numel']:,} float32 = "
        f"{a['bytes'] / MB:.2f} MiB), {RANKS} ranks\n"
    )
    print(
        "Time = slowest rank, per call after a barrier; min and median over "
        f"{next(iter(a['rows'].values()))['repeats']} interleaved repeats. GB/s = bytes / time.\n"
    )
    rows = []
    for name, r in a["rows"].items():
        rows.append(
            [
                name,
                r["collectives"],
                ms(r["min"]),
                ms(r["median"]),
                f"{r['gbps_at_min']:.2f}",
                f"{r['gbps_at_median']:.2f}",
                f"{r['over_raw_min']:.2f} / {r['over_raw_median']:.2f}",
                f"{r['speedup_vs_per_param_min']:.1f}x / {r['speedup_vs_per_param_median']:.1f}x",
            ]
        )
    print(
        common.markdown_table(
            [
                "path",
                "collectives",
                "min ms",
                "median ms",
                "GB/s (min)",
                "GB/s (median)",
                "vs raw (min / median)",
                "vs per-param (min / median)",
            ],
            rows,
            [
                ("collectives", "MPI allreduce calls per gradient sync"),
                ("vs raw (min / median)", "one raw MPI Allreduce of the same bytes: its time over this path's"),
                ("vs per-param (min / median)", "allreduce_ per parameter's time over this path's"),
            ],
        )
    )
    b = a["rows"]["DataParallel.finish(), on, 25 MiB buckets"]
    print(
        f"\nTarget: bucketed / raw >= {TARGETS['bucketed_over_raw']}: "
        f"{b['over_raw_min']:.2f} at min, {b['over_raw_median']:.2f} at median. "
        f"Target: bucketed vs per-parameter >= {TARGETS['bucketed_over_per_param']:.0f}x: "
        f"{b['speedup_vs_per_param_min']:.1f}x at min, {b['speedup_vs_per_param_median']:.1f}x at median.\n"
    )

    m = res["grad_memory"]
    print(
        f"## Gradient memory of one DataParallel step (ResNet-20 width 16, batch {res['params']['mem_batch']} "
        f"per rank, rank 0)\n"
    )
    print(
        common.markdown_table(
            [
                "policy",
                "gradients live after step (MiB)",
                "gradients peak in finish() + step (MiB)",
                "gradients peak in whole step (MiB)",
                "total peak in whole step (MiB)",
            ],
            [
                [
                    f"{p} ({'bucket views' if p == 'on' else 'packed copies'})",
                    f"{m[p]['live_after_mb']:.2f}",
                    f"{m[p]['sync_peak_mb']:.2f}",
                    f"{m[p]['peak_mb']:.2f}",
                    f"{m[p]['total_peak_mb']:.2f}",
                ]
                for p in ("off", "on")
            ],
            [
                ("policy", "on: gradients are views into the allreduce buckets; off: packed into copies"),
                ("gradients live after step (MiB)", "gradient bytes still allocated once the step returns"),
            ],
        )
    )
    one = m["one_gradient_copy_mb"]
    print(
        f"\nOne full gradient copy = {one:.2f} MiB. Off - on: {m['sync_saving_mb']:.2f} MiB "
        f"({m['sync_saving_mb'] / one:.2f} copies) at the gradient sync, {m['peak_saving_mb']:.2f} MiB "
        f"({m['peak_saving_mb'] / one:.2f} copies) over the whole step (backward's intermediate "
        f"gradients are in the same category).\n"
    )

    w = res["weak_scaling"]
    print(
        f"## Weak scaling 1 -> 2 ranks (ResNet-20 width {w['width']}, batch {w['batch_per_rank']} per rank, "
        f"SGD momentum, 1 BLAS thread per rank, {w['rounds']} rounds of {w['steps_per_round']} steps)\n"
    )
    print(
        common.markdown_table(
            ["ranks", "samples/s (best round)", "samples/s (median round)"],
            [
                [1, f"{w['samples_per_s_1']['best']:.1f}", f"{w['samples_per_s_1']['median']:.1f}"],
                [2, f"{w['samples_per_s_2']['best']:.1f}", f"{w['samples_per_s_2']['median']:.1f}"],
                ["efficiency", f"{w['efficiency_best']:.2f}", f"{w['efficiency_median']:.2f}"],
            ],
            [("efficiency", "samples/s with 2 ranks over 2 x samples/s with 1 (1.00: perfect weak scaling)")],
        )
    )
    print(
        f"\nTarget: efficiency >= {TARGETS['weak_scaling']}: {w['efficiency_best']:.2f} (best), "
        f"{w['efficiency_median']:.2f} (median)."
    )
    o = res["overlap"]
    print(
        f"## Overlap of the allreduce with backward (MLP 1024-2048-2048-10, {o['bytes'] / MB:.1f} MiB of "
        f"gradients in {o['buckets']} buckets, batch {o['batch_per_rank']} per rank)\n"
    )
    print(
        common.markdown_table(
            ["timing", "median ms"],
            [[k, ms(v)] for k, v in o["median_s"].items()],
            [("median ms", "per step, the slowest rank's, median over rounds")],
        )
    )
    print(
        f"\nOverlap = (compute + comm - step) / comm: {o['overlap, step (poll in hooks)']:.2f} with polls in "
        f"the hooks, {o['overlap, step (no polling)']:.2f} without.\n"
    )
    print(
        f"Load average (1 / 5 / 15 min) before launch: {res['load_before']}; after the run: "
        f"{res['load_after']} (the {RANKS} ranks themselves count; 2 cores).\n"
    )
    print(f"Machine: {common.machine_line(info)}")


def main(argv: list[str] | None = None):
    argv = list(sys.argv[1:] if argv is None else argv)
    p = common.parser(__doc__.splitlines()[0], default_repeats=30)
    args = p.parse_args(argv)
    if not under_mpiexec():
        return launch(argv)
    from framework.distributed.comm import get_world, install_abort_on_exception  # noqa: PLC0415

    comm = get_world()
    install_abort_on_exception(comm)  # an error on one rank ends the job instead of hanging it
    if comm.size != RANKS:
        if comm.rank == 0:
            print(f"bench_distributed: run on {RANKS} ranks (got {comm.size})", file=sys.stderr)
        return 2
    repeats = common.repeats_of(args, 30)
    quick = args.quick
    params = {
        "quick": quick,
        "repeats": repeats,
        "ranks": comm.size,
        "grad_batch": 2 if quick else 4,
        "mem_batch": 4 if quick else 8,
        "ws_width": 8 if quick else 16,
        "ws_batch": 8 if quick else 32,
        "ws_rounds": 2 if quick else 9,
        "ws_steps": 1 if quick else 4,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }
    load_before = os.environ.get(_LOAD_ENV)
    if load_before is None:
        load_before = load_str()
    info = common.machine_info()
    res = {"params": params, "load_before": load_before}
    res["allreduce"] = bench_allreduce(comm, repeats, params["grad_batch"])
    res["grad_memory"] = bench_grad_memory(comm, params["mem_batch"])
    res["weak_scaling"] = bench_weak_scaling(
        comm, params["ws_rounds"], params["ws_steps"], params["ws_batch"], params["ws_width"]
    )
    res["overlap"] = bench_overlap(comm, max(repeats // 2, 3), 8)
    res["load_after"] = load_str()
    if comm.rank == 0:
        report(res, info)
        sys.stdout.flush()
        if args.json:
            common.write_json(args.json, {"machine": info, "targets": TARGETS, **res, "command": common.command_line()})
    return res if comm.rank == 0 else None


if __name__ == "__main__":
    out = main()
    sys.exit(out if isinstance(out, int) else 0)
