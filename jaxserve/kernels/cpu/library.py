"""jaxserve's C++ CPU kernels: built once per machine into one library, loaded and registered with XLA.

`attention.cc` (paged attention, `attention.py`) and `matmul.cc` (matmuls of a few rows,
`matmul.py`) replace XLA's CPU code where it runs far below the machine's floors. They are compiled with the
machine's C++ compiler on first use (a few seconds) into `~/.cache/jaxserve/kernels`, keyed by the sources, the
flags, the compiler, jaxlib and the CPU, because they are built for this CPU's instruction set. Where no compiler
works, `available()` warns once and the model keeps XLA's code.

The sources pick their vector width and register blocking from the compiler's macros (`vec.h`): the default
build (`-march=native`) gets AVX-512, AVX2 or the portable code as this CPU has them; `VARIANTS` names builds for
an instruction set other than this CPU's best (tests build and run each), and `isa()` says what was loaded.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import jax

logger = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(name) for name in ("attention.cc", "matmul.cc",
                                                                    "matmul_int8.cc"))
# included by the sources: part of the build's key
HEADERS = tuple(Path(__file__).with_name(name) for name in ("attention_rows.h", "attention_tile.h",
                                                                    "pool.h", "vec.h"))
# XLA custom-call target -> the handler symbol the library exports for it
TARGETS = {"jaxserve_paged_attention": "JaxservePagedAttention",
           "jaxserve_quantized_paged_attention": "JaxserveQuantizedPagedAttention", "jaxserve_matmul": "JaxserveMatmul",
           "jaxserve_matmul_nt": "JaxserveMatmulNT", "jaxserve_matmul_int8": "JaxserveMatmulInt8",
           "jaxserve_grouped_matmul": "JaxserveGroupedMatmul"}
_X86 = platform.machine().lower() in ("x86_64", "amd64")
BASE_FLAGS = ("-O3", "-ffast-math", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC")
# Target flags per build: "native" is this CPU's own; "avx2" (AVX2 + FMA, no AVX-512) and "portable" (plain
# vectors, on x86 baseline SSE2) run on this CPU too where it has those, so any machine can test them.
VARIANTS = {
    # x86 only: lets the auto-vectorised loops (the exponentials) use whole AVX-512 registers where there are some
    "native": ("-march=native",) + (("-mprefer-vector-width=512",) if _X86 else ()),
    "avx2": ("-march=haswell",),
    "portable": (("-march=x86-64",) if _X86 else ()) + ("-DJAXSERVE_PORTABLE",),
}
FLAGS = BASE_FLAGS + VARIANTS["native"]
CACHE_DIR = Path("~/.cache/jaxserve/kernels")
# The library this process registered with XLA (one at most: XLA keeps a target's first registration).
_loaded: ctypes.CDLL | None = None
_loaded_path: Path | None = None


def _cpu_identity() -> str:
    """The CPU's model and instruction-set flags: a kernel built with -march=native runs only where they match."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [line for line in lines if line.startswith(("model name", "flags", "Features", "CPU part"))]
    return "\n".join(dict.fromkeys(keep))


def _compiler() -> str:
    for name in ("c++", "g++", "clang++"):
        path = shutil.which(name)
        if path:
            return path
    raise FileNotFoundError("no C++ compiler (c++, g++ or clang++) on PATH")


def build(cache_dir: Path = CACHE_DIR, variant: str = "native") -> Path:
    """Compile the kernels for this machine (`variant`: a key of VARIANTS) unless a build with the same key exists;
    return the library's path."""
    flags = BASE_FLAGS + VARIANTS[variant]
    cxx = _compiler()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256("\0".join([*(src.read_text() for src in SOURCES + HEADERS), " ".join(flags), version,
                                    jax.__version__, _cpu_identity()]).encode()).hexdigest()[:16]
    cache_dir = cache_dir.expanduser()
    lib = cache_dir / f"cpu_kernels-{key}.so"
    if lib.exists():
        return lib
    cache_dir.mkdir(parents=True, exist_ok=True)
    _compile_and_link(cxx, flags, lib)
    return lib


