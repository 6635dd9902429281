"""Access control on the OpenAI port: API keys, the auth middleware, the bind policy.

Key sources, highest precedence first (as for the cluster secret):

1. ``--api-key-file <PATH>``
2. ``MLXCEL_API_KEY_FILE=<PATH>``
3. ``MLXCEL_API_KEY=<VALUE>`` (both environment variables set is an error)

A key file holds one or more keys, one per line; blank lines and lines starting
with ``#`` are ignored.  When keys are configured, every request needs
``Authorization: Bearer <key>`` (on the Anthropic routes also ``x-api-key: <key>``) except ``GET /health`` (and ``/metrics`` with
``--metrics-public``): deny by default, so a route added later is covered too.

Fail closed: listening on an address that is not loopback without a key is
refused unless ``--allow-unauthenticated`` is given.  Keys never appear in a
repr, an error, a log line or ``/metrics``; there is deliberately no flag that
takes a key value (it would show in process listings).
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import ipaddress
import json
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, NoReturn

from mlxcel import envs
from mlxcel.config import ENV_KEY, ENV_KEY_FILE
from mlxcel.errors import CLIError
from mlxcel.flagset import FlagSet
from mlxcel.private_file import read_private_file
from mlxcel.server.tls import TLSConfig, add_tls_arguments, load_tls

log = logging.getLogger("mlxcel.server.access")

CLI_FLAG = "--api-key-file"
OPEN_PATHS = frozenset({"/health"})
METRICS_PATH = "/metrics"
SHORT_KEY_LEN = 16

REFUSE_MESSAGE = (
    "refusing to listen on {host} without an API key: anyone who can reach it could use the server; "
    f"pass {CLI_FLAG} <PATH>, or set {ENV_KEY_FILE}=<PATH> or {ENV_KEY}=<VALUE> "
    "(or pass --allow-unauthenticated to serve it without a key)"
)


class AccessError(CLIError):
    """A key or bind-policy problem, phrased for the operator (never containing a key)."""


class APIKeys:
    """The accepted keys (as SHA-256 digests) and where they came from; never shows a key."""

    __slots__ = ("_digests", "source", "count")

    def __init__(self, keys: list[str], source: str) -> None:
        if not keys:
            raise AccessError(f"no API key in {source}: put one key per line")
        self._digests = tuple(_digest(k.encode("ascii")) for k in keys)
        self.source = source
        self.count = len(keys)

    def matches(self, candidate: bytes) -> bool:
        """Constant time: compares the candidate's digest with every key's, with no early exit.

        Comparing fixed-size digests also hides the keys' lengths.
        """
        probe = _digest(candidate)
        found = False
        for digest in self._digests:
            found |= hmac.compare_digest(digest, probe)
        return found

    def __repr__(self) -> str:
        return f"APIKeys(<{self.count} redacted>, source={self.source!r})"

    __str__ = __repr__

    def __format__(self, spec: str) -> str:
        return repr(self)

    def __reduce__(self) -> NoReturn:
        raise TypeError("APIKeys cannot be pickled")


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


def parse_keys(text: str, source: str) -> list[str]:
    """One key per line; blank lines and ``#`` comments skipped; a key is printable ASCII without spaces."""
    keys = []
    for number, line in enumerate(text.splitlines(), 1):
        key = line.strip()
        if not key or key.startswith("#"):
            continue
        if not all("!" <= c <= "~" for c in key):
            raise AccessError(f"line {number} of {source}: an API key must be printable ASCII without spaces")
        if len(key) < SHORT_KEY_LEN:
            log.warning("the API key on line %d of %s is shorter than %d characters; "
                        "generate one with: openssl rand -hex 32", number, source, SHORT_KEY_LEN)
        keys.append(key)
    return keys


def _read_key_file(path: Path, label: str) -> str:
    source = f"{path} (from {label})"
    raw = read_private_file(path, "the API key file", source, AccessError, log)
    try:
        return raw.decode("ascii")
    except UnicodeDecodeError:
        raise AccessError(f"the API key file {source} is not ASCII text") from None


