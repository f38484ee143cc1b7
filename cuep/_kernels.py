"""Compile and cache the CUDA C++ in ``cuep/cuda_src`` with ``cupy.RawModule``.

One module per ``.cu`` file, compiled once per (file, device) and kept for the life of the process; a file listed
in :data:`PARTS` is compiled in parts instead (one module per part, each holding the kernels of one wire format), so
a program compiles only the formats it launches.
CuPy's disk cache keys on the source string and options only, not on headers reached through ``-I``; the
options therefore carry a hash of the whole ``cuda_src`` tree (``-DCUEP_SRC_HASH=...``), so editing a header
recompiles every module. CuPy adds ``-arch=sm_XX`` of the device, ``--std=c++17`` and ``-ftz=true`` itself;
:func:`nvcc_command` spells out the same compile for a machine without a GPU (the CPU compile test).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import struct
import threading
import time
from pathlib import Path

log = logging.getLogger("cuep")

SRC_DIR = Path(__file__).resolve().parent / "cuda_src"

#: Flags CuPy's RawModule adds to every compile itself (we must not pass -arch: NVRTC rejects a second one).
CUPY_IMPLICIT_OPTIONS = ("--std=c++17", "-ftz=true")


@functools.lru_cache(maxsize=1)
def source_hash() -> str:
    """SHA-256 (first 16 hex digits) of every file under ``cuda_src``, names included."""
    h = hashlib.sha256()
    for p in sorted(SRC_DIR.rglob("*")):
        if p.is_file() and p.suffix in (".cu", ".cuh", ".h"):
            h.update(p.relative_to(SRC_DIR).as_posix().encode())
            h.update(b"\0")
            h.update(p.read_bytes())
    return h.hexdigest()[:16]


def compile_options(defines: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The options cuep passes to ``cupy.RawModule`` (CuPy adds :data:`CUPY_IMPLICIT_OPTIONS` and -arch).

    ``defines`` (``("NAME=VALUE", ...)``, each becoming ``-DNAME=VALUE``): the product passes only a part's
    macro (:func:`part_defines`, which kernels a module holds, never how they compute); a benchmark harness may add
    a variant of a kernel's tuning constants. Nothing in the environment changes what is compiled.
    """
    return ("--std=c++17", f"-I{SRC_DIR}", f"-DCUEP_SRC_HASH=0x{source_hash()}ULL", *(f"-D{d}" for d in defines))


def kernel_files() -> list[str]:
    """Every compilable kernel file (``*.cu``) in ``cuda_src``."""
    return sorted(p.name for p in SRC_DIR.glob("*.cu"))


#: Kernel files the runtime compiles in parts: file -> (the macro prefix that picks a part, the parts). Part ``p``
#: is the file compiled with ``-D<prefix>_<P>`` (upper case) and holds the kernels whose names carry ``_<p>_from_``:
#: dispatch.cu's every kernel of one wire format, from either input dtype (NVRTC on the H200 host: fp8 13 s, bf16
#: 10 s, the whole file 72 s). Compiled with no part's macro, the file holds every kernel (benchmark harnesses that
#: read a traced copy's globals, tuning variants).
PARTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "dispatch.cu": ("CUEP_DISPATCH_FORMAT", ("bf16", "fp8", "nvfp4", "mxfp4")),
}


def part_defines(filename: str, part: str | None) -> tuple[str, ...]:
    """The defines (``NAME`` / ``NAME=VALUE``) that compile ``part`` of ``filename``; () for the whole file."""
    if part is None:
        return ()
    spec = PARTS.get(filename)
    if spec is None or part not in spec[1]:
        known = spec[1] if spec else ()
        raise ValueError(f"{filename} has no part {part!r} (its parts: {', '.join(known) or 'none, it compiles whole'})")
    return (f"{spec[0]}_{part.upper()}",)


def part_of(filename: str, name: str) -> str | None:
    """The part of ``filename`` that holds kernel ``name`` (None: the file compiles whole)."""
    spec = PARTS.get(filename)
    if spec is None:
        return None
    for part in spec[1]:
        if f"_{part}_from_" in name:
            return part
    raise ValueError(f"kernel {name!r} of {filename} names none of its parts ({', '.join(spec[1])}): "
                     f"its name must carry _<part>_from_")


