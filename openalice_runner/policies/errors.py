"""Problems found in a policy file, each pinned to FILE:LINE:COL."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a policy file. `line` and `column` are 1-based."""

    source: str
    line: int
    column: int
    message: str

    def __str__(self) -> str:
        return f"{self.source}:{self.line}:{self.column}: {self.message}"


class PolicyError(ValueError):
    """A policy file that cannot be used; `problems` lists every problem found, in file order."""

    def __init__(self, problems: list[Problem]):
        self.problems = sorted(problems, key=lambda p: (p.source, p.line, p.column))
        super().__init__("\n".join(str(p) for p in self.problems) or "invalid policy")
