"""Chaos testing (docs/testing.md): faults injected on purpose, to show that nothing is lost."""

from __future__ import annotations

# this share of the batching scheduler's admissions fails as a passing fault would (a float, 0..1)
ADMISSION_FAULTS_ENV = "OPENALICE_INJECT_ADMISSION_FAULTS"


class InjectedFault(RuntimeError):
    """A fault injected on purpose (ADMISSION_FAULTS_ENV), to test that nothing is lost."""


def fault_rate(raw: str | None) -> float:
    if not raw:
        return 0.0
    try:
        rate = float(raw)
    except ValueError:
        raise ValueError(f"{ADMISSION_FAULTS_ENV} must be a number in 0..1, got {raw!r}") from None
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"{ADMISSION_FAULTS_ENV} must be in 0..1, got {rate}")
    return rate
