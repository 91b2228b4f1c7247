"""The engine's own small-M linear kernels (csrc/linear.c), compiled once and loaded with ctypes.

They make a verify pass over γ+1 rows cost about what a one-row decode costs, which is the
premise of speculative decoding, on CPUs without bf16 arithmetic (see csrc/linear.c). They
need x86-64 with AVX2 and FMA and a C compiler (`cc`, or `$CC`); the shared object is cached
under the runner's cache folder, keyed by the source and flags, so it is built once (about a
second). Where any of that is missing, `linear_kernels()` returns None and the engine uses
torch's matmuls. `OPENALICE_NATIVE_KERNELS=0` turns them off (for side-by-side benchmarks).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("csrc") / "linear.c"
CFLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"]
DISABLE_ENV = "OPENALICE_NATIVE_KERNELS"


@dataclass(frozen=True)
class LinearKernels:
    library: ctypes.CDLL
    path: Path

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x (..., K) fp32 @ weight (N, K).T in fp32; weight bf16 or fp32, contiguous."""
        x = x.contiguous()
        k = x.shape[-1]
        n = weight.shape[0]
        out = torch.empty(*x.shape[:-1], n, dtype=torch.float32)
        fn = self.library.linear_bf16 if weight.dtype == torch.bfloat16 else self.library.linear_f32
        fn(weight.data_ptr(), x.data_ptr(), out.data_ptr(), x.numel() // k, n, k)
        return out

    @staticmethod
    def supports(weight: torch.Tensor) -> bool:
        return (
            weight.dtype in (torch.bfloat16, torch.float32)
            and weight.dim() == 2
            and weight.shape[1] % 8 == 0
            and weight.is_contiguous()
        )


def unavailable_reason() -> str | None:
    """Why the kernels cannot be used here, or None where they can."""
    if os.environ.get(DISABLE_ENV, "1").lower() in ("0", "false", "no", "off"):
        return f"turned off by {DISABLE_ENV}"
    return _load()[1]


def linear_kernels() -> LinearKernels | None:
    """The loaded kernels, building them on first use; None where they are unavailable."""
    return None if unavailable_reason() is not None else _load()[0]


@functools.cache
def _load() -> tuple[LinearKernels | None, str | None]:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None, f"needs x86-64, this is {platform.machine()}"
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return None, "cannot read /proc/cpuinfo to check for AVX2 and FMA"
    if not {"avx2", "fma"} <= flags:
        return None, "the CPU lacks AVX2 or FMA"
    if _compiler() is None:
        return None, "no C compiler (cc, gcc or $CC) to build them"
    try:
        path = _build()
        library = ctypes.CDLL(str(path))
    except subprocess.CalledProcessError as exc:
        return None, f"building {SOURCE.name} failed: {exc.stderr.decode(errors='replace')[-500:]}"
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"building or loading {SOURCE.name} failed: {exc}"
    for name in ("linear_bf16", "linear_f32"):
        fn = getattr(library, name)
        fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3
        fn.restype = None
    return LinearKernels(library, path), None


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _build() -> Path:
    from openalice_runner.engine.model_loading import cache_root

    source = SOURCE.read_bytes()
    compiler = _compiler()
    key = hashlib.sha256(source + " ".join([compiler or "", *CFLAGS]).encode()).hexdigest()[:16]
    folder = cache_root() / "kernels"
    target = folder / f"linear-{key}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    # build beside the target and rename: concurrent first starts never load a half-written file
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".so")
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *CFLAGS, "-o", tmp, str(SOURCE)], check=True, capture_output=True, timeout=120
        )
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target