def load_api_keys(cli_file: str | os.PathLike[str] | None = None, *,
                  env: Mapping[str, str] | None = None) -> APIKeys | None:
    """Keys from the highest-precedence configured source; None when none is configured."""
    settings = envs.settings() if env is None else envs.read(env)
    env_file, env_value = settings.api_key_file, settings.api_key
    if env_file is not None and env_value is not None:
        raise AccessError(f"both {ENV_KEY_FILE} and {ENV_KEY} are set; set only one of them")
    if cli_file is not None:
        path = Path(cli_file).expanduser()
        return APIKeys(parse_keys(_read_key_file(path, CLI_FLAG), f"{path}"), f"{CLI_FLAG} {path}")
    if env_file is not None:
        if not env_file:
            raise AccessError(f"{ENV_KEY_FILE} is set but empty")
        path = Path(env_file).expanduser()
        return APIKeys(parse_keys(_read_key_file(path, ENV_KEY_FILE), f"{path}"), f"{ENV_KEY_FILE} {path}")
    if env_value is not None:
        return APIKeys(parse_keys(env_value, ENV_KEY), ENV_KEY)
    return None


def is_loopback(host: str) -> bool:
    """True when every address ``host`` names is loopback (127.0.0.0/8, ::1, localhost).

    The wildcard addresses (0.0.0.0, ::, an empty host) listen on every interface: not loopback.
    A name that does not resolve counts as not loopback (fail closed).
    """
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        return _ip_is_loopback(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        pass
    if not host:
        return False
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return False
    return bool(infos) and all(_ip_is_loopback(ipaddress.ip_address(info[4][0].split("%")[0])) for info in infos)


def _ip_is_loopback(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def check_bind_policy(host: str, keys: APIKeys | None, allow_unauthenticated: bool) -> None:
    """Fail closed: no key on a non-loopback address is refused unless explicitly allowed."""
    if keys is None and not allow_unauthenticated and not is_loopback(host):
        raise AccessError(REFUSE_MESSAGE.format(host=host or "every interface"))


@dataclass(frozen=True)
class AccessConfig:
    """What the launch layer hands the app and uvicorn."""

    keys: APIKeys | None = None
    metrics_public: bool = False
    allow_unauthenticated: bool = False
    tls: TLSConfig | None = None

    @property
    def scheme(self) -> str:
        return "https" if self.tls is not None else "http"

    def open_paths(self) -> frozenset[str]:
        return OPEN_PATHS | {METRICS_PATH} if self.metrics_public else OPEN_PATHS

    def uvicorn_options(self) -> dict[str, Any]:
        return self.tls.uvicorn_options() if self.tls is not None else {}


def add_access_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags for every role with an OpenAI port (single node, pipeline coordinator, router)."""
    g = parser.add_argument_group("access control")
    g.add_argument(CLI_FLAG, dest="api_key_file", metavar="PATH", default=None,
                   help=f"file of accepted API keys, one per line (also {ENV_KEY_FILE}=PATH or {ENV_KEY}=KEY); "
                        "requests then need 'Authorization: Bearer <key>'")
    g.add_argument("--metrics-public", action="store_true",
                   help="serve /metrics without a key (default: /metrics needs the key when keys are configured)")
    g.add_argument("--allow-unauthenticated", action="store_true",
                   help="allow listening on a non-loopback address without an API key (logs a warning)")
    add_tls_arguments(g)


@dataclass(frozen=True)
class AccessFlags(FlagSet):
    """The access-control flags as parsed (``add_access_arguments``): API keys, /metrics, TLS files."""

    api_key_file: str | None = None
    metrics_public: bool = False
    allow_unauthenticated: bool = False
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None

    add_arguments = staticmethod(add_access_arguments)


def prepare_access(flags: AccessFlags, host: str, env: Mapping[str, str] | None = None, *,
                   health_only: bool = False) -> AccessConfig:
    """Load keys and TLS and apply the bind policy to ``host`` (--host); call before binding.
    Raises AccessError/CLIError.

    ``health_only``: the port serves nothing but /health (a pipeline stage), so no key is needed on it.
    """
    keys = load_api_keys(flags.api_key_file, env=env)
    if not health_only:
        check_bind_policy(host, keys, flags.allow_unauthenticated)
    access = AccessConfig(keys=keys, metrics_public=flags.metrics_public,
                          allow_unauthenticated=flags.allow_unauthenticated,
                          tls=load_tls(flags.ssl_certfile, flags.ssl_keyfile))
    log_access(access, host)
    return access


def log_access(access: AccessConfig, host: str) -> None:
    """One start-up line on what protects the port (never a key)."""
    if access.keys is not None:
        metrics = "open" if access.metrics_public else "needs the key"
        log.info("API key required for every endpoint but /health (%d key(s) from %s; /metrics %s)",
                 access.keys.count, access.keys.source, metrics)
    elif access.allow_unauthenticated:
        log.warning("serving without an API key on %s (--allow-unauthenticated): "
                    "anyone who can reach this port can use the server", host or "every interface")


# --- the middleware -------------------------------------------------------------------------------

_MISSING = "You didn't provide an API key. Send it in an Authorization header: 'Authorization: Bearer <key>'."
_NOT_BEARER = "The Authorization header must use the Bearer scheme: 'Authorization: Bearer <key>'."
_WRONG = "Incorrect API key provided."
_MISSING_ANTHROPIC = "You didn't provide an API key. Send it in an x-api-key header or as 'Authorization: Bearer <key>'."


def bearer_token(headers: list[tuple[bytes, bytes]], x_api_key: bool = False) -> tuple[bytes | None, str]:
    """The token of the first Authorization header, or None and the reason it is unusable.

    ``x_api_key`` (Anthropic's routes, whose clients send ``x-api-key: <key>``): without an Authorization
    header, the first ``x-api-key`` header counts.
    """
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            if scheme.lower() != b"bearer" or not token.strip():
                return None, _NOT_BEARER
            return token.strip(), _WRONG
    if x_api_key:
        for name, value in headers:
            if name.lower() == b"x-api-key":
                return (value.strip(), _WRONG) if value.strip() else (None, _MISSING_ANTHROPIC)
        return None, _MISSING_ANTHROPIC
    return None, _MISSING


def unauthorized_body(message: str, anthropic: bool = False) -> bytes:
    """The 401 body in OpenAI's shape, or in Anthropic's (``authentication_error``) on its routes."""
    from mlxcel.server.errors import anthropic_error
    from mlxcel.server.protocol import ErrorDetail, ErrorResponse

    if anthropic:
        return json.dumps(anthropic_error(401, message)).encode()
    detail = ErrorDetail(message=message, type="invalid_request_error", param=None, code="invalid_api_key")
    return ErrorResponse(error=detail).model_dump_json().encode()


class APIKeyMiddleware:
    """Pure ASGI middleware: 401 in OpenAI's shape unless the path is open or the bearer key matches."""

    def __init__(self, app: Any, keys: APIKeys, open_paths: frozenset[str] = OPEN_PATHS):
        self.app = app
        self.keys = keys
        self.open_paths = open_paths
        from mlxcel.server.errors import is_anthropic

        self._is_anthropic = is_anthropic
        self._bodies = {(reason, anthropic): unauthorized_body(reason, anthropic)
                        for reason in (_MISSING, _MISSING_ANTHROPIC, _NOT_BEARER, _WRONG)
                        for anthropic in (False, True)}

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] not in ("http", "websocket") or scope.get("path", "") in self.open_paths:
            await self.app(scope, receive, send)
            return
        anthropic = self._is_anthropic(scope.get("path", ""))
        token, reason = bearer_token(scope.get("headers", []), x_api_key=anthropic)
        if token is not None and self.keys.matches(token):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        challenge = b'Bearer error="invalid_token"' if token is not None else b"Bearer"
        body = self._bodies[reason, anthropic]
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", challenge)]})
        await send({"type": "http.response.body", "body": body})


def install_access(app: Any, access: AccessConfig | None) -> None:
    """Add the key check to a Starlette/FastAPI app when keys are configured."""
    if access is not None and access.keys is not None:
        app.add_middleware(APIKeyMiddleware, keys=access.keys, open_paths=access.open_paths())
