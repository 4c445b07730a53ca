"""The gateway's own API keys (`--api-keys FILE`): who is calling, as a principal.

Each key names a principal (`name`), optionally binds it to a `tenant` (then the tenant
of everything it submits, whatever the body's `user` says) and optionally maps it to a
scheduler token of its own (`scheduler_token`; else the gateway's --token). Clients send
the key as OpenAI clients do, `Authorization: Bearer <key>`. Only the keys' SHA-256
digests are kept in memory; no key is ever logged or echoed.

Without a keys file there is one principal, anonymous, as before (docs/security.md).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import string
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from common.errors import ConfigError

# The scheduler's limit on a tenant (service/server/convert.py MAX_STRING_BYTES).
MAX_NAME_BYTES = 256
# A name travels in gRPC metadata (x-lattice-principal): printable ASCII, no spaces.
_NAME_CHARACTERS = frozenset(string.ascii_letters + string.digits + "-_.:@/+=")
PRINCIPAL_METADATA = "x-lattice-principal"


@dataclass(frozen=True)
class Principal:
    """Who a request comes from. `name` "" is the anonymous principal (no keys file)."""

    name: str = ""
    tenant: str | None = None  # bound tenant; None: the body's `user`, or the name
    scheduler_token: str | None = None  # None: the gateway's own --token

    def tenant_for(self, user: str | None) -> str:
        """The scheduler tenant of a request whose body says `user`."""
        if self.tenant is not None:
            return self.tenant
        if self.name:
            return self.name
        return user or ""


ANONYMOUS = Principal()


class ApiKeys:
    """Key digests to principals; a lookup compares against every entry, found or not."""

    def __init__(self, entries: Iterable[tuple[bytes, Principal]]) -> None:
        self._entries = list(entries)

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, key: str) -> Principal | None:
        digest = _digest(key)
        found = None
        for known, principal in self._entries:
            if hmac.compare_digest(known, digest):
                found = principal
        return found


def bearer_key(authorization: str | None) -> str | None:
    """The key of an `Authorization: Bearer <key>` header; None if there is none."""
    if not authorization:
        return None
    scheme, _, key = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        return None
    return key.strip()


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


def load_api_keys(path: str | Path) -> ApiKeys:
    """Read a keys file (TOML, or JSON when it ends in .json); ConfigError if it is wrong.

    Format: a list `keys` of tables with `key` (or `key_sha256`, its hex digest), `name`
    (the principal: letters, digits and -_.:@/+=), and optionally `tenant` and
    `scheduler_token`.
    """
    where = f"--api-keys {path}"
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise ConfigError(f"{where}: cannot read it ({err.strerror})") from None
    is_json = str(path).endswith(".json")
    try:
        data = json.loads(text) if is_json else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as err:
        raise ConfigError(f"{where}: not valid {'JSON' if is_json else 'TOML'}: {err}") from None
    items = data.get("keys") if isinstance(data, dict) else None
    if not isinstance(items, list) or not items:
        raise ConfigError(f"{where}: expected a non-empty list `keys` (see docs/security.md)")
    entries, digests, names = [], set(), set()
    for index, item in enumerate(items):
        digest, principal = _entry(item, f"{where}: keys[{index}]")
        if digest in digests:
            raise ConfigError(f"{where}: keys[{index}] repeats an earlier key")
        if principal.name in names:
            raise ConfigError(
                f"{where}: keys[{index}] repeats the name {principal.name!r}; "
                "each key is a principal of its own"
            )
        digests.add(digest)
        names.add(principal.name)
        entries.append((digest, principal))
    return ApiKeys(entries)


def _entry(item: object, where: str) -> tuple[bytes, Principal]:
    if not isinstance(item, dict):
        raise ConfigError(f"{where}: expected a table with key and name")
    known = {"key", "key_sha256", "name", "tenant", "scheduler_token"}
    if unknown := set(item) - known:
        raise ConfigError(
            f"{where}: unknown keys {sorted(unknown)}; known: {', '.join(sorted(known))}"
        )
    if ("key" in item) == ("key_sha256" in item):
        raise ConfigError(f"{where}: give exactly one of key and key_sha256")
    if "key" in item:
        key = item["key"]
        if not isinstance(key, str) or len(key) < 16:
            raise ConfigError(f"{where}: key must be a string of at least 16 characters")
        digest = _digest(key)
    else:
        try:
            digest = bytes.fromhex(str(item["key_sha256"]))
        except ValueError:
            digest = b""
        if len(digest) != 32:
            raise ConfigError(f"{where}: key_sha256 must be 64 hex digits")
    name = item.get("name")
    if (
        not isinstance(name, str)
        or not name
        or not set(name) <= _NAME_CHARACTERS
        or len(name) > MAX_NAME_BYTES
    ):
        raise ConfigError(
            f"{where}: name must be 1-{MAX_NAME_BYTES} letters, digits or "
            f"-_.:@/+= (it names the principal in logs and gRPC metadata)"
        )
    tenant = item.get("tenant")
    if tenant is not None and (
        not isinstance(tenant, str)
        or not tenant
        or "\x00" in tenant
        or len(tenant.encode()) > MAX_NAME_BYTES
    ):
        raise ConfigError(
            f"{where}: tenant must be a non-empty string of at most "
            f"{MAX_NAME_BYTES} bytes, without NUL"
        )
    token = item.get("scheduler_token")
    if token is not None and (not isinstance(token, str) or not token):
        raise ConfigError(f"{where}: scheduler_token must be a non-empty string")
    return digest, Principal(name, tenant, token)
