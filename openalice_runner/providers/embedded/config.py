"""The `type: local` entry of a routing file, apart from the provider so that reading a routing file
never loads torch (providers/local.py imports the engine)."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from openalice_runner.providers.wrappers.admission import AdmissionLimits


class EmbeddedConfig(AdmissionLimits):
    model_config = ConfigDict(extra="forbid")

    type: Literal["local"]
    model: str | None = None  # None: the default SmolLM2-135M-Instruct; or a HF folder / .gguf path
    dtype: Literal["bf16", "fp32"] = "bf16"
    # prompt rows with bf16 activations on the CPU's bf16 dot products (engine/prefill_choice.py):
    # auto where the CPU has AVX512-BF16 and the weights are bf16; decode rows keep fp32 bits
    prefill: Literal["auto", "bf16", "fp32"] = "auto"
    # one short constrained call at start-up (EmbeddedProvider.warm_up) so that the first request does
    # not pay llguidance's and the kernels' first-use costs; null: on, except for tiny_random
    warm_up: bool | None = None
    tiny_random: bool = False  # a tiny random model with the real tokenizer (tests, overhead benchmarks)
    threads: int | None = Field(default=None, ge=1)
    # requests the engine decodes together (continuous batching); 1 runs them one at a time
    max_batch: int = Field(default=8, ge=1, le=256)
    # a prompt that starts like a finished request's tokens (an agent loop resending its
    # history) prefills only the rest; with a conversation id, the history re-rendered is split
    # into the tokens its last call held (engine/histories.py)
    prefix_reuse: bool = True
    # the batching engine's KV cache at most, in MiB; a request that would take it past waits for
    # running ones to finish. The default keeps `serve` on the default model under 1.5 GiB of RSS
    # (docs/batching.md); null: unbounded
    kv_cache_mib: int | None = Field(default=384, ge=16)
    max_tokens_default: int = Field(default=256, ge=1)
    # max_in_flight / max_queue (AdmissionLimits): the admission gate in front of this provider.
