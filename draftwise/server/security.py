"""What stands between the network and the API, as ASGI middleware: a body size limit, a Host
allowlist and the API key.

- Body limit: a request whose Content-Length, or whose streamed body, passes the limit gets 413
  before the body is read or parsed.
- Host allowlist: a server bound to loopback answers only to loopback names (localhost, 127.0.0.1,
  [::1]); otherwise a web page could reach it through DNS rebinding (its own name resolving to
  127.0.0.1). Other names are allowed by `allowed_hosts` ("*": any).
- API keys: `Authorization: Bearer KEY` (the scheme in any case), compared in constant time; every
  path but /health needs one. Each key is a tenant: the request carries its key's `tenant_of`
  (a digest, never the key) in `scope["state"]["tenant"]`, so that what one tenant's requests
  leave behind (suffix decoding's cache of earlier outputs) never shapes another's.
Each refusal is an OpenAI-shaped error body.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json

from draftwise.errors import InvalidParameterError
from draftwise.server.protocol import error_body

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
OPEN_PATHS = frozenset({"/health"})


def default_allowed_hosts(bind_host: str) -> frozenset[str]:
    """Loopback names for a loopback bind; any host otherwise (set `allowed_hosts` to narrow it)."""
    try:
        loopback = bind_host == "localhost" or ipaddress.ip_address(bind_host).is_loopback
    except ValueError:
        loopback = False
    return LOOPBACK_NAMES if loopback else frozenset({"*"})


async def send_error(send, status: int, body: dict, headers: list[tuple[bytes, bytes]] = ()) -> None:
    payload = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": payload})


class _BodyTooLarge(Exception):
    pass


class BodyLimit:
    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            return await self._refuse(send)
        received, started = 0, False

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _BodyTooLarge
            return message

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _BodyTooLarge:
            if not started:
                await self._refuse(send)

    async def _refuse(self, send) -> None:
        await send_error(send, 413, error_body(f"the request body is larger than this server's limit of "
                                               f"{self.max_bytes} bytes", code="request_too_large"))


class HostAllowlist:
    def __init__(self, app, allowed: frozenset[str]) -> None:
        self.app = app
        self.allowed = frozenset(host.lower() for host in allowed)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or "*" in self.allowed:
            return await self.app(scope, receive, send)
        host = host_name(dict(scope["headers"]).get(b"host", b"").decode("latin-1"))
        if host not in self.allowed:
            return await send_error(send, 400, error_body(
                f"Host {host!r} is not allowed here (allowed: {', '.join(sorted(self.allowed))}); "
                "start the server with --allowed-hosts to add names", code="invalid_host"))
        return await self.app(scope, receive, send)


class ApiKeyAuth:
    def __init__(self, app, api_keys: tuple[str, ...]) -> None:
        self.app, self.keys = app, [key.encode() for key in api_keys]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        tenant = tenant_for(dict(scope["headers"]).get(b"authorization", b"").decode("latin-1"), self.keys)
        if tenant is None:
            return await send_error(send, 401, error_body("invalid or missing API key", "authentication_error",
                                                          code="invalid_api_key"),
                                    [(b"www-authenticate", b"Bearer")])
        scope.setdefault("state", {})["tenant"] = tenant
        return await self.app(scope, receive, send)


def tenant_for(authorization: str, keys: list[bytes]) -> str | None:
    """The tenant of an `Authorization: Bearer KEY` header (the scheme in any case), or None where it
    names none of the keys. Every key is compared, in constant time: no early exit."""
    scheme, _, token = authorization.partition(" ")
    given = token.strip().encode("latin-1")
    matches = [hmac.compare_digest(given, key) for key in keys]
    if scheme.lower() != "bearer" or not any(matches):
        return None
    return tenant_of(keys[matches.index(True)])


def tenant_of(key: bytes) -> str:
    """A tenant's name: a digest of its API key (what the engine holds and could show, never the key)."""
    return hashlib.sha256(b"draftwise-tenant:" + key).hexdigest()[:16]


def api_keys(given: str | list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    """The keys a server accepts, from one key or several; an empty key is refused by name."""
    if given is not None and not isinstance(given, (str, list, tuple)):
        raise InvalidParameterError(f"api_key: one key or a list of keys, got {given!r}")
    keys = (given,) if isinstance(given, str) else tuple(given or ())
    if any(not isinstance(key, str) or not key.strip() for key in keys):
        raise InvalidParameterError("api_key: an API key must be a non-empty string")
    return keys


def host_name(header: str) -> str:
    """The name of a Host header, without its port ("[::1]:8000" -> "::1")."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header
