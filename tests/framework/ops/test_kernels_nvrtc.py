"""Every fused kernel compiled by the real NVRTC for sm_80 and sm_90, without a GPU.

The CuPy stand-in runs each kernel's NumPy reference and never compiles its CUDA source,
so a kernel that does not compile (a half type CUDA cannot convert, an identifier CuPy
rewrites) would first fail on a user's GPU. Here the installed real CuPy generates each
kernel's source with its own code generators, as a call would on a GPU, and compiles it
with NVRTC for an explicit architecture; the one thing replaced is CuPy's per-device arch
lookup (and the module load, which needs a driver): CuPy's options, the kernel's own and
``-ftz=true`` are CuPy's.

The table is generated from the kernels' declarations (:class:`framework.ops.kernels.Takes`,
read from their call sites and held to them on the stand-in): every kernel of
:data:`framework.ops.kernels.KERNELS` x every binding of its type letters (its dtypes) x
every layout of its arrays (and one with 64-bit indexing, for arrays past 2**31
elements) x each kind of its parameters (the ``either`` ones all arrays, then all
scalars; a parameter's kind changes only its own line of the source, ``const T &w =
_raw_w[...]`` or ``const T w``) x Python and NumPy scalars (CuPy types both by the
parameter: the same source, compiled once) x both architectures; a reduction in the
contiguous and the strided layout and, where it has one input and one output, on CuPy's
CUB path (one pass with 32-bit and 64-bit sizes, and the two passes of a reduction over
every axis). A compile fails the test, and so does a warning that the kernel's
declaration does not name with its reason.

Skipped only where real CuPy or NVRTC (the ``nvrtc`` extra) is not installed; under
``CI=true`` that is a failure instead, since CI installs them.
"""

from __future__ import annotations

import importlib
import importlib.util
import io
import os
import pkgutil
import re
import threading
import types
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pytest

import framework
from framework.ops import kernels as K

ARCHS = ("80", "90")
# NVRTC compiles without the GIL: one thread per core
WORKERS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
SCALAR_VALUES = {"Python": (1, 0.5), "NumPy": (np.int32(1), np.float32(0.5))}  # (integer, float)

for _m in pkgutil.walk_packages(framework.__path__, "framework."):  # every kernel joins KERNELS on import
    if not _m.name.startswith("framework.testing"):
        try:
            importlib.import_module(_m.name)
        except ImportError:  # an optional extra missing here (mpi4py): a module CI imports
            pass


# --- the table ----------------------------------------------------------------------------------


def _layouts(kernel) -> list:
    """(layout, 32-bit indexing) pairs a kernel is compiled in: each layout, and the first
    with 64-bit indexing (arrays past 2**31 elements; the index type is CuPy's templates').
    An elementwise kernel whose arrays are all raw declares none: it is called with
    ``size=``, a 1-d loop, compiled as the contiguous layout."""
    declared = kernel.takes.layouts if kernel.cls == "ElementwiseKernel" else ("contiguous", "strided")
    if kernel.cls == "ElementwiseKernel" and _all_raw(kernel):
        declared = ("contiguous",)
    return [(lay, True) for lay in declared] + [(next(lay for lay in declared if lay != "0-d"), False)]


def _all_raw(kernel) -> bool:
    """Whether every array parameter of an elementwise kernel is raw (a ``size=`` loop)."""
    takes = kernel.takes
    params = [p.split() for p in (kernel.args[0] + "," + kernel.args[1]).split(",") if p.strip()]
    return all(w[0] == "raw" or w[-1] in takes.scalars for w in params)


def rows(kernel) -> list:
    """The table's rows of one kernel: ``(binding, path, scalars as, either as)``."""
    takes = kernel.takes
    has_scalars = bool(takes.scalars or takes.either)
    sources = tuple(SCALAR_VALUES) if has_scalars else ("Python",)
    kinds = ("arrays", "scalars") if takes.either else ("arrays",)
    out = []
    for binding in takes.types:
        paths = [("loop",) + lay for lay in _layouts(kernel)]
        if kernel.cls == "ReductionKernel" and _params(kernel.args[0]) == 1 and _params(kernel.args[1]) == 1:
            paths += [("cub", True, 512), ("cub", False, 512), ("cub two passes", True, 512)]
        out += [(binding, p, s, k) for p in paths for s in sources for k in kinds]
    return out


