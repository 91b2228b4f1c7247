"""The keys file (`serve --keys FILE`): one entry per API key, each key a tenant.

    tenants:
      - name: team-a                  # the tenant: metric label, span attribute, state key
        hash: 9f86d081...             # sha256 hex of the key (`openalice-runner keys hash`)
        stream_release: fixed:16      # optional: pass | fixed:N | paced (default: serve's)
        speculation_info: summary     # optional: full | summary | none (default: serve's)
        requests_per_minute: 120      # optional: past it 429 with Retry-After

Keys are stored hashed: the file holds no secret, so it may be readable by others; it must not be
writable by them (whoever writes it lets themselves in), and such a file is refused. Every problem
(duplicate key or name, unknown field, bad value, empty file) is reported at FILE:LINE:COL.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path
from typing import Annotated

from pydantic import Field, StrictInt, StrictStr, ValidationError, field_validator

from openalice_runner.config_files import ConfigError, Problem, StrictModel, load_located
from openalice_runner.config_files.reading import read_operator_file
from openalice_runner.config_files.validation import validation_problems
from openalice_runner.server.disclosure import SpeculationInfoLevel
from openalice_runner.server.release.modes import ReleaseMode, parse_release
from openalice_runner.server.tenants.tenant import NAME_RE, RESERVED_NAMES, Tenant

HASH_HEX_CHARS = 64  # sha256


class KeysFileError(ConfigError):
    empty_message = "invalid keys file"


def key_hash(key: str) -> str:
    """What the keys file stores for `key`: the sha256 hex of its UTF-8 bytes."""
    return hashlib.sha256(key.encode()).hexdigest()


class KeyEntry(StrictModel):
    name: StrictStr
    hash: StrictStr
    stream_release: StrictStr | None = None
    speculation_info: SpeculationInfoLevel | None = None
    requests_per_minute: Annotated[StrictInt, Field(ge=1, le=1_000_000)] | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not NAME_RE.match(value):
            raise ValueError("a tenant name is 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit")
        if value in RESERVED_NAMES:
            raise ValueError(f"{value!r} is reserved (the metric label of tenants past the bound)")
        return value

    @field_validator("hash")
    @classmethod
    def _hash(cls, value: str) -> str:
        value = value.strip().lower()
        if len(value) != HASH_HEX_CHARS or any(c not in "0123456789abcdef" for c in value):
            raise ValueError("the sha256 of the key as 64 hex digits (`openalice-runner keys hash` prints it), "
                             "never the key itself")
        return value

    @field_validator("stream_release")
    @classmethod
    def _release(cls, value: str | None) -> str | None:
        if value is not None:
            parse_release(value)
        return value

    def tenant(self) -> Tenant:
        release: ReleaseMode | None = parse_release(self.stream_release) if self.stream_release else None
        return Tenant(self.name, release, self.speculation_info, self.requests_per_minute)


class KeysFile(StrictModel):
    tenants: Annotated[list[KeyEntry], Field(min_length=1)]


def load_keys_text(text: str, source: str = "<keys>") -> list[tuple[str, Tenant]]:
    """(key hash, tenant) per entry, in file order; KeysFileError listing every problem."""
    loc = load_located(text, source, empty="a keys file needs `tenants:`, a list of name and hash",
                       error=KeysFileError)  # fmt: skip
    if not isinstance(loc.data, dict):
        raise KeysFileError([loc.problem((), "a keys file is a mapping with `tenants:`, a list of name and hash")])
    try:
        parsed = KeysFile.model_validate(loc.data)
    except ValidationError as exc:
        raise KeysFileError(validation_problems(exc, loc)) from None
    problems: list[Problem] = []
    hashes: dict[str, int] = {}
    names: dict[str, int] = {}
    for i, entry in enumerate(parsed.tenants):
        if entry.hash in hashes:
            first = parsed.tenants[hashes[entry.hash]].name
            line = loc.where(("tenants", hashes[entry.hash], "hash"))[0]
            problems.append(loc.problem(("tenants", i, "hash"), f"duplicate key: the same hash as tenant {first!r} "
                                        f"(line {line}); one key is one tenant"))  # fmt: skip
        else:
            hashes[entry.hash] = i
        if entry.name in names:
            line = loc.where(("tenants", names[entry.name], "name"))[0]
            problems.append(loc.problem(("tenants", i, "name"), f"duplicate tenant name {entry.name!r} (first at "
                                        f"line {line}); give each key its own tenant"))  # fmt: skip
        else:
            names[entry.name] = i
    if problems:
        raise KeysFileError(problems)
    return [(entry.hash, entry.tenant()) for entry in parsed.tenants]


def load_keys_bytes(data: bytes, source: str) -> list[tuple[str, Tenant]]:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise KeysFileError([Problem(source, 1, 1, f"not UTF-8 text ({exc.reason} at byte {exc.start})")]) from None
    return load_keys_text(text, source)


def read_keys_file(path: str | os.PathLike[str]) -> bytes:
    """The file's bytes, refused (KeysFileError) where it cannot be read or others may write it."""
    source = str(path)
    try:
        data = read_operator_file(Path(path))
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise KeysFileError([Problem(source, 1, 1, f"cannot read: {exc}")]) from None
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise KeysFileError([Problem(source, 1, 1, f"writable by others (mode {stat.S_IMODE(mode):o}): whoever "
                                     "writes the keys file lets themselves in; chmod go-w it")])  # fmt: skip
    return data


def load_keys_file(path: str | os.PathLike[str]) -> list[tuple[str, Tenant]]:
    return load_keys_bytes(read_keys_file(path), str(path))
