"""The drafter options a plan carries (`SpeculationPlan.options`), defined once: type, default,
limits and the methods each belongs to.

The policy file's schema (`policies/schema.py` MethodOptions), its checks (`policies/checks.py`)
and the engine's settings (`engine/types.py` SpecConfig) are built from this table, so a limit is
written here only. Torch-free, like `speculation.py`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from openalice_runner.speculation import SPEC_METHODS

_NGRAM = frozenset({"ngram", "suffix", "eagle"})  # eagle: its prompt lookup (eagle_lookup) matches n-grams


@dataclass(frozen=True, slots=True)
class DrafterOption:
    name: str
    kind: type  # int, bool or str
    default: Any  # the engine's value when a plan leaves the option out
    methods: frozenset[str]  # the methods it applies to
    lo: int | None = None  # least value (ints)
    hi: int | None = None  # greatest value (ints)
    off_at_zero: bool = False  # 0 is allowed too and switches the feature off
    values: str = ""  # the allowed values in words, for messages ({lo}, {hi} filled in)

    @property
    def least(self) -> int | None:
        """The least value a policy file's schema lets through (0 where 0 is off)."""
        return 0 if self.off_at_zero else self.lo

    @property
    def switch(self) -> bool:
        """A feature switch (a bool, or an int whose 0 is off): set for another method, it is refused."""
        return self.kind is bool or self.off_at_zero

    def problem(self, value: Any) -> str | None:
        """What is wrong with a value of the right type; None when it is within the limits."""
        if self.kind is not int or value is None or (self.off_at_zero and value == 0):
            return None
        if (self.lo is not None and value < self.lo) or (self.hi is not None and value > self.hi):
            return f"{self.name} is {self.values.format(lo=self.lo, hi=self.hi)}, got {value}"
        return None


DRAFTER_OPTIONS: tuple[DrafterOption, ...] = (
    DrafterOption("ngram_min", int, 1, _NGRAM, lo=1, hi=16, values="{lo} to {hi}"),
    DrafterOption("ngram_max", int, 4, _NGRAM, lo=1, hi=16, values="{lo} to {hi}"),
    # a separate draft LM: read only to refuse it (the engine drafts from the target's own layers)
    DrafterOption("draft_model", str, None, frozenset({"draft"})),
    DrafterOption("draft_layers", int, None, frozenset({"draft"}), lo=1, values=">= {lo}"),  # the target's first N
    DrafterOption("eagle_head", str, None, frozenset({"eagle"})),  # path of a trained EAGLE-style head
    # draft by prompt lookup where the context has a match worth drafting, by the head elsewhere
    DrafterOption("eagle_lookup", bool, False, frozenset({"eagle"})),
    # draft trees of up to this many tokens (γ caps their depth); 0: chains
    DrafterOption("eagle_tree", int, 0, frozenset({"eagle"}), lo=2, hi=63, off_at_zero=True,
                  values="0 (chains) or a tree of {lo} to {hi} tokens"),  # fmt: skip
)
OPTION: Mapping[str, DrafterOption] = {o.name: o for o in DRAFTER_OPTIONS}
OPTIONS_BY_METHOD: Mapping[str, frozenset[str]] = {
    m: frozenset(o.name for o in DRAFTER_OPTIONS if m in o.methods) for m in SPEC_METHODS
}


def ngram_problem(ngram_min: int | None, ngram_max: int | None) -> str | None:
    """The one relation between options: n-gram sizes in order (an unset one at its default)."""
    lo = OPTION["ngram_min"].default if ngram_min is None else ngram_min
    hi = OPTION["ngram_max"].default if ngram_max is None else ngram_max
    return f"ngram_max {hi} < ngram_min {lo}" if lo > hi else None
