"""Tenants (`serve --keys FILE`, or `--api-key` as the one tenant "default"): who a request comes from,
and what that changes. Each API key is one tenant, with its own stream release mode, speculation-info
level and rate limit (tenant.py); the keys file is read with FILE:LINE:COL errors (keys_file.py) and
watched (server/file_watch.py); the guard finds a request's tenant by its key's hash (registry.py).
The tenant's name then flows in CallContext to the providers, which keep their state per tenant
(docs/security.md, "Tenants")."""

from openalice_runner.server.tenants.keys_file import KeysFileError, key_hash, load_keys_text
from openalice_runner.server.tenants.registry import RateLimiter, TenantKeys
from openalice_runner.server.tenants.tenant import (
    RequestSettings,
    Tenant,
    request_settings,
)

__all__ = [
    "KeysFileError",
    "RateLimiter",
    "RequestSettings",
    "Tenant",
    "TenantKeys",
    "key_hash",
    "load_keys_text",
    "request_settings",
]
