"""How much of a reply's `speculation` block its caller sees (`serve --speculation-info`).

What speculation accepted depends on the text, so per-request counts tell an observer about the text
(arXiv 2411.01076). `full` shows everything (the default: one trusted caller); `summary` keeps what
was decided (method, γ, pool, rule, policy version, turn type and sources) and drops what happened
(proposed, accepted, forced, closing, acceptance rate, target passes, tokens per pass, the time before
the first token by part); `none` drops the block. Spans and metrics keep the full figures: they are the operator's."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, get_args

if TYPE_CHECKING:  # the CLI reads LEVELS at start-up: no pydantic models imported for it
    from openalice_runner.types import SpeculationInfo

SpeculationInfoLevel = Literal["full", "summary", "none"]
LEVELS: tuple[str, ...] = get_args(SpeculationInfoLevel)
# what happened in one request: hidden at `summary`
COUNTS = ("proposed", "accepted", "forced", "closing", "acceptance_rate", "target_passes", "tokens_per_pass")
# and when: the time before the first token by part (a queue wait tells of other requests' load)
TIMES = ("first_token",)


def disclosed(info: SpeculationInfo | None, level: SpeculationInfoLevel) -> SpeculationInfo | None:
    """`info` as a caller at `level` may see it (a copy where anything is hidden)."""
    if info is None or level == "full":
        return info
    if level == "none":
        return None
    return info.model_copy(update=dict.fromkeys(COUNTS + TIMES))
