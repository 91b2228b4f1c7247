"""A tenant: the name its key maps to and the settings it carries, and how a request's settings are
resolved from its tenant and the `serve` defaults (one call in the pipeline)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from openalice_runner.server.disclosure import SpeculationInfoLevel
from openalice_runner.server.release.modes import ReleaseMode

if TYPE_CHECKING:
    from openalice_runner.server.settings import ServerSettings

# A tenant name is a metric label, a span attribute, part of a state key and of a cache salt: short,
# plain and chosen by the operator.
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
RESERVED_NAMES = frozenset({"other"})  # the metric label of names past the bound (tracing/labels.py)


@dataclass(frozen=True)
class Tenant:
    name: str
    stream_release: ReleaseMode | None = None  # None: the serve default
    speculation_info: SpeculationInfoLevel | None = None  # None: the serve default
    requests_per_minute: int | None = None  # None: no limit


@dataclass(frozen=True)
class RequestSettings:
    """What one request runs under: its tenant's settings where it has them, else the serve defaults."""

    tenant: str | None  # None: no keys (an open server): one shared tenant, as before tenants
    speculation_info: SpeculationInfoLevel
    stream_release: ReleaseMode


def request_settings(tenant: Tenant | None, settings: ServerSettings) -> RequestSettings:
    """The one place a request's speculation-info level and stream release mode are decided."""
    if tenant is None:
        return RequestSettings(None, settings.speculation_info, settings.stream_release)
    return RequestSettings(
        tenant.name,
        tenant.speculation_info or settings.speculation_info,
        tenant.stream_release or settings.stream_release,
    )