def kernel_units() -> list[tuple[str, str | None]]:
    """Every (file, part) the runtime may compile: each part of a file in :data:`PARTS`, other files whole (None)."""
    return [(f, p) for f in kernel_files() for p in (PARTS[f][1] if f in PARTS else (None,))]


def nvcc_command(filename: str, arch: str = "sm_90", out: str = "/dev/null", part: str | None = None) -> list[str]:
    """The nvcc command that compiles ``filename`` (its ``part``: :data:`PARTS`) like the runtime does, warnings as
    errors, and register spills reported as warnings (``-warn-spills``), hence errors: no kernel may spill under the
    runtime's options."""
    opts = list(compile_options(part_defines(filename, part)))
    for o in CUPY_IMPLICIT_OPTIONS:
        if o not in opts:
            opts.append(o)
    return ["nvcc", "-cubin", f"-arch={arch}", *opts, "-Xptxas", "-warn-spills", "-Werror", "all-warnings",
            "-o", out, str(SRC_DIR / filename)]


def nvrtc_include_options() -> tuple[str, ...]:
    """The include directories CuPy's RawModule hands NVRTC (its bundled CCCL and headers, and CUDA's)."""
    import cupy

    base = Path(cupy.__file__).resolve().parent / "_core" / "include"
    cuda = Path(os.environ.get("CUDA_PATH", "/usr/local/cuda")) / "include"
    return (*(f"-I{base / 'cupy' / '_cccl' / d}" for d in ("cub", "thrust", "libcudacxx")), f"-I{base}", f"-I{cuda}")


def nvrtc_compile(filename: str, arch: str = "sm_90", part: str | None = None) -> tuple[bytes, str]:
    """Compile ``cuda_src/<filename>`` (its ``part``: :data:`PARTS`) with NVRTC, CuPy's runtime compiler, without
    a GPU: (cubin, log).

    Same source and options as :func:`module` (plus the flags CuPy adds itself). Raises RuntimeError with the
    compiler log on failure.
    """
    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram((SRC_DIR / filename).read_text(), filename, [], [])
    opts = (*nvrtc_include_options(), *compile_options(part_defines(filename, part)), *CUPY_IMPLICIT_OPTIONS[1:],
            f"-arch={arch}")
    try:
        nvrtc.compileProgram(prog, opts)
    except Exception as e:
        raise RuntimeError(f"NVRTC failed on {filename}:\n{nvrtc.getProgramLog(prog)}") from e
    return nvrtc.getCUBIN(prog), nvrtc.getProgramLog(prog)


_lock = threading.Lock()  # guards _unit_locks
_unit_locks: dict[tuple, threading.Lock] = {}  # one per module key: different units compile at the same time
_modules: dict[tuple, object] = {}
_functions: dict[tuple, object] = {}


def _unit_lock(key: tuple) -> threading.Lock:
    with _lock:
        lock = _unit_locks.get(key)
        if lock is None:
            lock = _unit_locks[key] = threading.Lock()
    return lock


def module(filename: str, name_expressions: tuple[str, ...] = (), defines: tuple[str, ...] = (),
           part: str | None = None):
    """The ``cupy.RawModule`` of ``cuda_src/<filename>`` for the current device, compiled on first use.

    ``part``: one part of a file in :data:`PARTS` (None: the whole file). ``name_expressions`` lists template
    instantiations to compile (``"kernel<int, 4>"``); pass the same tuple on every call for one file (the first
    call's list is the one compiled). ``defines``: a benchmark variant's tuning constants (:func:`compile_options`),
    cached apart from the product's build.
    """
    import cupy

    dev = cupy.cuda.Device().id
    key = (filename, part, dev, tuple(defines))
    mod = _modules.get(key)
    if mod is not None:
        return mod
    with _unit_lock(key):  # (NVRTC releases the GIL: other units compile meanwhile, compile_kernels)
        mod = _modules.get(key)
        if mod is None:
            path = SRC_DIR / filename
            if not path.is_file():
                raise FileNotFoundError(f"no kernel file {filename!r} in {SRC_DIR}")
            opts = compile_options((*part_defines(filename, part), *defines))
            code = path.read_text()
            what = unit_name(filename, part)
            t0 = time.perf_counter()
            log.info("cuep: compiling %s for device %d ...", what, dev)
            mod = cupy.RawModule(code=code, options=opts, name_expressions=list(name_expressions) or None)
            mod.compile()
            log.info("cuep: %s ready on device %d in %.1f s (cached on disk for next time)",
                     what, dev, time.perf_counter() - t0)
            _modules[key] = mod
    return mod