def _params(text: str) -> int:
    return len([p for p in text.split(",") if p.strip()])


def _row_id(kernel, row) -> str:
    binding, path, source, kind = row
    return f"{kernel.name} {binding} {path} scalars={source} either={kind}"


TABLE = {name: rows(k) for name, k in sorted(K.KERNELS.items())}


def test_the_table_holds_every_kernel_and_every_declared_dtype():
    assert set(TABLE) == set(K.KERNELS) and all(TABLE.values())
    for name, kernel in K.KERNELS.items():
        letters = set(re.findall(r"\b([A-Z])\s+\w+\s*(?:,|$)", kernel.args[0] + "," + kernel.args[1]))
        for binding in kernel.takes.types:
            assert set(binding) == letters, f"{name}: {binding} binds {sorted(letters)}"
        for p in kernel.takes.scalars + kernel.takes.either + tuple(kernel.takes.raw):
            assert re.search(rf"\b{p}\b", kernel.args[0] + "," + kernel.args[1]), f"{name}: no parameter {p}"
        if kernel.cls == "ElementwiseKernel":  # layouts: those of its non-raw arrays, none where all are raw
            assert bool(kernel.takes.layouts) != _all_raw(kernel), f"{name}: layouts {kernel.takes.layouts}"


_CONSTRUCTORS = re.compile(r"\b(ElementwiseKernel|ReductionKernel|RawKernel|RawModule|create_ufunc|fuse)\s*\(")


def test_every_cuda_kernel_of_the_framework_is_declared_in_the_table():
    """A kernel built anywhere but through ``framework.ops.kernels`` (``elementwise`` /
    ``reduction``) would never reach this table: none is."""
    root = os.path.dirname(framework.__file__)
    found = []
    for folder, _, files in os.walk(root):
        if os.path.join(root, "testing") in folder:
            continue  # the stand-in is CuPy's API, not a kernel of the framework
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                with open(path, encoding="utf-8") as fh:
                    for n, line in enumerate(fh, 1):
                        code = line.split("#", 1)[0]
                        if _CONSTRUCTORS.search(code) and "``" not in code:
                            found.append(f"{os.path.relpath(path, root)}:{n}: {line.strip()}")
    assert found == [], "kernels built outside framework/ops/kernels.py's elementwise()/reduction()"


# --- real CuPy and NVRTC, without a GPU ---------------------------------------------------------


def _missing() -> str | None:
    """Why real CuPy's NVRTC cannot compile here (not installed), or None."""
    if importlib.util.find_spec("cupy") is None:
        return "real CuPy is not installed (pip install -e '.[nvrtc]')"
    try:
        from cupy.cuda import compiler  # noqa: PLC0415

        compiler._get_nvrtc_version()
    except Exception as e:  # noqa: BLE001  (CuPy raises its own errors for a missing library)
        return f"NVRTC is not installed ({type(e).__name__}: {e}; pip install -e '.[nvrtc]')"
    try:
        from cuda.pathfinder import find_nvidia_header_directory  # noqa: PLC0415

        if find_nvidia_header_directory("cudart") is None:
            return "the CUDA runtime headers are not installed (pip install -e '.[nvrtc]')"
    except ImportError as e:
        return f"cuda.pathfinder is not importable ({e})"
    return None


class _Compiled(Exception):
    """Raised by the module load that ends a successful compile (loading needs a driver)."""


