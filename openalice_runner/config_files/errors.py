"""Problems found in an operator's config file (policy, routing), each pinned to FILE:LINE:COL."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a config file. `line` and `column` are 1-based."""

    source: str
    line: int
    column: int
    message: str

    def __str__(self) -> str:
        return f"{self.source}:{self.line}:{self.column}: {self.message}"


class ConfigError(ValueError):
    """A config file that cannot be used; `problems` lists every problem found, in file order.

    Each kind of file has its own subclass (PolicyError, RoutingConfigError) so callers can catch one.
    """

    empty_message = "invalid config"  # str() when no problem is listed (e.g. a loader bug)

    def __init__(self, problems: list[Problem]):
        self.problems = sorted(problems, key=lambda p: (p.source, p.line, p.column))
        super().__init__("\n".join(str(p) for p in self.problems) or self.empty_message)