#: The kernel files cuep's calls compile besides dispatch.cu's parts (bench.cu is cuep.bench's alone).
RUNTIME_FILES = ("combine.cu",)
OPS_FILES = ("quantize.cu", "silu.cu", "selftest.cu")


def runtime_units(formats=None, ops: bool = True) -> list[tuple[str, str | None]]:
    """The (file, part) units a program's calls compile: dispatch.cu's parts of ``formats`` (a name or a sequence
    of them; None: all four), combine.cu, and with ``ops`` the files of :mod:`cuep.ops`. Longest first."""
    known = PARTS["dispatch.cu"][1]
    fmts = known if formats is None else (formats,) if isinstance(formats, str) else tuple(formats)
    bad = [f for f in fmts if f not in known]
    if bad or not fmts:
        raise ValueError(f"formats: {bad or 'none given'} is not a dispatch wire format (cuep's: {', '.join(known)})")
    files = RUNTIME_FILES + (OPS_FILES if ops else ())
    units = [(f, p) for f, p in kernel_units() if (f == "dispatch.cu" and p in fmts) or (p is None and f in files)]
    return sorted(units, key=lambda u: u[0] != "dispatch.cu")  # (stable: the parts, then the files by name)


def unit_name(filename: str, part: str | None) -> str:
    """``dispatch.cu[fp8]`` for a part, the file name for a whole file."""
    return filename if part is None else f"{filename}[{part}]"


def _compile_unit(unit: tuple[str, str | None], device: int) -> float:
    import cupy

    t0 = time.perf_counter()
    with cupy.cuda.Device(device):
        module(unit[0], part=unit[1])
    return time.perf_counter() - t0


def compile_kernels(formats=None, *, ops: bool = True, device: int | None = None,
                    jobs: int | None = None) -> dict[str, float]:
    """Compile cuep's kernels for one GPU before their first use, several at a time; seconds per unit.

    Each kernel file compiles the first time a call needs it (dispatch.cu one wire format at a time: 10-16 s on an
    H200 host, NVRTC), and the call waits. This compiles the units a program uses (:func:`runtime_units`) at once,
    in ``jobs`` threads (NVRTC releases the GIL), and fills CuPy's disk cache, so that later processes only load
    the binaries: run it before a notebook's first round, or in an image build (``python -m cuep --compile``).

    Args:
        formats: the dispatch wire formats to compile: a name, a sequence of names, or None for all four.
        ops: also compile :mod:`cuep.ops`' kernels (quantize, fused SwiGLU, self-tests).
        device: the GPU (None: the current device).
        jobs: threads (None: one per CPU core, at most one per unit).

    Returns:
        ``{unit: seconds}``, units named ``dispatch.cu[fp8]``, ``combine.cu``, ... (about 0 for a unit this process
        had already compiled).

    Raises:
        ValueError: an unknown format, before anything compiles.
        RuntimeError: a unit failed to compile (the first one named, its compiler error chained), raised once the
        other units are done; they stay compiled.
    """
    from concurrent.futures import ThreadPoolExecutor

    units = runtime_units(formats, ops)
    if device is None:
        import cupy

        device = cupy.cuda.Device().id
    n = max(1, min(len(units), jobs if jobs is not None else (os.cpu_count() or 1)))
    log.info("cuep: compiling %d kernel units for device %d, %d at a time ...", len(units), device, n)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=n, thread_name_prefix="cuep-compile") as pool:
        futures = [(unit, pool.submit(_compile_unit, unit, device)) for unit in units]
    times, errors = {}, []
    for unit, fut in futures:
        try:
            times[unit_name(*unit)] = fut.result()
        except Exception as e:  # noqa: BLE001 (raised below, after every unit has finished)
            errors.append((unit_name(*unit), e))
    if errors:
        name, err = errors[0]
        raise RuntimeError(f"cuep.compile_kernels: {name} failed ({len(errors)} of {len(units)} units failed)") \
            from err
    log.info("cuep: %d kernel units ready on device %d in %.1f s", len(units), device, time.perf_counter() - t0)
    return times


