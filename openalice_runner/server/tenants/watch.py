"""Watches the keys file (`serve --keys`) while serving: a valid edit replaces the tenants at once
(a new key works, a removed one stops working, on the next request); a bad one keeps the last good
tenants, with its problems at FILE:LINE:COL in the log and on /health (server/file_watch.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from openalice_runner.server.file_watch import WatchedFile
from openalice_runner.server.tenants.keys_file import load_keys_bytes, read_keys_file
from openalice_runner.server.tenants.registry import RateLimiter, TenantKeys


class KeysWatcher(WatchedFile):
    what = "keys file"

    def __init__(self, keys: TenantKeys, limiter: RateLimiter, path: str | Path, interval_s: float = 1.0) -> None:
        self.keys = keys
        self.limiter = limiter
        super().__init__(path, interval_s)

    def _read(self) -> bytes:
        return read_keys_file(self.path)  # refused (KeysFileError) where others may write it

    def _stat(self) -> Any:
        stamp = super()._stat()
        try:  # the mode too: `chmod go-w` on a refused file must be seen, and it leaves mtime as it was
            return None if stamp is None else (*stamp, self.path.stat().st_mode)
        except OSError:
            return None

    def _hash(self) -> str | None:
        try:
            return super()._hash()
        except ValueError:  # refused (KeysFileError): nothing good to compare with
            return None

    def _parse(self) -> Any:
        try:
            return super()._parse()
        except ValueError as exc:  # read_keys_file's KeysFileError, outside the base's read guard
            self._digest = None  # the last good file put back is applied again (and clears the error)
            return self._reject(str(exc))

    def _load(self, data: bytes) -> Any:
        return load_keys_bytes(data, str(self.path))

    def _use(self, entries: Any) -> None:
        self.keys.replace(entries)
        self.limiter.forget_others(t.name for _, t in entries)

    def _applied(self) -> dict[str, Any]:
        return {"tenants": len(self.keys.tenants)}
