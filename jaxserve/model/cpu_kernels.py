"""The CPU paged-attention kernel (`cpu_attention.cc`): built once per machine, loaded and called through jax.ffi.

XLA's CPU code for a few query rows against a long paged history runs at several times the KV read and on one
core; the kernel reads each key once for all of a KV head's query rows and spreads (sequence, KV head) pairs over
XLA's intra-op threads. It is compiled with the machine's C++ compiler on first use (a few seconds) into
`~/.cache/jaxserve/kernels`, keyed by the source, the flags, the compiler, jaxlib and the CPU, because it is
built for this CPU's instruction set. Where no compiler works, `available()` warns once and `paged_attention`
keeps its jnp path.
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
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.model.metadata import AttentionMetadata

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_attention.cc")
TARGET = "jaxserve_paged_attention"
SYMBOL = "JaxservePagedAttention"
FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC") + (
    # x86 only: lets the auto-vectorised loops (the exponentials) use whole AVX-512 registers where there are some
    ("-mprefer-vector-width=512",) if platform.machine().lower() in ("x86_64", "amd64") else ())
HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)  # the sizes `AttendAny` in cpu_attention.cc is built for
CACHE_DIR = Path("~/.cache/jaxserve/kernels")


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


def build(cache_dir: Path = CACHE_DIR) -> Path:
    """Compile the kernel for this machine unless a build with the same key exists; return the library's path."""
    cxx = _compiler()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), " ".join(FLAGS), version, jax.__version__,
                                    _cpu_identity()]).encode()).hexdigest()[:16]
    cache_dir = cache_dir.expanduser()
    lib = cache_dir / f"cpu_attention-{key}.so"
    if lib.exists():
        return lib
    cache_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache_dir)
    os.close(fd)
    try:
        subprocess.run([cxx, *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", tmp],
                       capture_output=True, text=True, check=True)
        os.replace(tmp, lib)  # atomic: concurrent builders (test workers) each publish a whole library
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


def load(cache_dir: Path = CACHE_DIR) -> bool:
    """Build (or find) the kernel, load it and register it with XLA; False, with a warning, where it cannot be
    built. Call it through `available()`: XLA refuses a second registration of the target from another build."""
    try:
        lib = ctypes.cdll.LoadLibrary(str(build(cache_dir)))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = e.stderr.strip().splitlines()[-1] if isinstance(e, subprocess.CalledProcessError) and e.stderr \
            else str(e)
        logger.warning("CPU attention kernel unavailable (%s); using the jnp attention", detail)
        return False
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(getattr(lib, SYMBOL)), platform="cpu")
    return True


@functools.cache
def available() -> bool:
    """Whether the kernel is built and registered with XLA (tried once per process)."""
    return load()


def supports(q: jax.Array, k_cache: jax.Array) -> bool:
    """Whether the kernel can take this call: float32 on a CPU, a head dimension it is built for."""
    return (jax.default_backend() == "cpu" and q.dtype == jnp.float32 and k_cache.dtype == jnp.float32
            and q.shape[-1] in HEAD_DIMS and available())


def cpu_paged_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, meta: AttentionMetadata,
                        scale: float, min_parallel_keys: int) -> jax.Array:
    """Causal attention of every sequence of the ragged batch (q [T, H, D], float32); zeros for padded rows.

    The kernel spreads its work over XLA's intra-op threads once the step's query rows x context reach
    `min_parallel_keys`; below that, waking a second thread costs more than it saves.
    """
    if not available():
        raise RuntimeError("the CPU attention kernel is not available on this machine (see the warning above)")
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(q, k_cache, v_cache, meta.page_table, meta.kv_lens, meta.cu_q_lens, meta.num_seqs,
                scale=np.float32(scale), min_parallel_keys=np.int64(min_parallel_keys))