def function(filename: str, name: str, name_expressions: tuple[str, ...] = (), defines: tuple[str, ...] = ()):
    """A kernel of :func:`module` by name, from the part of the file that holds it (:func:`part_of`); cached:
    ``get_function`` builds a new object each call."""
    import cupy

    dev = cupy.cuda.Device().id
    key = (filename, dev, name, tuple(defines))
    fn = _functions.get(key)
    if fn is None:
        fn = module(filename, name_expressions, defines, part_of(filename, name)).get_function(name)
        _functions[key] = fn
    return fn


_SMEM_WITHOUT_OPT_IN = 48 << 10  # shared memory (static + dynamic) a block gets without opting in
_smem_allowed: dict[int, int] = {}


def allow_dynamic_smem(fn, smem: int) -> None:
    """Let kernel ``fn`` (a ``cupy.RawKernel`` from :func:`function`) launch with ``smem`` bytes of dynamic shared
    memory: opts in (``max_dynamic_shared_size_bytes``) once ``smem`` plus the kernel's static shared memory passes
    the 48 KiB a block gets by default; remembered per kernel object, so the driver is asked once per size."""
    key = id(fn)  # function() caches its kernels for the process, so the id stays theirs
    allowed = _smem_allowed.get(key)
    if allowed is None:
        allowed = _SMEM_WITHOUT_OPT_IN - fn.shared_size_bytes
    if smem > allowed:
        fn.max_dynamic_shared_size_bytes = smem
        allowed = smem
    _smem_allowed[key] = allowed


# ---- prepared launches (the host cost of a call) ------------------------------------------------------------------
# struct codes of a kernel argument, each in its own 8-byte slot: P a device pointer (int), q int64, Q uint64,
# i int32, f float32 (4-byte values padded to the slot; the driver reads sizeof(param) bytes from each slot)
_SLOT_CODES = {"P": "Q", "q": "q", "Q": "Q", "i": "i4x", "f": "f4x"}


def slot_struct(sig: str) -> struct.Struct:
    """The packing of a kernel's scalar / pointer arguments, one 8-byte slot each, ``sig`` one letter per
    argument (P pointer, q int64, Q uint64, i int32, f float32)."""
    return struct.Struct("<" + "".join(_SLOT_CODES[c] for c in sig))


