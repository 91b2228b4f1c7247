"""An SGLang pool's launch settings (routing file, `pools.P.launch`), and the checks that need only them.

The routing file owns each pool's deployment: its replicas and every flag its servers are launched
with. `openalice-runner sglang args` turns them into one command line (providers/pools/sglang/args.py), adding
what only the policy knows: the adaptive pool's per-batch step candidates. Names and constraints follow
SGLang 0.5.23's `server_args` (checked with its own parser in tests/policies/test_sglang_flags.py).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from openalice_runner.config_files.models import StrictModel
from openalice_runner.speculation import MAX_GAMMA, SpecMethod

Algorithm = Literal["EAGLE3", "EAGLE", "NGRAM", "NONE"]

# The speculation method each algorithm runs, and the policy methods a pool of it can serve
# (`off` everywhere: adaptive steps 0, or no speculation).
METHOD_OF: dict[str, SpecMethod] = {"EAGLE3": "eagle", "EAGLE": "eagle", "NGRAM": "ngram", "NONE": "off"}
SERVES: dict[str, frozenset[str]] = {a: frozenset({m, "off"}) for a, m in METHOD_OF.items()}


class NgramLaunch(StrictModel):
    """SGLang NGRAM knobs (`--speculative-ngram-*`); omitted ones keep SGLang's defaults."""

    min_bfs_breadth: int | None = Field(None, ge=1)
    max_bfs_breadth: int | None = Field(None, ge=1)
    match_type: Literal["BFS", "PROB"] | None = None
    max_trie_depth: int | None = Field(None, ge=1)
    capacity: int | None = Field(None, ge=1)


class SGLangLaunch(StrictModel):
    """The flags a pool's servers are launched with (`--speculative-*` and serving flags)."""

    algorithm: Algorithm = "NONE"  # --speculative-algorithm (NONE: no speculation)
    draft_model_path: str | None = None  # --speculative-draft-model-path (the EAGLE head)
    # --speculative-num-steps; absent: from the rules routed to the pool (their largest γ, or for
    # an adaptive pool the middle candidate)
    num_steps: int | None = Field(None, ge=1, le=MAX_GAMMA)
    eagle_topk: int | None = Field(None, ge=1)  # --speculative-eagle-topk
    # --speculative-num-draft-tokens; absent: num_steps + 1 (EAGLE), the rules' largest γ + 1 (NGRAM)
    num_draft_tokens: int | None = Field(None, ge=2)
    adaptive: bool = False  # --speculative-adaptive (EAGLE/EAGLE3 with topk 1 only)
    adaptive_config_path: str | None = None  # --speculative-adaptive-config: where its JSON goes
    ngram: NgramLaunch | None = None
    # --tool-call-parser (e.g. llama3, qwen25): SGLang parses tool calls out of the text only with
    # it, so a pool that serves tool_call turns needs one; --reasoning-parser likewise for
    # reasoning_content (e.g. deepseek-r1, qwen3). Names as SGLang's function_call / parser modules.
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    # --max-running-requests: the largest decode batch the server runs, so the largest batch size
    # an adaptive pool's slots ever see (SGLang picks the slot from its running requests)
    max_running_requests: int | None = Field(None, ge=1)
    extra_args: list[str] = []  # passed through verbatim after the generated flags

    @property
    def method(self) -> SpecMethod:
        return METHOD_OF[self.algorithm]

    @property
    def eagle(self) -> bool:
        return self.algorithm in ("EAGLE", "EAGLE3")


Problem = tuple[tuple, str, bool]  # (path under the launch mapping, message, at the key rather than the value)


def launch_problems(launch: SGLangLaunch) -> list[Problem]:
    """What is wrong with one pool's launch settings on their own."""
    problems: list[Problem] = []

    def at(field: str | None, message: str, key: bool = False) -> None:
        problems.append(((field,) if field else (), message, key))

    _applicability_problems(launch, at)
    _adaptive_problems(launch, at)
    _draft_shape_problems(launch, at)
    ng = launch.ngram
    if ng and ng.min_bfs_breadth and ng.max_bfs_breadth and ng.min_bfs_breadth > ng.max_bfs_breadth:
        problems.append((("ngram", "max_bfs_breadth"), "max_bfs_breadth < min_bfs_breadth", False))
    return problems


def _applicability_problems(launch: SGLangLaunch, at) -> None:
    """Settings given to a pool whose algorithm does not use them, or missing where it needs them."""
    eagle = launch.eagle
    if eagle and not launch.draft_model_path:
        at(None, f"{launch.algorithm} pool needs draft_model_path (the EAGLE head)")
    if not eagle:
        for f in ("draft_model_path", "eagle_topk"):
            if getattr(launch, f) is not None:
                at(f, f"{f} does not apply to a {launch.algorithm} pool", True)
    if launch.algorithm == "NONE":
        for f in ("num_steps", "num_draft_tokens", "ngram"):
            if getattr(launch, f) is not None:
                at(f, f"{f} does not apply to a pool without speculation", True)
    if launch.ngram is not None and launch.algorithm != "NGRAM":
        at("ngram", "ngram options only apply to an NGRAM pool", True)


def _adaptive_problems(launch: SGLangLaunch, at) -> None:
    """SGLang's adaptive speculation: what it needs and what it refuses."""
    if launch.adaptive and launch.max_running_requests is None:
        at(
            None,
            "an adaptive pool needs max_running_requests: the largest batch its slots see "
            "(SGLang's own default depends on GPU memory)",
        )
    if launch.adaptive:
        if not launch.eagle:
            at("adaptive", "SGLang's adaptive speculation supports EAGLE/EAGLE3 only")
        elif launch.eagle_topk not in (None, 1):
            at("eagle_topk", "SGLang's adaptive speculation needs eagle_topk 1")
        if launch.num_draft_tokens is not None:
            at("num_draft_tokens", "with adaptive, SGLang sets num_draft_tokens to num_steps + 1", True)
    elif launch.adaptive_config_path is not None:
        at("adaptive_config_path", "adaptive_config_path needs adaptive: true", True)


def _draft_shape_problems(launch: SGLangLaunch, at) -> None:
    """An EAGLE chain's or tree's size against its steps, as SGLang derives them."""
    eagle, topk, steps = launch.eagle, launch.eagle_topk or 1, launch.num_steps
    if eagle and topk == 1 and steps is not None and launch.num_draft_tokens not in (None, steps + 1):
        at("num_draft_tokens", f"with eagle_topk 1 SGLang uses num_draft_tokens = num_steps + 1 = {steps + 1}")
    if eagle and topk > 1 and launch.num_draft_tokens is None:
        at(None, "eagle_topk > 1 builds a draft tree: set num_draft_tokens (its size)")
