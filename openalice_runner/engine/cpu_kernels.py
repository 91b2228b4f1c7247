"""The engine's own CPU kernels (csrc/), compiled once and loaded with ctypes.

- `linear`: matmuls for any number of rows on weights packed once at load: a verify pass over
  γ+1 rows costs about what a one-row decode costs (the premise of speculative decoding) on
  CPUs without bf16 arithmetic, and a prefill runs at arithmetic speed. Where the CPU has
  AVX-512, bf16 weights run a register tile twice as wide, with the same bits
  (`CpuKernels.wide`; `OPENALICE_NATIVE_AVX512=0` keeps the AVX2 tile). Prompt rows of a bf16
  prefill run on AVX512-BF16 dot products, or on AMX tiles where the CPU has them
  (`CpuKernels.amx`; `OPENALICE_NATIVE_AMX=0` keeps the dot products).
- `attention`: causal attention for ragged rows read straight from the KV cache, so one pass
  serves sequences of different lengths, each feeding its own number of tokens. Prompt rows run
  tiles of their own (`attention_prompt`: bf16 dot products, `attention_prompt_fp32`: fp32 on AVX2),
  whose bits depend on each row's position alone but differ from a decode row's.
- `add_rms_norm`, `silu_mul`, `rope_store`: a layer's small per-row steps, one call each
  instead of several torch ops (at a few rows per pass the dispatch costs more than the work).
- `argmax`: greedy choices over the logits of a pass, within a grammar's allowed tokens, without
  torch's masked copy (a verify pass of 12 rows spent about 5 ms there).

All give every row the same bits whatever the other rows are. They need x86-64 with AVX2 and
FMA and a C compiler (`cc`, or `$CC`); the shared object is cached under the runner's cache
folder, keyed by the source and flags, so it is built once (about a second). Where any of that
is missing, `cpu_kernels()` returns None and the engine uses torch's matmuls.
`OPENALICE_NATIVE_KERNELS=0` turns them off (for side-by-side benchmarks).
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
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from openalice_runner.engine.huge_pages import HugePageArena
    from openalice_runner.engine.tree import TreeMask

CSRC = Path(__file__).with_name("csrc")
SOURCES = [CSRC / name for name in ("linear.c", "attention.c", "rowwise.c", "argmax.c", "pool.c")]
HEADERS = [CSRC / name for name in ("amx.h", "pool.h", "vec.h")]
CFLAGS = ["-O3", "-mavx2", "-mfma", "-pthread", "-shared", "-fPIC"]
DISABLE_ENV = "OPENALICE_NATIVE_KERNELS"


@dataclass(frozen=True)
class PackedWeight:
    """A weight (N, K) in the linear kernel's panel layout (csrc/linear.c), N padded with zero
    rows to a multiple of 8."""

    data: torch.Tensor  # 1-D, bf16 or fp32
    n: int
    n_padded: int
    k: int

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype


@dataclass(frozen=True)
class CpuKernels:
    library: ctypes.CDLL
    path: Path

    @property
    def wide(self) -> bool:
        """Whether bf16 linears run the AVX-512 tile (same bits, twice the arithmetic); off
        with OPENALICE_NATIVE_AVX512=0, for side-by-side benchmarks."""
        return bool(self.library.linear_wide())

    @property
    def amx(self) -> bool:
        """Whether prompt rows (`linear_bf16_rows`) run on AMX tiles (the CPU has AMX-BF16 and
        Linux grants its state); off with OPENALICE_NATIVE_AMX=0, for side-by-side benchmarks."""
        return bool(self.library.linear_amx())

    @property
    def bf16_dot(self) -> bool:
        """Whether the CPU has AVX512-BF16 dot products (`linear_bf16_rows`)."""
        return bool(self.library.linear_bf16dp_supported())

    def pack(self, weight: torch.Tensor, arena: HugePageArena | None = None) -> PackedWeight:
        """The weight (N, K), bf16 or fp32, in the layout `linear` reads (a copy; packed once
        at load time, into `arena` where given: huge_pages.py says why)."""
        weight = weight.detach().contiguous()
        n, k = weight.shape
        n_padded = -(-n // 8) * 8
        if n_padded != n:
            weight = torch.cat([weight, weight.new_zeros(n_padded - n, k)])
        size = n_padded * k
        data = torch.empty(size, dtype=weight.dtype) if arena is None else arena.empty(size, weight.dtype)
        self.library.pack_weight(weight.data_ptr(), data.data_ptr(), n_padded, k, weight.dtype == torch.bfloat16)
        return PackedWeight(data, n, n_padded, k)

    def linear(self, x: torch.Tensor, weight: PackedWeight | torch.Tensor) -> torch.Tensor:
        """x (..., K) fp32 @ weight (N, K).T in fp32. `weight`: packed (`pack`), or a bf16 or
        fp32 (N, K) tensor, packed for this call."""
        if isinstance(weight, torch.Tensor):
            weight = self.pack(weight)
        x = x.contiguous()
        out = torch.empty(*x.shape[:-1], weight.n_padded, dtype=torch.float32)
        fn = self.library.linear_bf16 if weight.dtype == torch.bfloat16 else self.library.linear_f32
        fn(weight.data.data_ptr(), x.data_ptr(), out.data_ptr(), x.numel() // weight.k, weight.n_padded, weight.k)
        return out if weight.n == weight.n_padded else out[..., : weight.n].contiguous()

    def linear_bf16_rows(self, x: torch.Tensor, weight: PackedWeight) -> torch.Tensor:
        """x (..., K) rounded to bf16 @ a packed bf16 weight's (N, K).T, fp32 sums, on the CPU's
        bf16 dot products (csrc/linear.c: for prompt rows; each row's bits independent of the
        others', not those of `linear`). RuntimeError where the CPU lacks AVX512-BF16."""
        if weight.dtype != torch.bfloat16:
            raise ValueError(f"linear_bf16_rows needs a bf16 weight, got {weight.dtype}")
        x = x.contiguous()
        out = torch.empty(*x.shape[:-1], weight.n_padded, dtype=torch.float32)
        status = self.library.linear_bf16dp(
            weight.data.data_ptr(), x.data_ptr(), out.data_ptr(), x.numel() // weight.k, weight.n_padded, weight.k
        )
        if status == -1:
            raise RuntimeError("linear_bf16_rows: this CPU has no AVX512-BF16 dot products")
        if status == -2:
            raise MemoryError("linear_bf16_rows: no memory for the rows' bf16 copy or the AMX weight pairs")
        return out if weight.n == weight.n_padded else out[..., : weight.n].contiguous()

    def attention(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        row_slot: torch.Tensor,
        row_pos: torch.Tensor,
        scale: float,
        tree: TreeMask | None = None,
    ) -> torch.Tensor:
        """q (R, n_heads, D) fp32; keys/values (slots, n_kv_heads, max_len, D) fp32 or bf16,
        contiguous; row r attends keys 0..row_pos[r] of slot row_slot[r] (int64 tensors), or
        with `tree`, the keys its `TreeMask` leaves visible. -> (R, n_heads, D)."""
        q = q.contiguous()
        rows, n_heads, dim = q.shape
        out = torch.empty_like(q)
        status = self.library.attention(
            q.data_ptr(), keys.data_ptr(), values.data_ptr(), out.data_ptr(),
            row_slot.data_ptr(), row_pos.data_ptr(),
            None if tree is None else tree.visible_from.data_ptr(),
            None if tree is None else tree.bits.data_ptr(),
            rows, n_heads, keys.shape[1], dim, keys.shape[2], scale, keys.dtype == torch.bfloat16,
        )  # fmt: skip
        if status == -2:
            raise MemoryError("attention kernel: no memory for its row tiles")
        if status != 0:
            raise ValueError(
                f"attention kernel: unsupported shape heads={n_heads} kv={keys.shape[1]} dim={dim}"
            )
        return out

    def attention_prompt(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, row_slot: torch.Tensor,
                         row_pos: torch.Tensor, scale: float) -> torch.Tensor | None:
        """`attention` for prompt rows on the CPU's bf16 dot products (q and the softmax weights
        rounded to bf16, sums in fp32; csrc/attention.c), bf16 cache, no tree rows. None where
        the CPU or the shape does not allow it (the caller runs `attention`)."""
        if keys.dtype != torch.bfloat16:
            return None
        q = q.contiguous()
        rows, n_heads, dim = q.shape
        out = torch.empty_like(q)
        status = self.library.attention_prompt(
            q.data_ptr(), keys.data_ptr(), values.data_ptr(), out.data_ptr(), row_slot.data_ptr(),
            row_pos.data_ptr(), rows, n_heads, keys.shape[1], dim, keys.shape[2], scale,
        )  # fmt: skip
        if status == -2:
            raise MemoryError("attention_prompt kernel: no memory for its row tiles")
        return out if status == 0 else None

    def attention_prompt_fp32(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, row_slot: torch.Tensor,
                              row_pos: torch.Tensor, scale: float) -> torch.Tensor | None:
        """`attention` for prompt rows in fp32 tiles (csrc/attention.c): each row's bits depend on its
        position and the cache alone, as `attention`'s do, but are not the bits `attention` gives
        it; fp32 or bf16 cache, no tree rows. None where the shape does not allow it (the caller
        runs `attention`)."""
        q = q.contiguous()
        rows, n_heads, dim = q.shape
        out = torch.empty_like(q)
        status = self.library.attention_prompt_f32(
            q.data_ptr(), keys.data_ptr(), values.data_ptr(), out.data_ptr(), row_slot.data_ptr(),
            row_pos.data_ptr(), rows, n_heads, keys.shape[1], dim, keys.shape[2], scale, keys.dtype == torch.bfloat16,
        )  # fmt: skip
        if status == -2:
            raise MemoryError("attention_prompt_fp32 kernel: no memory for its row tiles")
        return out if status == 0 else None

    def add_rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None) -> torch.Tensor:
        """weight * x / rms(x) per row of x (R, H) fp32 contiguous; with `delta`, x += delta
        first, in place (the residual add)."""
        rows, dim = x.shape
        out = torch.empty_like(x)
        if delta is not None:
            delta = delta.contiguous()
        self.library.add_rms_norm(
            x.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(), out.data_ptr(),
            rows, dim, eps,
        )  # fmt: skip
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for gate_up (R, 2I) = [gate | up] fp32 contiguous -> (R, I)."""
        rows, width = gate_up.shape
        out = torch.empty(rows, width // 2, dtype=torch.float32)
        self.library.silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, width // 2)
        return out

    def rope_store(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, row_slot: torch.Tensor,
        row_pos: torch.Tensor, n_heads: int, n_kv_heads: int, keys: torch.Tensor, values: torch.Tensor,
        rope_pos: torch.Tensor | None = None,
    ) -> None:  # fmt: skip
        """Rotate the q and k heads of qkv (R, n_heads + 2·n_kv_heads, D) in place by each row's
        position (`rope_pos` where given, else `row_pos`; cos/sin tables (positions, D) fp32), and
        store each row's k and v in the cache (slots, n_kv_heads, max_len, D), fp32 or bf16, at
        (row_slot[r], row_pos[r])."""
        rows, _, dim = qkv.shape
        self.library.rope_store(
            qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), row_slot.data_ptr(), row_pos.data_ptr(),
            None if rope_pos is None else rope_pos.data_ptr(), rows, n_heads, n_kv_heads, dim, keys.data_ptr(), values.data_ptr(), keys.shape[2],
            keys.dtype == torch.bfloat16,
        )  # fmt: skip

    def argmax(self, logits: torch.Tensor, allowed: torch.Tensor | None = None) -> list[int]:
        """Each row's argmax of logits (R, V') fp32, first index on ties; with `allowed` (R, V)
        bool, V <= V', over the allowed tokens only (those past V never are; none allowed: 0)."""
        logits = logits.float().contiguous()
        rows, cols = logits.shape
        out = torch.empty(rows, dtype=torch.int64)
        if allowed is not None:
            allowed = allowed.to(torch.bool).contiguous()
            if allowed.shape[0] != rows:
                raise ValueError(f"argmax: {allowed.shape[0]} mask rows for {rows} rows of logits")
        self.library.argmax_rows(
            logits.data_ptr(), None if allowed is None else allowed.data_ptr(), rows, cols,
            0 if allowed is None else allowed.shape[1], out.data_ptr(),
        )  # fmt: skip
        return out.tolist()

    @staticmethod
    def rowwise_supports(hidden: int, intermediate: int, head_dim: int) -> bool:
        return hidden % 8 == 0 and intermediate % 8 == 0 and head_dim % 2 == 0

    @staticmethod
    def attention_supports(n_heads: int, n_kv_heads: int, head_dim: int) -> bool:
        group = n_heads // n_kv_heads
        return head_dim % 8 == 0 and head_dim <= 128 and group * n_kv_heads == n_heads and group <= 8

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


