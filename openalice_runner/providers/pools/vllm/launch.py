"""A vLLM pool's launch settings (routing file, `pools.P.launch`), and the checks that need only them.

As for SGLang (sglang_launch.py), the routing file owns each pool's deployment; `openalice-runner
vllm args` turns it into the server's command line (providers/pools/vllm/args.py), adding what only the
policy knows: γ where the launch leaves it out and `num_speculative_tokens_per_batch_size` from the
batch ranges of the rules routed to the pool. Names follow vLLM 0.32's `EngineArgs` and
`SpeculativeConfig` (checked with its own parser in tests/policies/test_vllm_flags.py).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from openalice_runner.config_files.models import StrictModel
from openalice_runner.speculation import MAX_GAMMA, SpecMethod

# `--speculative-config` method (none: no speculation)
VLLMMethod = Literal["none", "ngram", "suffix", "eagle", "eagle3", "draft_model"]

METHOD_OF: dict[str, SpecMethod] = {
    "none": "off",
    "ngram": "ngram",
    "suffix": "suffix",
    "eagle": "eagle",
    "eagle3": "eagle",
    "draft_model": "draft",
}
SERVES: dict[str, frozenset[str]] = {m: frozenset({p, "off"}) for m, p in METHOD_OF.items()}
NEEDS_MODEL = frozenset({"eagle", "eagle3", "draft_model"})
EMBEDDED_MODEL = "embedded"  # model_path: resolved by `vllm args` (providers/pools/vllm/cli.py)


class VLLMLaunch(StrictModel):
    """The flags a pool's vLLM servers are launched with."""

    # --model (default: the provider's `model`, served under that name); EMBEDDED_MODEL: the embedded
    # engine's default model as the HF folder it converts it to (its path differs per install)
    model_path: str | None = None
    method: VLLMMethod = "none"  # --speculative-config method
    draft_model: str | None = None  # speculative model: the EAGLE head or the draft model
    # num_speculative_tokens; absent: the largest γ of the rules routed to the pool
    num_speculative_tokens: int | None = Field(None, ge=1, le=MAX_GAMMA)
    prompt_lookup_min: int | None = Field(None, ge=1)  # n-gram lookup bounds (absent: the rules' options)
    prompt_lookup_max: int | None = Field(None, ge=1)
    # num_speculative_tokens_per_batch_size from the rules' batch ranges (false: one γ throughout)
    per_batch_size: bool = True
    max_num_seqs: int | None = Field(None, ge=1)  # --max-num-seqs: the largest running batch
    max_model_len: int | None = Field(None, ge=16)
    dtype: str | None = None  # --dtype (bfloat16 on CPU)
    enable_prefix_caching: bool = True
    # --enable-auto-tool-choice --tool-call-parser NAME (e.g. hermes): vLLM answers tool calls
    # as text without it, and refuses tool_choice "auto"
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    # --chat-template: a template that renders `tools` in the format the parser reads (a model
    # whose own template ignores tools, e.g. SmolLM2, needs one for tool turns)
    chat_template: str | None = None
    extra_args: list[str] = []  # passed through verbatim after the generated flags

    @property
    def spec_method(self) -> SpecMethod:
        return METHOD_OF[self.method]


Problem = tuple[tuple, str, bool]  # (path under the launch mapping, message, at the key rather than the value)


def launch_problems(launch: VLLMLaunch) -> list[Problem]:
    """What is wrong with one pool's launch settings on their own."""
    problems: list[Problem] = []
    at = lambda field, message, key=False: problems.append(((field,) if field else (), message, key))  # noqa: E731
    if launch.method in NEEDS_MODEL and not launch.draft_model:
        at(None, f"a {launch.method} pool needs draft_model (the speculative model vLLM loads)")
    if launch.method not in NEEDS_MODEL and launch.draft_model is not None:
        at("draft_model", f"draft_model does not apply to a {launch.method} pool", True)
    if launch.method == "none":
        for f in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            if getattr(launch, f) is not None:
                at(f, f"{f} does not apply to a pool without speculation", True)
    elif launch.method != "ngram":
        for f in ("prompt_lookup_min", "prompt_lookup_max"):
            if getattr(launch, f) is not None:
                at(f, f"{f} only applies to an ngram pool", True)
    lo, hi = launch.prompt_lookup_min, launch.prompt_lookup_max
    if lo is not None and hi is not None and lo > hi:
        at("prompt_lookup_max", "prompt_lookup_max < prompt_lookup_min")
    return problems