def _compile_and_link(cxx: str, flags: tuple[str, ...], lib: Path) -> None:
    """Each source into an object, side by side (one compiler per core), then one link into `lib`, logging each
    step as n of m (progress records: `jaxserve.core.progress`)."""
    task = "building jaxserve's C++ CPU kernels (once per machine)"
    total = len(SOURCES) + 1
    logger.info("%s with %s into %s (%d sources)", task, cxx, lib.parent, len(SOURCES),
                extra={"progress": (task, 0, total)})  # core.progress.step, which this layer cannot import
    t0 = time.monotonic()
    compile_flags = [f for f in flags if f != "-shared"]
    with tempfile.TemporaryDirectory(dir=lib.parent) as work:
        objects = [Path(work) / f"{src.stem}.o" for src in SOURCES]

        def compile_one(src: Path, obj: Path) -> Path:
            subprocess.run([cxx, *compile_flags, f"-I{jax.ffi.include_dir()}", "-c", str(src), "-o", str(obj)],
                           capture_output=True, text=True, check=True)
            return src

        with ThreadPoolExecutor(max_workers=max(1, min(len(SOURCES), os.cpu_count() or 1))) as pool:
            futures = [pool.submit(compile_one, src, obj) for src, obj in zip(SOURCES, objects, strict=True)]
            for done, future in enumerate(as_completed(futures), 1):
                logger.info("%s: %s compiled (%d of %d)", task, future.result().name, done, total,
                            extra={"progress": (task, done, total)})
        tmp = Path(work) / lib.name
        subprocess.run([cxx, *flags, *map(str, objects), "-o", str(tmp)], capture_output=True, text=True, check=True)
        os.replace(tmp, lib)  # atomic: concurrent builders (test workers) each publish a whole library
    logger.info("%s: linked, built in %.1f s", task, time.monotonic() - t0, extra={"progress": (task, total, total)})


def _first_error(stderr: str) -> str:
    """The compiler's first error line (its last line is often a caret under source), else its last line."""
    lines = stderr.strip().splitlines()
    return next((line for line in lines if "error" in line), lines[-1] if lines else "")


def load(cache_dir: Path = CACHE_DIR, variant: str = "native") -> bool:
    """Build (or find) the kernels, load them and register them with XLA; False, with a warning, where they cannot
    be built. Call it through `available()`, or once before it (a test's driver loading another variant): XLA
    refuses a second registration of a target from another build."""
    global _loaded, _loaded_path
    try:
        path = build(cache_dir, variant)
        lib = ctypes.cdll.LoadLibrary(str(path))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = _first_error(e.stderr) if isinstance(e, subprocess.CalledProcessError) and e.stderr else str(e)
        logger.warning("jaxserve's CPU kernels are unavailable (%s); using XLA's attention and matmuls", detail)
        return False
    for target, symbol in TARGETS.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    lib.JaxserveKernelIsa.restype = ctypes.c_char_p
    _loaded, _loaded_path = lib, path
    return True


@functools.cache
def available() -> bool:
    """Whether the kernels are built and registered with XLA (tried once per process, unless loaded already)."""
    return _loaded is not None or load()


def isa() -> str | None:
    """The instruction set the registered kernels were built for ("avx512", "avx2" or "portable"), None without
    kernels."""
    return _loaded.JaxserveKernelIsa().decode() if available() and _loaded is not None else None


def machine_isa() -> str:
    """The widest instruction set of this CPU's that the kernels have a variant for, from its flags: what a native
    build picks ("avx512", "avx2" or "portable")."""
    flags = {f for line in _cpu_identity().splitlines() if line.startswith(("flags", "Features"))
             for f in line.partition(":")[2].split()}
    if _X86 and "avx512f" in flags:
        return "avx512"
    return "avx2" if _X86 and {"avx2", "fma"} <= flags else "portable"


def library_path() -> Path | None:
    """The registered library's file, None without kernels: what is measured of it is cached beside it."""
    return _loaded_path if available() else None