class PreparedLaunch:
    """One kernel of the current device launched with a fixed block size and dynamic shared memory, its
    arguments packed into a parameter buffer allocated once (no per-call allocation, no CuPy argument
    processing): ``cuLaunchKernel`` copies the parameters when it is called, so the buffer is reused at once.

    Args:
        fn: a ``cupy.RawKernel`` from :func:`function` (its shared memory already allowed: :func:`allow_dynamic_smem`).
        block, smem: threads per block, dynamic shared memory bytes.
        size: bytes of the parameter buffer (zero-filled; :meth:`write` puts the fixed bytes in).
        arg_offsets: where each kernel parameter starts in the buffer (one entry per parameter of the C signature).
        pack: packs one call's values into the buffer at ``pack_offset``.
    """

    __slots__ = ("kernel", "func", "block", "smem", "raw", "argv", "argv_ptr", "pack", "pack_offset", "call",
                 "call_offset", "dependent")

    def __init__(self, fn, block: int, smem: int, size: int, arg_offsets, pack: struct.Struct, pack_offset: int = 0):
        self.kernel = fn  # keeps the module (and so the CUfunction) loaded
        self.func = fn.kernel.ptr  # the CUfunction of the current device
        self.block, self.smem = int(block), int(smem)
        self.raw = (ctypes.c_char * max(8, size))()
        base = ctypes.addressof(self.raw)
        self.argv = (ctypes.c_void_p * len(arg_offsets))(*(base + o for o in arg_offsets))
        self.argv_ptr = ctypes.addressof(self.argv)
        self.pack, self.pack_offset = pack, pack_offset
        self.call, self.call_offset = pack, pack_offset
        self.dependent = None  # a DependentLaunch: launched as a programmatic dependent (make_dependent)

    def make_dependent(self, grid: int) -> None:
        """Launch this kernel from now on as a programmatic dependent of the kernel before it in the stream
        (:class:`DependentLaunch`, ``grid`` blocks): only for a kernel that runs ``griddepcontrol.wait`` before it
        touches global memory (``await_previous_grid`` in ``cuda_src/common.cuh``)."""
        self.dependent = DependentLaunch(self, grid)

    def set_call(self, call: struct.Struct, call_offset: int) -> None:
        """The part of the buffer that changes per call (:meth:`launch_call`); the rest stays as packed."""
        self.call, self.call_offset = call, call_offset

    def write(self, offset: int, data: bytes) -> None:
        """Fixed bytes of every launch (e.g. a by-value struct's constant part)."""
        self.raw[offset:offset + len(data)] = data

    def __call__(self, grid: int, *values) -> None:
        """Launch ``grid`` blocks on the current stream with ``values`` packed (in the order of ``pack``)."""
        self.pack.pack_into(self.raw, self.pack_offset, *values)
        _launch_raw(self.func, grid, self.block, self.smem, self.argv_ptr, None, -1, self.dependent)

    def launch_on(self, stream: int, grid: int, *values) -> None:
        """:meth:`__call__` on the stream handle ``stream`` instead of CuPy's current stream (a torch call's)."""
        self.pack.pack_into(self.raw, self.pack_offset, *values)
        _launch_raw(self.func, grid, self.block, self.smem, self.argv_ptr, stream, -1, self.dependent)

    def launch_call(self, grid: int, *values) -> None:
        """Launch with only the call's span repacked (:meth:`set_call`; one full :meth:`__call__` or :meth:`write`
        first puts the fixed values after it): one ``pack_into`` of ``values``."""
        self.call.pack_into(self.raw, self.call_offset, *values)
        _launch_raw(self.func, grid, self.block, self.smem, self.argv_ptr, None, -1, self.dependent)

    def launch_call_on(self, stream: int, grid: int, *values) -> None:
        """:meth:`launch_call` on the stream handle ``stream`` instead of CuPy's current stream (a torch call's)."""
        self.call.pack_into(self.raw, self.call_offset, *values)
        _launch_raw(self.func, grid, self.block, self.smem, self.argv_ptr, stream, -1, self.dependent)


# ---- programmatic dependent launch ----------------------------------------------------------------------------------
# cuLaunchKernelEx's CUlaunchConfig (cuda.h): grid x y z, block x y z, dynamic shared bytes, (pad) stream, attribute
# array, attribute count; and one CUlaunchAttribute: id, (pad) value (a 64-byte union; this attribute's is an int)
_LAUNCH_CONFIG = struct.Struct("<7I4xQQI4x")
_LAUNCH_ATTRIBUTE = struct.Struct("<I4xi60x")
_CONFIG_STREAM = struct.Struct("<Q")  # the config's stream field, at _CONFIG_STREAM_OFFSET
_CONFIG_STREAM_OFFSET = 32
_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
_launch_ex: list = []  # [libcuda's cuLaunchKernelEx], bound on first use


class DependentLaunch:
    """A :class:`PreparedLaunch` as a programmatic dependent launch (compute capability 9.0): ``cuLaunchKernelEx``
    with programmatic stream serialization, so the kernel may be scheduled while the kernel before it in the stream
    finishes (that kernel's blocks have all exited, or run ``griddepcontrol.launch_dependents``); the kernel itself
    waits for that one (``griddepcontrol.wait``) before it touches global memory. A decode-size round then starts
    about a microsecond earlier. The launch configuration is built once; a call writes its stream and launches with
    the same four arguments (ctypes objects made once)."""

    __slots__ = ("grid", "raw", "args", "call")

    def __init__(self, launch: PreparedLaunch, grid: int):
        size = _LAUNCH_CONFIG.size
        self.grid = int(grid)
        self.raw = (ctypes.c_char * (size + _LAUNCH_ATTRIBUTE.size))()
        base = ctypes.addressof(self.raw)
        _LAUNCH_CONFIG.pack_into(self.raw, 0, self.grid, 1, 1, launch.block, 1, 1, launch.smem, 0, base + size, 1)
        _LAUNCH_ATTRIBUTE.pack_into(self.raw, size, _PROGRAMMATIC_STREAM_SERIALIZATION, 1)
        # cuLaunchKernelEx(config, function, kernel parameters, extra): the driver function is bound at the first
        # launch (a Buffer assembled without a GPU, in the CPU tests, never launches)
        self.args = (ctypes.c_void_p(base), ctypes.c_void_p(launch.func), ctypes.c_void_p(launch.argv_ptr), None)
        self.call = None


