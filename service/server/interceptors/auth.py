"""Bearer-token authentication with roles, as a gRPC server interceptor.

Every call to the Scheduler service carries `authorization: Bearer <token>`; the token
names a role (see `ROLE_METHODS`) and, for client and admin tokens, a principal: the
sequences a client submits are its principal's, and only that principal (or admin) may
read, stream or cancel them (`Callers`, which the servicer asks). Health and reflection stay open so that probes and
grpcurl need no secret. Tokens come from a file (`--auth-tokens`); only their SHA-256
digests are kept in memory, and no token is ever logged or echoed in a status message.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import json
import logging
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import grpc

from service.core import SEES_ALL, Caller, ConfigError
from service.server.interceptors import handlers

# The longest tenant a tokens file may bind a token to, in UTF-8 bytes (as the wire's
# MAX_STRING_BYTES).
MAX_TENANT_BYTES = 256

log = logging.getLogger(__name__)

SCHEDULER_SERVICE = "lattice.scheduler.v1.Scheduler"
# Callable without a token: probes, load balancers and grpcurl's discovery.
OPEN_SERVICES = frozenset(
    {
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
        "grpc.reflection.v1.ServerReflection",
    }
)


class Role(enum.Enum):
    CLIENT = "client"
    WORKER = "worker"
    ADMIN = "admin"


# Scheduler methods each role may call; admin may call every method of every service,
# and alone may call those in no list here (DrainWorker).
ROLE_METHODS: dict[Role, frozenset[str]] = {
    Role.CLIENT: frozenset(
        {"Submit", "Cancel", "GetSequence", "Generate", "FollowSequence", "GetStatus"}
    ),
    Role.WORKER: frozenset({"RegisterWorker", "SelectBatch", "WorkerSession", "DeregisterWorker"}),
}


@dataclass(frozen=True)
class Grant:
    """What one token allows. `worker_id` is set exactly for the worker role."""

    role: Role
    name: str  # for logs: the file's `name`, or the role (and worker id)
    worker_id: str | None = None
    # Whose sequences its calls submit and see: the file's `name`, else "sha256:" and the
    # first 16 hex digits of the token's digest (two unnamed tokens are two principals).
    principal: str = ""
    # The tenant of everything it submits, overriding the request's (client tokens only).
    tenant: str | None = None

    def caller(self) -> Caller:
        return Caller(self.principal, sees_all=self.role is Role.ADMIN)


class TokenTable:
    """Token digests to grants; looked up in constant time per entry."""

    def __init__(self, entries: Iterable[tuple[bytes, Grant]]) -> None:
        self._entries = list(entries)

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, token: str) -> Grant | None:
        """The grant of `token`, or None. Compares against every entry, found or not."""
        digest = _digest(token)
        found = None
        for known, grant in self._entries:
            if hmac.compare_digest(known, digest):
                found = grant
        return found


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def load_tokens(path: str | Path) -> TokenTable:
    """Read a tokens file (TOML, or JSON when it ends in .json); ConfigError if it is wrong.

    Format: a list `tokens` of tables with `token` (or `token_sha256`, its hex digest),
    `role` (client, worker or admin), `worker_id` (worker tokens only, required), an
    optional `name` (used in logs, and the principal of a client or admin token; tokens
    of one name are one principal) and an optional `tenant` (client tokens only: the
    tenant of everything the token submits).
    """
    where = f"--auth-tokens {path}"
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise ConfigError(f"{where}: cannot read it ({err.strerror})") from None
    try:
        data = json.loads(text) if str(path).endswith(".json") else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as err:
        kind = "JSON" if str(path).endswith(".json") else "TOML"
        raise ConfigError(f"{where}: not valid {kind}: {err}") from None
    items = data.get("tokens") if isinstance(data, dict) else None
    if not isinstance(items, list) or not items:
        raise ConfigError(f"{where}: expected a non-empty list `tokens` (see docs/security.md)")
    entries, seen = [], set()
    for index, item in enumerate(items):
        digest, grant = _entry(item, f"{where}: tokens[{index}]")
        if digest in seen:
            raise ConfigError(f"{where}: tokens[{index}] repeats an earlier token")
        seen.add(digest)
        entries.append((digest, grant))
    return TokenTable(entries)


def _entry(item: object, where: str) -> tuple[bytes, Grant]:
    if not isinstance(item, dict):
        raise ConfigError(f"{where}: expected a table with token and role")
    unknown = set(item) - {"token", "token_sha256", "role", "worker_id", "name", "tenant"}
    if unknown:
        raise ConfigError(
            f"{where}: unknown keys {sorted(unknown)}; known: token, "
            f"token_sha256, role, worker_id, name, tenant"
        )
    try:
        role = Role(item.get("role"))
    except ValueError:
        raise ConfigError(f"{where}: role must be client, worker or admin") from None
    token, hexdigest = item.get("token"), item.get("token_sha256")
    if (token is None) == (hexdigest is None):
        raise ConfigError(f"{where}: give exactly one of token and token_sha256")
    if token is not None:
        if not isinstance(token, str) or len(token) < 16:
            raise ConfigError(f"{where}: token must be a string of at least 16 characters")
        digest = _digest(token)
    else:
        try:
            digest = bytes.fromhex(hexdigest)
        except (TypeError, ValueError):
            digest = b""
        if len(digest) != 32:
            raise ConfigError(f"{where}: token_sha256 must be 64 hex digits")
    worker_id = item.get("worker_id")
    if role is Role.WORKER and (not isinstance(worker_id, str) or not worker_id):
        raise ConfigError(f"{where}: a worker token needs the worker_id it is bound to")
    if role is not Role.WORKER and worker_id is not None:
        raise ConfigError(f"{where}: only worker tokens take a worker_id")
    name = item.get("name")
    if name is not None and (not isinstance(name, str) or not _is_clean(name)):
        raise ConfigError(f"{where}: name must be a non-empty string without control characters")
    tenant = _tenant(item.get("tenant"), role, where)
    default_name = f"worker {worker_id}" if role is Role.WORKER else role.value
    principal = name if name is not None else f"sha256:{digest.hex()[:16]}"
    return digest, Grant(
        role,
        name if name is not None else default_name,
        worker_id,
        principal=principal,
        tenant=tenant,
    )


def _tenant(tenant: object, role: Role, where: str) -> str | None:
    if tenant is None:
        return None
    if role is not Role.CLIENT:
        raise ConfigError(f"{where}: only client tokens take a tenant")
    if (
        not isinstance(tenant, str)
        or not _is_clean(tenant)
        or len(tenant.encode("utf-8", "surrogatepass")) > MAX_TENANT_BYTES
    ):
        raise ConfigError(
            f"{where}: tenant must be a non-empty string of at most "
            f"{MAX_TENANT_BYTES} bytes without control characters"
        )
    return tenant


def _is_clean(text: str) -> bool:
    """Non-empty, valid UTF-8 (no lone surrogates) and no control characters."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return bool(text) and all(ch.isprintable() or ch == " " for ch in text)


