"""Transport limits and the shared-token check of the scheduler's gRPC server.

* Messages are capped at :data:`MAX_MESSAGE_BYTES` both ways (gRPC answers RESOURCE_EXHAUSTED).
* A scheduler reachable from other hosts requires a shared token: every call carries it in the
  metadata key :data:`TOKEN_METADATA_KEY`; it is compared in constant time
  (:func:`hmac.compare_digest`), and a missing or wrong token is answered UNAUTHENTICATED
  before the request is even parsed.

The token authenticates, it does not encrypt. On an untrusted network turn on TLS: the scheduler
serves with a certificate and key (``dynamix scheduler --tls-cert/--tls-key``, or
``DYNAMIX_TLS_CERT``/``DYNAMIX_TLS_KEY``), and its clients (workers, node agents) verify it against a
CA certificate (``--tls-ca`` or ``DYNAMIX_TLS_CA``) through gRPC's SSL credentials
(:func:`server_credentials`, :func:`open_channel`). The certificate must name the address the
clients dial (a subjectAltName ``IP:10.0.0.1`` or ``DNS:ps0``). A plaintext client of a TLS
scheduler fails its handshake (UNAVAILABLE); the token is checked on top of TLS.

``bpslaunch``'s restart rendezvous (:mod:`dynamix_byteps.launcher.rendezvous`) is served and
called with the same token check and TLS (:func:`listen`, :func:`open_channel`).

The scheduler's Prometheus endpoint requires the same token, as an HTTP header
``Authorization: Bearer <token>`` (Prometheus: ``authorization: {credentials: <token>}`` in the
scrape config), when the scheduler has one (:func:`require_bearer_token`).
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import ssl
from pathlib import Path

import grpc

from dynamix_byteps.errors import ConfigurationError

TOKEN_METADATA_KEY = "x-dynamix-token"
TOKEN_ENV = "DYNAMIX_TOKEN"
TLS_CERT_ENV = "DYNAMIX_TLS_CERT"  # the scheduler's PEM certificate (chain)
TLS_KEY_ENV = "DYNAMIX_TLS_KEY"  # its PEM private key
TLS_CA_ENV = "DYNAMIX_TLS_CA"  # the PEM CA certificate(s) clients verify the scheduler with
MAX_MESSAGE_BYTES = 64 * 1024
MAX_CONCURRENT_RPCS = 8192  # beyond this gRPC answers RESOURCE_EXHAUSTED instead of queueing

SERVER_OPTIONS = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # Linux gRPC sets SO_REUSEPORT by default, which lets a second scheduler silently share the port.
    ("grpc.so_reuseport", 0),
)


def check_token(token: str) -> str:
    """Return ``token`` if usable as gRPC metadata; raises ValueError with the fix otherwise."""
    if not token:
        raise ValueError("the token is empty; pass --token or set DYNAMIX_TOKEN to a shared secret")
    if not all(33 <= ord(c) <= 126 for c in token):
        raise ValueError("the token must be printable ASCII without spaces (it travels as gRPC metadata)")
    return token


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IP addresses; other names count as reachable from outside."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def grpc_address(host: str, port: int) -> str:
    """``host:port`` for ``add_insecure_port``, bracketing IPv6 literals."""
    host = host.strip("[]")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def read_pem(path: str | os.PathLike, what: str) -> bytes:
    """The bytes of the PEM file ``path``; raises ConfigurationError naming ``what`` and the fix."""
    try:
        data = Path(path).read_bytes()
    except OSError as error:
        raise ConfigurationError(f"cannot read the {what} {path}: {error.strerror}; give the path of a PEM file") from None
    if b"-----BEGIN " not in data:
        raise ConfigurationError(f"the {what} {path} is not a PEM file (no -----BEGIN line)")
    return data


def server_credentials(cert: str | os.PathLike | None, key: str | os.PathLike | None) -> grpc.ServerCredentials | None:
    """gRPC SSL credentials of the scheduler from its certificate and key files; None when both are None.

    Raises:
        ConfigurationError: only one of the two is given, a file is unreadable or not PEM, or the
            key is not the certificate's.
    """
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        raise ConfigurationError("TLS needs both the certificate and its private key: pass --tls-cert and --tls-key "
                                 f"(or set {TLS_CERT_ENV} and {TLS_KEY_ENV})")
    credentials = grpc.ssl_server_credentials([(read_pem(key, "TLS private key"), read_pem(cert, "TLS certificate"))])
    _server_context(cert, key)  # gRPC itself only says "Failed to bind" on a key of another certificate
    return credentials


def _server_context(cert: str | os.PathLike, key: str | os.PathLike) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert, key)
    except ssl.SSLError as error:
        raise ConfigurationError(f"the TLS certificate {cert} and private key {key} are not a pair ({error.reason or error}); "
                                 "pass the certificate as --tls-cert and its own private key as --tls-key") from None
    return context


def check_tls_files(cert: str | os.PathLike, key: str | os.PathLike, ca: str | os.PathLike) -> None:
    """Check that ``key`` is the private key of ``cert`` and that ``ca`` verifies ``cert``, as the
    scheduler and its clients will, by a TLS handshake between two in-memory endpoints (the
    certificate's host names are not checked: the clients check them against the address they dial).

    Raises:
        ConfigurationError: naming the flag (``--tls-cert``, ``--tls-key``, ``--tls-ca``) that is wrong.
    """
    server = _server_context(cert, key)
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.check_hostname = False
    try:
        client.load_verify_locations(cafile=os.fspath(ca))
    except ssl.SSLError as error:
        raise ConfigurationError(f"the TLS CA certificate {ca} holds no certificate ({error.reason or error}); "
                                 "pass the CA certificate that signed --tls-cert as --tls-ca") from None
    buffers = [ssl.MemoryBIO() for _ in range(4)]
    server_end = server.wrap_bio(buffers[0], buffers[1], server_side=True)
    client_end = client.wrap_bio(buffers[2], buffers[3])
    for _ in range(8):  # a TLS 1.2/1.3 handshake takes at most a few flights
        done = True
        for end in (client_end, server_end):
            try:
                end.do_handshake()
            except ssl.SSLWantReadError:
                done = False
            except ssl.SSLCertVerificationError as error:
                raise ConfigurationError(
                    f"the TLS CA certificate {ca} does not verify the certificate {cert} ({error.verify_message}); "
                    "pass the CA certificate that signed --tls-cert as --tls-ca") from None
            except ssl.SSLError as error:
                raise ConfigurationError(f"a TLS handshake with the certificate {cert} and the CA {ca} fails: "
                                         f"{error.reason or error}; check --tls-cert, --tls-key and --tls-ca") from None
        buffers[0].write(buffers[3].read())
        buffers[2].write(buffers[1].read())
        if done:
            return
    raise ConfigurationError(f"a TLS handshake with the certificate {cert} and the CA {ca} did not complete; "
                             "check --tls-cert, --tls-key and --tls-ca")


def listen(server: grpc.Server, host: str, port: int, credentials: grpc.ServerCredentials | None) -> int:
    """Add the listening address ``host:port`` (0 = pick one) to ``server``, TLS when ``credentials``
    (:func:`server_credentials`) is not None; returns the port.

    Raises:
        OSError: the address is in use or not local (gRPC's reason when it gives one).
    """
    address = grpc_address(host, port)
    try:
        bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError as error:
        raise OSError(f"cannot listen on {address}: {error}") from None
    if not bound:
        raise OSError(f"cannot listen on {address}: address in use or not local")
    return bound


def open_channel(address: str, ca: str | os.PathLike | None = None, options=()) -> grpc.Channel:
    """A channel to ``address`` (``host:port``): TLS verified against the CA file ``ca``, else plaintext.

    Raises:
        ConfigurationError: ``ca`` is unreadable or not PEM.
    """
    if ca is None:
        return grpc.insecure_channel(address, options=list(options))
    credentials = grpc.ssl_channel_credentials(root_certificates=read_pem(ca, "TLS CA certificate"))
    return grpc.secure_channel(address, credentials, options=list(options))


_UNAUTHENTICATED = f"missing or wrong {TOKEN_METADATA_KEY} metadata"


def _reject_unauthenticated(requests, context):
    context.abort(grpc.StatusCode.UNAUTHENTICATED, _UNAUTHENTICATED)


async def _reject_unauthenticated_async(requests, context):
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, _UNAUTHENTICATED)


# Request-streaming, so that the refusal is sent without reading the request: a unary handler's
# thread first waits for the whole request, and clients that send headers but never a message
# would hold every handler thread of the server (the rendezvous has 2·hosts + 4) unanswered.
_REJECT = grpc.stream_unary_rpc_method_handler(_reject_unauthenticated)
_REJECT_ASYNC = grpc.stream_unary_rpc_method_handler(_reject_unauthenticated_async)


def require_bearer_token(app, token: str):
    """The WSGI application ``app``, answering 401 to a request without ``Authorization: Bearer <token>``.

    Raises:
        ValueError: ``token`` is not usable (see :func:`check_token`).
    """
    expected = ("Bearer " + check_token(token)).encode("ascii")

    def protected(environ, start_response):
        supplied = environ.get("HTTP_AUTHORIZATION", "").encode("utf-8", "replace")
        if hmac.compare_digest(supplied, expected):
            return app(environ, start_response)
        start_response("401 Unauthorized", [("Content-Type", "text/plain"), ("WWW-Authenticate", "Bearer")])
        return [b"missing or wrong 'Authorization: Bearer <token>' header\n"]

    return protected


class TokenInterceptor(grpc.ServerInterceptor):
    """Lets a call through only if its metadata carries the shared token (a ``grpc.server``)."""

    def __init__(self, token: str):
        self._token = check_token(token).encode("ascii")

    def carries_token(self, handler_call_details: grpc.HandlerCallDetails) -> bool:
        """Whether the call's metadata holds the token (compared in constant time)."""
        supplied = b""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == TOKEN_METADATA_KEY:
                supplied = value.encode("utf-8", "replace") if isinstance(value, str) else bytes(value)
                break
        return hmac.compare_digest(supplied, self._token)

    def intercept_service(self, continuation, handler_call_details):
        return continuation(handler_call_details) if self.carries_token(handler_call_details) else _REJECT


class AsyncTokenInterceptor(grpc.aio.ServerInterceptor):
    """:class:`TokenInterceptor` for a ``grpc.aio`` server: a call without the token is refused
    on the event loop, before its request is read."""

    def __init__(self, token: str):
        self._check = TokenInterceptor(token)

    async def intercept_service(self, continuation, handler_call_details):
        if self._check.carries_token(handler_call_details):
            return await continuation(handler_call_details)
        return _REJECT_ASYNC