def _driver_function(name: str):
    """A CUDA driver API function by name, through ctypes (the library CuPy loaded), returning its CUresult."""
    for lib in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            fn = getattr(ctypes.CDLL(lib), name)
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_int
        return fn
    raise RuntimeError(f"cuep: the CUDA driver library has no {name}")


def _launch_dependent(dep: DependentLaunch, grid: int, stream: int) -> None:
    """:class:`DependentLaunch` ``dep`` on ``stream`` (a handle); raises CuPy's ``CUDADriverError`` on failure."""
    if grid != dep.grid:
        dep.grid = grid
        struct.pack_into("<I", dep.raw, 0, grid)
    _CONFIG_STREAM.pack_into(dep.raw, _CONFIG_STREAM_OFFSET, stream)
    call = dep.call
    if call is None:
        if not _launch_ex:
            _launch_ex.append(_driver_function("cuLaunchKernelEx"))
        call = dep.call = functools.partial(_launch_ex[0], *dep.args)
    status = call()
    if status and _ensure_context():  # (no context current in this thread: as _launch_raw)
        status = call()
    if status:
        raise _cuda[2](status)


_cuda = None  # (driver.launchKernel, cupy.cuda.get_current_stream, CUDADriverError), bound on first launch


def _launch_raw(func: int, grid: int, block: int, smem: int, argv_ptr: int, stream: int | None = None,
                device: int = -1, dependent: DependentLaunch | None = None) -> None:
    """``cuLaunchKernel`` on ``stream`` (a handle; None: CuPy's current stream of ``device``, which must be the
    current device: a caller that already asked which one saves CuPy asking the runtime again; -1: ask);
    ``dependent`` (the launch's :class:`DependentLaunch`, if it has one): the same launch as a programmatic
    dependent, through ``cuLaunchKernelEx``."""
    global _cuda
    if _cuda is None:
        import cupy
        from cupy_backends.cuda.api import driver

        _cuda = (driver.launchKernel, cupy.cuda.get_current_stream, driver.CUDADriverError)
    launch, current, error = _cuda
    if stream is None:
        stream = current(device).ptr
    if dependent is not None:
        return _launch_dependent(dependent, grid, stream)
    try:
        launch(func, grid, 1, 1, block, 1, 1, smem, stream, argv_ptr, 0)
    except error:
        # CuPy's own launch makes the device's primary context current first; a thread that has not touched the
        # runtime yet has none, and the driver refuses the launch: make it current, launch again (once)
        if not _ensure_context():
            raise
        launch(func, grid, 1, 1, block, 1, 1, smem, stream, argv_ptr, 0)


def _ensure_context() -> bool:
    """Make the current device's primary context current if no context is; True if that was needed."""
    import cupy
    from cupy_backends.cuda.api import driver

    if driver.ctxGetCurrent():
        return False
    cupy.cuda.runtime.setDevice(cupy.cuda.runtime.getDevice())
    cupy.cuda.runtime.free(0)  # the runtime initialises and binds the primary context
    return True


def enable_compile_log() -> None:
    """Print cuep's one-line compile messages to stderr (the default; ``CUEP_LOG=0`` turns them off)."""
    if not log.handlers:
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(h)
    log.setLevel(logging.INFO)


if os.environ.get("CUEP_LOG", "1") != "0":  # CUEP_LOG=0 silences the first-compile lines
    enable_compile_log()