class Callers:
    """Who a client call comes from, for the servicer: the caller of the call's token
    (the interceptor has checked it already), or, without a tokens table, SEES_ALL (one
    principal, who sees every sequence, as before principals)."""

    def __init__(self, tokens: TokenTable | None) -> None:
        self._tokens = tokens

    def grant(self, context) -> Grant | None:
        """The grant of the call's token; None without a tokens table."""
        if self._tokens is None:
            return None
        grant = self._tokens.lookup(_bearer(context.invocation_metadata()) or "")
        if grant is None:  # the interceptor refuses such calls before they get here
            raise PermissionError("a call reached the servicer without a known token")
        return grant

    def caller(self, context) -> Caller:
        grant = self.grant(context)
        return SEES_ALL if grant is None else grant.caller()


def _bearer(metadata) -> str | None:
    """The token of `authorization: Bearer <token>` in `metadata`, or None."""
    values = [v for k, v in (metadata or ()) if k == "authorization"]
    if not values:
        return None
    scheme, _, token = str(values[0]).partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


class _Denied(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Checks the bearer token and its role on every call outside OPEN_SERVICES.

    No token, or one the table does not know: UNAUTHENTICATED. A role that may not call
    the method, or a worker token naming another worker_id: PERMISSION_DENIED. A worker's
    request stream (WorkerSession) is checked message by message.
    """

    def __init__(self, tokens: TokenTable) -> None:
        self._tokens = tokens

    async def intercept_service(self, continuation, handler_call_details):
        service, _, method = handler_call_details.method.lstrip("/").rpartition("/")
        handler = await continuation(handler_call_details)
        if service in OPEN_SERVICES or handler is None:
            return handler
        try:
            grant = self._authenticate(handler_call_details.invocation_metadata)
            _authorize(grant, service, method)
        except _Denied as err:
            denied = err  # `err` is unbound when the except block ends

            async def refuse(context) -> None:
                await _abort(context, denied)

            return handlers.wrap(handler, on_start=refuse)
        if grant.role is Role.WORKER:

            async def check_worker_id(request, context) -> None:
                denied = _check_worker_id(grant, request)
                if denied is not None:
                    await _abort(context, denied)

            return handlers.wrap(handler, on_request=check_worker_id)
        return handler

    def _authenticate(self, metadata) -> Grant:
        values = [v for k, v in (metadata or ()) if k == "authorization"]
        if not values:
            raise _Denied(
                grpc.StatusCode.UNAUTHENTICATED,
                "this scheduler requires a token: send metadata "
                "'authorization: Bearer <token>' (clients: --token or "
                "LATTICE_SCHEDULER_TOKEN)",
            )
        scheme, _, token = str(values[0]).partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise _Denied(
                grpc.StatusCode.UNAUTHENTICATED,
                "the authorization metadata must read 'Bearer <token>'",
            )
        grant = self._tokens.lookup(token.strip())
        if grant is None:
            raise _Denied(
                grpc.StatusCode.UNAUTHENTICATED, "the token is not one this scheduler knows"
            )
        return grant


def _authorize(grant: Grant, service: str, method: str) -> None:
    if grant.role is Role.ADMIN:
        return
    if service == SCHEDULER_SERVICE and method in ROLE_METHODS[grant.role]:
        return
    needed = " or ".join(
        [r.value for r, methods in ROLE_METHODS.items() if method in methods] + ["admin"]
    )
    article = "an" if needed.startswith("admin") else "a"
    raise _Denied(
        grpc.StatusCode.PERMISSION_DENIED,
        f"a {grant.role.value} token may not call {method}; it needs {article} {needed} token",
    )


def _check_worker_id(grant: Grant, request) -> _Denied | None:
    if getattr(request, "worker_id", None) == grant.worker_id:
        return None
    named = request.worker_id
    shown = repr(named) if len(named) <= 64 else f"{named[:64]!r}... ({len(named)} characters)"
    return _Denied(
        grpc.StatusCode.PERMISSION_DENIED,
        f"this token is bound to worker_id {grant.worker_id!r}; the request names {shown}",
    )


async def _abort(context: grpc.aio.ServicerContext, denied: _Denied) -> None:
    log.warning(
        "call refused",
        extra={"code": denied.code.name, "reason": str(denied), "peer": context.peer()},
    )
    await context.abort(denied.code, str(denied))
