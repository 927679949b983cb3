"""Transport limits and the shared-token check of the scheduler's gRPC server.

* Messages are capped at :data:`MAX_MESSAGE_BYTES` both ways (gRPC answers RESOURCE_EXHAUSTED).
* A scheduler reachable from other hosts requires a shared token: every call carries it in the
  metadata key :data:`TOKEN_METADATA_KEY`; it is compared in constant time
  (:func:`hmac.compare_digest`), and a missing or wrong token is answered UNAUTHENTICATED
  before the request is even parsed.

The token authenticates, it does not encrypt: on an untrusted network put the scheduler behind
TLS or a VPN.
"""

from __future__ import annotations

import hmac
import ipaddress

import grpc

TOKEN_METADATA_KEY = "x-dynamix-token"
TOKEN_ENV = "DYNAMIX_TOKEN"
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


def _reject_unauthenticated(request, context):
    context.abort(grpc.StatusCode.UNAUTHENTICATED, f"missing or wrong {TOKEN_METADATA_KEY} metadata")


_REJECT = grpc.unary_unary_rpc_method_handler(_reject_unauthenticated)


class TokenInterceptor(grpc.ServerInterceptor):
    """Lets a call through only if its metadata carries the shared token."""

    def __init__(self, token: str):
        self._token = check_token(token).encode("ascii")

    def intercept_service(self, continuation, handler_call_details):
        supplied = b""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == TOKEN_METADATA_KEY:
                supplied = value.encode("utf-8", "replace") if isinstance(value, str) else bytes(value)
                break
        if hmac.compare_digest(supplied, self._token):
            return continuation(handler_call_details)
        return _REJECT