def cpu_kernels() -> CpuKernels | None:
    """The loaded kernels, building them on first use; None where they are unavailable."""
    return None if unavailable_reason() is not None else _load()[0]


@functools.cache
def _load() -> tuple[CpuKernels | None, str | None]:
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
        return None, f"building the CPU kernels failed: {exc.stderr.decode(errors='replace')[-500:]}"
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"building or loading the CPU kernels failed: {exc}"
    for name in ("linear_bf16", "linear_f32"):
        fn = getattr(library, name)
        fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3
        fn.restype = None
    library.linear_bf16dp.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3
    library.linear_bf16dp.restype = ctypes.c_int
    library.linear_bf16dp_supported.argtypes = []
    library.linear_bf16dp_supported.restype = ctypes.c_int
    library.pack_weight.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_int]
    library.pack_weight.restype = None
    library.linear_wide.argtypes = []
    library.linear_wide.restype = ctypes.c_int
    library.linear_amx.argtypes = []
    library.linear_amx.restype = ctypes.c_int
    library.attention.argtypes = [ctypes.c_void_p] * 8 + [ctypes.c_int64] * 5 + [ctypes.c_float, ctypes.c_int]
    library.attention.restype = ctypes.c_int
    library.attention_prompt.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 5 + [ctypes.c_float]
    library.attention_prompt.restype = ctypes.c_int
    library.attention_prompt_f32.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 5 + [ctypes.c_float, ctypes.c_int]
    library.attention_prompt_f32.restype = ctypes.c_int
    library.add_rms_norm.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2 + [ctypes.c_float]
    library.add_rms_norm.restype = None
    library.silu_mul.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2
    library.silu_mul.restype = None
    library.rope_store.argtypes = (
        [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 4 + [ctypes.c_void_p] * 2 + [ctypes.c_int64, ctypes.c_int]
    )
    library.rope_store.restype = None
    library.argmax_rows.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 3 + [ctypes.c_void_p]
    library.argmax_rows.restype = None
    library.pool_start.argtypes = [ctypes.c_int]
    library.pool_start.restype = ctypes.c_int
    # the kernels' own workers (csrc/pool.c says why not OpenMP), beside the calling thread
    library.pool_start(max(0, torch.get_num_threads() - 1))
    return CpuKernels(library, path), None


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _build() -> Path:
    from openalice_runner.engine.model_loading import cache_root

    source = b"".join(path.read_bytes() for path in SOURCES + HEADERS)
    compiler = _compiler()
    key = hashlib.sha256(source + " ".join([compiler or "", *CFLAGS]).encode()).hexdigest()[:16]
    folder = cache_root() / "kernels"
    target = folder / f"cpu-kernels-{key}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    # build beside the target and rename: concurrent first starts never load a half-written file
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".so")
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *CFLAGS, "-o", tmp, *map(str, SOURCES)], check=True, capture_output=True, timeout=120
        )
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target
