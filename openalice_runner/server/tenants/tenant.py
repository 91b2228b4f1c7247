"""A tenant: the name its key maps to and the settings it carries, and how a request's settings are
resolved from its tenant and the `serve` defaults (one call in the pipeline)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from openalice_runner.server.disclosure import SpeculationInfoLevel

if TYPE_CHECKING:
    from openalice_runner.server.settings import ServerSettings

ReleaseMode = Literal["pass", "fixed", "paced"]
MAX_FIXED_TOKENS = 4096  # tokens an event at most with fixed:N (a reply's whole budget is far below)
# A tenant name is a metric label, a span attribute, part of a state key and of a cache salt: short,
# plain and chosen by the operator.
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
RESERVED_NAMES = frozenset({"other"})  # the metric label of names past the bound (tracing/labels.py)


@dataclass(frozen=True)
class StreamRelease:
    """How a stream's tokens leave (Build 1 of issue 48): `pass` (one event per target pass),
    `fixed` (`tokens` per event) or `paced` (a steady clock)."""

    mode: ReleaseMode
    tokens: int | None = None  # fixed:N's N

    def __str__(self) -> str:
        return f"fixed:{self.tokens}" if self.mode == "fixed" else self.mode


def parse_stream_release(text: str) -> StreamRelease:
    """`pass`, `paced` or `fixed:N` (1 <= N <= MAX_FIXED_TOKENS); ValueError saying what is allowed."""
    if not isinstance(text, str):
        raise ValueError(f"stream_release must be a string (pass, fixed:N or paced), got {type(text).__name__}")
    value = text.strip()
    if value in ("pass", "paced"):
        return StreamRelease(value)  # type: ignore[arg-type]
    mode, sep, n = value.partition(":")
    if mode == "fixed" and sep:
        if not n.isdigit() or not 1 <= int(n) <= MAX_FIXED_TOKENS:
            raise ValueError(f"fixed:N needs a whole N from 1 to {MAX_FIXED_TOKENS}, got {value!r}")
        return StreamRelease("fixed", int(n))
    raise ValueError(f"stream_release must be pass, fixed:N (N >= 1) or paced, got {value!r}")


@dataclass(frozen=True)
class Tenant:
    name: str
    stream_release: StreamRelease | None = None  # None: the serve default
    speculation_info: SpeculationInfoLevel | None = None  # None: the serve default
    requests_per_minute: int | None = None  # None: no limit


@dataclass(frozen=True)
class RequestSettings:
    """What one request runs under: its tenant's settings where it has them, else the serve defaults."""

    tenant: str | None  # None: no keys (an open server): one shared tenant, as before tenants
    speculation_info: SpeculationInfoLevel
    stream_release: StreamRelease | None  # None: the serve default (Build 1's ServerSettings.stream_release)


def request_settings(tenant: Tenant | None, settings: ServerSettings) -> RequestSettings:
    # Build 1 (stream release modes) adds ServerSettings.stream_release; until then there is no default.
    default_release = getattr(settings, "stream_release", None)
    if tenant is None:
        return RequestSettings(None, settings.speculation_info, default_release)
    return RequestSettings(
        tenant.name,
        tenant.speculation_info or settings.speculation_info,
        tenant.stream_release or default_release,
    )
