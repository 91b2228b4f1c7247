"""The policy file's schema (pydantic v2): ordered rules, a required default, adaptive-γ knobs.

SGLang pools are deployments: the routing file defines them (replicas and launch settings); a rule
only names one (`pool:`), and `policy check --providers F` checks the two files together.

Field-level problems (unknown keys, wrong types, out-of-range numbers, missing fields) are caught here;
relations between fields and between rules are checked in `checks.py` and `analysis.py`, which
know where each value sits in the file. Strict mode: YAML already types its scalars, so `"5"`
is not silently accepted where an integer is meant.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field

from openalice_runner.config_files.models import StrictModel
from openalice_runner.drafter_options import OPTION
from openalice_runner.speculation import MAX_GAMMA, SpecMethod

Method = SpecMethod  # the policy file names the same methods the providers run

# Turn types the agent loop reports; any other name is allowed too (custom turn types).
KNOWN_TURN_TYPES = ("chat", "reasoning", "tool_call", "summarize", "code_edit", "rag")


class _Strict(StrictModel):
    # strict types too (YAML already types its scalars); frozen: a compiled policy is shared by requests
    model_config = ConfigDict(strict=True, frozen=True)


class BatchRange(_Strict):
    """Inclusive batch-size range; `max` omitted means no upper bound."""

    min: int = Field(1, ge=1)
    max: int | None = Field(None, ge=1)
    # also match when the batch size is unknown (a self-hosted pool whose load could not be read);
    # without such a rule the request meets the rule it would at the largest batch sizes
    unknown: bool = False


class Match(_Strict):
    """Conditions a request must meet; every condition given must hold. A list means any of."""

    turn_type: str | list[str] | None = None
    batch_size: BatchRange | None = None
    provider: str | list[str] | None = None  # provider or SGLang pool name the request goes to
    model: str | list[str] | None = None


def _limits(name: str) -> Any:
    option = OPTION[name]
    return Field(None, ge=option.least, le=option.hi)


class MethodOptions(_Strict):
    """Options of the speculation method; only the ones that belong to the rule's method are allowed.
    Their types, limits and methods are drafter_options.py's (tests/project/test_vocabulary.py keeps the
    fields and that table the same)."""

    ngram_min: int | None = _limits("ngram_min")
    ngram_max: int | None = _limits("ngram_max")
    draft_model: str | None = None  # read only to refuse it with its place (checks.py): no engine runs it
    draft_layers: int | None = _limits("draft_layers")
    eagle_head: str | None = None
    eagle_lookup: bool | None = None
    eagle_tree: int | None = _limits("eagle_tree")


class PlanSpec(_Strict):
    """What to do: a method and its γ (draft tokens per round), fixed or `auto`."""

    method: Method
    gamma: Annotated[int, Field(ge=0, le=MAX_GAMMA)] | Literal["auto"] | None = None  # 0 only with off
    min_gamma: int | None = Field(None, ge=1, le=MAX_GAMMA)  # only with gamma: auto (default 1)
    max_gamma: int | None = Field(None, ge=1, le=MAX_GAMMA)  # only with gamma: auto (default 8)
    prior_alpha: float | None = Field(
        None, ge=0.0, le=1.0
    )  # only with gamma: auto; overrides adaptive.prior_alpha
    options: MethodOptions = MethodOptions()
    pool: str | None = None  # SGLang pool (defined in the routing file) that serves this decision

    @property
    def auto(self) -> bool:
        return self.gamma == "auto"

    @property
    def gamma_bounds(self) -> tuple[int, int]:
        """[min, max] γ: the auto range, or the fixed γ twice, or (0, 0) when off."""
        if self.method == "off":
            return (0, 0)
        if self.gamma == "auto":
            return (self.min_gamma or 1, self.max_gamma or 8)
        return (int(self.gamma or 0), int(self.gamma or 0))


class Rule(PlanSpec):
    name: str
    match: Match


class AlphaPriors(_Strict):
    """α assumed per method until `warmup` requests have been observed."""

    ngram: float = Field(0.5, ge=0.0, le=1.0)
    draft: float = Field(0.6, ge=0.0, le=1.0)
    eagle: float = Field(0.7, ge=0.0, le=1.0)
    suffix: float = Field(0.5, ge=0.0, le=1.0)


class DraftCostPriors(_Strict):
    """Draft-step cost relative to a target pass (c), assumed until measured."""

    ngram: float = Field(0.02, ge=0.0, le=10.0)
    draft: float = Field(0.3, ge=0.0, le=10.0)
    eagle: float = Field(0.1, ge=0.0, le=10.0)
    suffix: float = Field(0.02, ge=0.0, le=10.0)


class AdaptiveSettings(_Strict):
    """How `gamma: auto` learns α and c (see adaptive.py)."""

    ema_weight: float = Field(0.2, gt=0.0, le=1.0)  # weight of the newest request in the EMA
    warmup: int = Field(3, ge=0)  # requests observed before the measured α replaces the prior
    margin: float = Field(0.05, ge=0.0, le=1.0)  # speculate only if expected speedup >= 1 + margin
    probe_every: int = Field(16, ge=1)  # while auto says off, every N-th decision probes with min_gamma
    prior_alpha: AlphaPriors = AlphaPriors()
    prior_draft_cost: DraftCostPriors = DraftCostPriors()


class Policy(_Strict):
    """A whole policy file."""

    version: Literal[1] = 1
    name: str | None = None
    description: str | None = None
    adaptive: AdaptiveSettings = AdaptiveSettings()
    rules: list[Rule] = []
    default: PlanSpec