class Nvrtc:
    """Real CuPy's kernel generators and compile path, with the arch given (no device)."""

    def __init__(self, monkeypatch):
        import cupy  # noqa: PLC0415
        from cupy._core import _carray, _cub_reduction, _kernel, _reduction, _scalar  # noqa: PLC0415
        from cupy.cuda import compiler, function, memory  # noqa: PLC0415

        self.cupy, self.compiler = cupy, compiler
        self._kernel, self._reduction, self._cub, self._scalar = _kernel, _reduction, _cub_reduction, _scalar
        self._carray, self._memory = _carray, memory
        self.local = threading.local()  # each thread's arch and compile logs
        self.lock = threading.Lock()
        self.seen: dict = {}  # (source, options with the arch) -> Future of (error or None, log)
        self.built: dict = {}  # kernel name -> real CuPy's kernel object

        class Module(function.Module):
            def load(self, cubin):
                raise _Compiled(cubin)

        nvrtc = self

        def get_arch():
            return nvrtc.local.arch

        original = compiler._NVRTCProgram.compile

        def compile_logged(program, options=(), log_stream=None):
            key = (program.src, tuple(options))  # the arch is among the options
            with nvrtc.lock:  # Python and NumPy scalars give the same source: compiled once
                outcome, first = nvrtc.seen.get(key), key not in nvrtc.seen
                if first:
                    outcome = nvrtc.seen[key] = Future()
            if first:
                log = io.StringIO()
                try:
                    result = original(program, options, log)
                    outcome.set_result((None, log.getvalue()))
                    nvrtc.local.logs.append(log.getvalue())
                    return result
                except compiler.CompileException as e:
                    outcome.set_result((e, str(e)))
            error, log = outcome.result()
            nvrtc.local.logs.append(log)
            if error is not None:
                raise error
            return b"", None  # compiled before: the module load that follows ends the row

        # the per-device lookups, by the arch asked for; CuPy's own compile path otherwise
        monkeypatch.setattr(compiler, "_get_arch", get_arch)
        arch_options = compiler._get_arch_for_options_for_nvrtc.__wrapped__  # memoized per device around it
        monkeypatch.setattr(compiler, "_get_arch_for_options_for_nvrtc", arch_options)
        monkeypatch.setattr(compiler, "function", types.SimpleNamespace(Module=Module, LinkState=function.LinkState))
        monkeypatch.setattr(compiler._NVRTCProgram, "compile", compile_logged)
        monkeypatch.setenv("CUPY_CACHE_IN_MEMORY", "1")  # compile every time: no disk cache hit hides a log

    # -- arguments as CuPy describes them to its generators (``_ArgInfo``) --

    def array(self, dtype, ndim, contiguous, i32):
        return self._kernel._ArgInfo(1, self.cupy.ndarray, np.dtype(dtype), ndim, contiguous, i32)

    def indexer(self, ndim, i32):
        return self._kernel._ArgInfo(2, self._carray.Indexer, None, ndim, True, i32)

    def scalar(self, value, dtype):
        s = self._scalar.CScalar(value)
        s.apply_dtype(dtype)  # what a kernel call does to a Python or NumPy scalar
        return self._kernel._ArgInfo(3, self._scalar.CScalar, s.dtype, 0, True, True)

    def pointer(self):
        return self._kernel._ArgInfo(4, self._memory.MemoryPointer, None, 0, True, True)

    def int_scalar(self, dtype):
        """A scalar CuPy makes itself (``CScalar.from_int32``, ``CScalar(n)``)."""
        return self._kernel._ArgInfo(3, self._scalar.CScalar, np.dtype(dtype), 0, True, True)

    # -- one row of the table --

    def compile(self, kernel, row, arch) -> str | None:
        """Compiles one row; returns None, or what went wrong (the error or the warnings)."""
        binding, path, source, kind = row
        real = self.built.get(kernel.name)
        if real is None:
            real = self.built[kernel.name] = getattr(self.cupy, kernel.cls)(*kernel.args, **kernel.kwargs)
        dtypes = {letter: K.dtype_of(name) for letter, name in binding.items()}
        takes = kernel.takes
        ints, floats = SCALAR_VALUES[source]

        def describe(p, ndim, contiguous, i32):
            dt = p.dtype if p.dtype is not None else dtypes[p.ctype]
            if p.name in takes.scalars or (p.name in takes.either and kind == "scalars"):
                return None, self.scalar(ints if dt.kind in "iub" else floats, dt)
            if p.raw:
                return dt, self.array(dt, takes.raw[p.name], contiguous, i32)
            return dt, self.array(dt, ndim, contiguous, i32)

        self.local.arch, self.local.logs = arch, []
        try:
            if kernel.cls == "ElementwiseKernel":
                generate = self._elementwise(real, path, describe)
            elif path[0] == "loop":
                generate = self._reduction_loop(real, path, describe, dtypes)
            else:
                generate = self._reduction_cub(real, path, describe, dtypes)
            generate()
        except _Compiled:
            pass
        except self.compiler.CompileException as e:
            return f"{_row_id(kernel, row)} sm_{arch}: {e.get_message().strip()}"
        warnings = [w for log in self.local.logs for w in re.findall(r"warning #(\d+-D)", log)]
        unnamed = sorted(set(warnings) - set(takes.warnings))
        if unnamed:
            return f"{_row_id(kernel, row)} sm_{arch}: warnings {unnamed} not named in the declaration:\n" + "\n".join(
                self.local.logs
            )
        return None

    def _elementwise(self, real, path, describe):
        _, layout, i32 = path
        ndim, contiguous = {"contiguous": (1, True), "strided": (3, False), "0-d": (0, True)}[layout]
        described = [describe(p, ndim, contiguous, i32) for p in real.in_params + real.out_params]
        in_types = tuple(d for d, _ in described[: real.nin])
        out_types = tuple(d for d, _ in described[real.nin :])
        _, _, type_map = real._decide_params_type(in_types, out_types)
        arginfos = tuple(a for _, a in described) + (self.indexer(ndim, i32),)
        return lambda: self._kernel._get_elementwise_kernel.__wrapped__(
            arginfos, type_map, real.params, real.operation, real.name, real.preamble, **real.kwargs
        )

    def _reduction_types(self, real, described, i32):
        in_types = tuple(None if d is None else d.type for d, _ in described[: real.nin])
        out_types = tuple(d.type for d, _ in described[real.nin :])
        _, _, type_map = self._kernel._decide_params_type(real.in_params, real.out_params, in_types, out_types)
        return self._kernel._TypeMap(type_map._pairs + (("IndexT", "int32" if i32 else "int64"),))

    def _reduction_loop(self, real, path, describe, dtypes):
        _, layout, i32 = path
        ndim, contiguous = {"contiguous": (1, True), "strided": (3, False)}[layout]
        described = [describe(p, ndim, contiguous, i32) for p in real.in_params]
        described += [describe(p, 1, True, i32) for p in real.out_params]  # the reduced values: (C,)
        type_map = self._reduction_types(real, described, i32)
        indexers = (self.indexer(ndim, i32), self.indexer(1, i32), self.int_scalar("int32"))  # + _block_stride
        arginfos = tuple(a for _, a in described) + indexers
        return lambda: self._reduction._ReductionKernel_get_cached_function.__wrapped__(
            real.nin,
            real.nout,
            real._params,
            arginfos,
            type_map,
            real.name,
            512,  # CuPy's default block size
            real.reduce_type,
            real.identity,
            real.map_expr,
            real.reduce_expr,
            real.post_map_expr,
            real.preamble,
            real.options,
        )

    def _reduction_cub(self, real, path, describe, dtypes):
        """CuPy 14.2's ``_try_to_call_cub_reduction`` (a cdef function, so its few lines
        are mirrored here), then its own CUB kernel generator and compile."""
        how, i32, block = path
        get_param_info, type_map_cls = self._kernel._get_param_info, self._kernel._TypeMap
        (p_in,), (p_out,) = real.in_params, real.out_params
        din, dout = (describe(p, 2, False, i32) for p in (p_in, p_out))
        type_map = self._reduction_types(real, [din, dout], i32)
        size_type = "int32" if i32 else "uint64"
        type_map = type_map_cls(type_map._pairs + (("sizeT", size_type),))
        params = (
            real._params[0:2]
            + get_param_info(size_type + " _segment_size", True)
            + get_param_info(size_type + " _array_size", True)
        )
        map_expr, post_map_expr = real.map_expr, real.post_map_expr
        old_in0, old_out0 = params[0].name, params[1].name
        if old_in0 != "in0" or old_out0 != "out0":  # CuPy's "HACK for ReductionKernel"
            params = get_param_info("T in0", True) + get_param_info("T out0", False) + params[2:]
            map_expr = map_expr.replace(old_in0, "in0")
            post_map_expr = post_map_expr.replace(old_out0, "out0")
            type_map = type_map_cls(type_map._pairs + (("type_in0_raw", din[0].type), ("type_out0_raw", dout[0].type)))
        size = self.int_scalar("int32" if i32 else "int64")  # CuPy's _cub_convert_to_c_scalar
        build = self._cub._SimpleCubReductionKernel_get_cached_function.__wrapped__
        common = (real.reduce_expr,)
        if how == "cub":
            arginfos = (din[1], dout[1], size, size)
            return lambda: build(
                map_expr, *common, post_map_expr, real.reduce_type, params, arginfos, type_map, real.name, block,
                real.identity, real.preamble, (), 4,
            )  # fmt: skip

        def two_passes():
            first = (din[1], self.pointer(), size, size)
            try:
                build(
                    map_expr, *common, post_map_expr, real.reduce_type, params, first, type_map,
                    real.name + "_pass1", block, real.identity, real.preamble, ("-DFIRST_PASS=1",), 4,
                )  # fmt: skip
            except _Compiled:
                pass
            second = (self.pointer(), dout[1], size, size)
            build(
                "in0", *common, post_map_expr, real.reduce_type, params, second, type_map,
                real.name + "_pass2", block, real.identity, real.preamble, ("-DSECOND_PASS=1",), 4,
            )  # fmt: skip

        return two_passes


