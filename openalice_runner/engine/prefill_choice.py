"""Whether prompt rows run with bf16 activations (bf16 prefill), chosen once at start-up.

A prefill chunk is arithmetic-bound. CPUs with bf16 dot products (AVX512-BF16 `vdpbf16ps`, which
AMX machines have too) do twice the multiply-adds per instruction on bf16 inputs, so prompt rows
run their linears with activations rounded to bf16 (csrc/linear.c; on AMX tiles where the CPU has
them, several times the dot products' rate). Decode, verify and tree rows
never do: they keep the fp32 kernel's bits, so speculation stays exact. On CPUs without them
(AVX2-only) bf16 arithmetic is emulated and slower than fp32, so `auto` keeps fp32 there.

Modes: `auto` (bf16 where the weights are bf16 and the kernels run the CPU's bf16 dot products),
`bf16` (always; emulated in fp32 on bf16-rounded inputs where the CPU lacks them: for tests, and
slow), `fp32` (never). `OPENALICE_PREFILL` overrides the mode where the caller passes none.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from openalice_runner.engine.cpu_kernels import CpuKernels

PREFILL_MODES = ("auto", "bf16", "fp32")
PREFILL_ENV = "OPENALICE_PREFILL"


@dataclass(frozen=True)
class PrefillChoice:
    mode: str  # what was asked for
    bf16: bool  # what prompt rows run
    reason: str  # why, in words (logged at start-up, shown by `generate --verbose`)


def cpu_bf16_flags() -> set[str]:
    """The CPU's bf16 features named in /proc/cpuinfo (avx512_bf16, amx_bf16); empty if unreadable."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return set()
    return flags & {"avx512_bf16", "amx_bf16"}


def resolve_mode(mode: str | None) -> str:
    """`mode`, or the environment's, or `auto`; ValueError naming the setting if unknown."""
    mode = mode or os.environ.get(PREFILL_ENV) or "auto"
    if mode not in PREFILL_MODES:
        raise ValueError(f"prefill must be one of {', '.join(PREFILL_MODES)}, got {mode!r}")
    return mode


def choose_prefill(mode: str | None, weight_dtype: torch.dtype, kernels: CpuKernels | None) -> PrefillChoice:
    mode = resolve_mode(mode)
    if mode == "fp32":
        return PrefillChoice(mode, False, "prefill: fp32 asked for")
    dot = kernels is not None and kernels.bf16_dot
    if mode == "bf16":
        how = "the CPU's bf16 dot products" if dot and weight_dtype == torch.bfloat16 else "emulated in fp32"
        return PrefillChoice(mode, True, f"prefill: bf16 asked for ({how})")
    capability = torch.backends.cpu.get_cpu_capability()
    if weight_dtype != torch.bfloat16:
        return PrefillChoice(mode, False, f"prefill auto: fp32, the weights are {weight_dtype}")
    if kernels is None:
        return PrefillChoice(mode, False, "prefill auto: fp32, the engine's CPU kernels are unavailable")
    if not dot:
        flags = ", ".join(sorted(cpu_bf16_flags())) or "none"
        return PrefillChoice(mode, False, f"prefill auto: fp32, no AVX512-BF16 dot products "
                                          f"(torch capability {capability}, bf16 flags: {flags})")
    how = "AMX tiles" if kernels.amx else "bf16 dot products"
    return PrefillChoice(mode, True, f"prefill auto: bf16 on the CPU's {how} (torch capability {capability})")
