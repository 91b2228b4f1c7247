"""What /health says about the watched files (policy, providers): a rejected edit shows there.

/health needs no key, so a caller without one learns which file is broken and where (FILE:LINE:COL,
the file's name only), not the server's directories nor the problems' text; with the API key (or on a
server without one) it gets the full positioned problems, as the log has them.
"""

from __future__ import annotations

import hmac
import re
from pathlib import Path
from typing import Any

_POSITION = re.compile(r"^(?P<source>.+?):(?P<line>\d+):(?P<col>\d+):", re.MULTILINE)


def authenticated(authorization: str | None, api_key: str | None) -> bool:
    """True for a valid `Bearer <key>`, and on a server without a key (everything is open there)."""
    if api_key is None:
        return True
    scheme, _, token = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())


def file_status(source: str | Path, error: Any, *, full: bool, needs_restart: list[str] | None = None) -> dict:
    """{"source", "last_error"?, "needs_restart"?} of one watched file; `full`: paths and texts as they are."""
    name = Path(str(source)).name
    out: dict[str, Any] = {"source": str(source) if full else name}
    if error:
        out["last_error"] = str(error) if full else _positions_only(str(error), name)
    if needs_restart:
        out["needs_restart"] = needs_restart
    return out


def _positions_only(error: str, name: str) -> str:
    places = [f"{Path(m['source']).name}:{m['line']}:{m['col']}" for m in _POSITION.finditer(error)]
    where = ", ".join(dict.fromkeys(places)) if places else name
    return f"{where}: rejected; the last good version stays in force (details: the log, or /health with the API key)"