@pytest.fixture(scope="module")
def nvrtc():
    missing = _missing()
    if missing is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true: the NVRTC test must run, but {missing}")
        pytest.skip(missing)
    with pytest.MonkeyPatch.context() as mp:
        yield Nvrtc(mp)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", sorted(TABLE))
def test_the_kernel_compiles_for_every_declared_call(nvrtc, name, arch):
    kernel = K.KERNELS[name]
    with ThreadPoolExecutor(WORKERS) as pool:
        outcomes = list(pool.map(lambda row: nvrtc.compile(kernel, row, arch), TABLE[name]))
    failures = [f for f in outcomes if f is not None]
    assert failures == [], f"{len(failures)} of {len(TABLE[name])} compiles failed:\n" + "\n\n".join(failures)


def test_a_kernel_compiles_with_the_headers_of_the_gpu_extras_runtime_wheel_alone(nvrtc):
    """Issue 41: the GPU extras installed no CUDA headers, and CuPy 14 fails at a machine's
    first kernel compile without them. ``gpu-cuda13`` names the runtime-headers wheel this
    leg's nvrtc extra installs (``nvidia-cuda-runtime`` 13): the one include folder CuPy's
    compile takes outside CuPy itself must be that wheel's, at a version the extra accepts
    (``gpu-cuda12``'s set is resolved by tests/benchmarks/test_gpu_check.py)."""
    from importlib.metadata import distribution  # noqa: PLC0415

    import tomllib  # noqa: PLC0415 - Python 3.11; the nvrtc extra's leg runs on it
    from packaging.requirements import Requirement  # noqa: PLC0415

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        extra = [Requirement(r) for r in tomllib.load(f)["project"]["optional-dependencies"]["gpu-cuda13"]]
    (wanted,) = [r for r in extra if r.name == "nvidia-cuda-runtime"]
    wheel = distribution("nvidia-cuda-runtime")
    assert wanted.specifier.contains(wheel.version), (wanted, wheel.version)
    (header,) = [f for f in wheel.files if f.name == "cuda_runtime.h"]
    headers = os.path.dirname(os.path.realpath(wheel.locate_file(header)))

    name = sorted(TABLE)[0]
    nvrtc.seen.clear()
    assert nvrtc.compile(K.KERNELS[name], TABLE[name][0], ARCHS[-1]) is None
    cupy_dir = os.path.dirname(os.path.realpath(nvrtc.cupy.__file__))
    included = {os.path.realpath(o[2:]) for _, options in nvrtc.seen for o in options if o.startswith("-I")}
    assert {d for d in included if not d.startswith(cupy_dir)} == {headers}
