"""The proxy's one error tree.

Every error the proxy raises on purpose is a `RadixError`. Each carries the HTTP status
and the llama-server error type it maps to, so the HTTP layer answers in llama-server's
shape (`to_body()`) without knowing which component failed.
"""

from __future__ import annotations

from enum import StrEnum


class RadixError(Exception):
    """Base of every deliberate proxy error: an HTTP status plus a llama-server error type."""

    status: int = 500
    err_type: str = "server_error"
    retry_after_s: float | None = None  # sent as Retry-After when set

    def __init__(self, message: str, *, status: int | None = None, err_type: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        # Instance overrides keep the class defaults for the common case.
        if status is not None:
            self.status = status
        if err_type is not None:
            self.err_type = err_type

    def to_body(self) -> dict[str, dict[str, object]]:
        """The error as llama-server writes it: {"error": {"code", "message", "type"}}."""
        return {"error": {"code": self.status, "message": self.message, "type": self.err_type}}


class BadRequest(RadixError):
    """The client's request is invalid."""

    status = 400
    err_type = "invalid_request_error"


class Unauthorized(RadixError):
    """Missing or wrong API key."""

    status = 401
    err_type = "authentication_error"


class TooLarge(RadixError):
    """The request body is larger than the proxy accepts (--max-body)."""

    status = 413
    err_type = "invalid_request_error"


class RequestTimeout(RadixError):
    """The client did not send its request body within --body-timeout; the connection is closed."""

    status = 408
    err_type = "invalid_request_error"


class Forbidden(RadixError):
    """The caller may not use this endpoint from where it is."""

    status = 403
    err_type = "permission_error"


class NotFound(RadixError):
    """Unknown route, model, slot or owner."""

    status = 404
    err_type = "not_found_error"


class NotSupported(RadixError):
    """A feature the proxy (or the server under it) does not offer."""

    status = 501
    err_type = "not_supported_error"


class Unavailable(RadixError):
    """No backend can take the request now (all busy, starting or down)."""

    status = 503
    err_type = "unavailable_error"
    retry_after_s = 1.0


class TooManyRequests(RadixError):
    """The wait queue is full."""

    status = 429
    err_type = "unavailable_error"
    retry_after_s = 1.0


class BackendError(RadixError):
    """A llama-server answered with an error or not at all; keeps what it said."""

    status = 502
    err_type = "server_error"

    def __init__(self, message: str, *, backend_status: int = 0, backend_message: str = "") -> None:
        super().__init__(message)
        self.backend_status = backend_status
        self.backend_message = backend_message


class PayloadError(RadixError):
    """A KV payload is malformed or does not match the expected layout (used internally)."""

    status = 400
    err_type = "server_error"


class FallbackCause(StrEnum):
    """Why a KV move failed: the step that failed; the label of ``radix_fallbacks_total``."""

    EXPORT = "export"
    IMPORT = "import"
    VERIFY = "verify"
    COMPAT = "compat"
    PAYLOAD = "payload"
    TRANSPORT = "transport"
    ATTACH = "attach"  # route S: attaching a resident prefix to a slot
    PUBLISH = "publish"  # recording a finished prompt as a resident prefix
    RELEASE = "release"  # freeing a resident prefix's owner sequence
    ERASE = "erase"  # clearing a slot that holds another cache-isolation key's KV
    INSTANCE = "instance"  # the server behind the URL restarted (another instance id): its state is gone
    CONFLICT = "conflict"  # the server's slot no longer holds the tokens the move names (409)
    TIMEOUT = "timeout"  # a KV move or the save after an answer ran past its deadline
    NO_SPACE = "no_space"  # the payload did not fit in the shared-memory directory, nor inline
    DOWN = "down"  # the server was taken out of routing (health checks) while a restore waited on it
    INTERNAL = "internal"  # an unexpected error in the proxy (logged with its traceback): a bug


class RejectReason(StrEnum):
    """Why admission refused a request (429 or 503); the label of ``radix_rejected_requests_total``."""

    QUEUE_FULL = "queue_full"  # --max-queue requests were already waiting (429)
    QUEUE_TIMEOUT = "queue_timeout"  # no slot became free within --queue-timeout (503)
    SHUTTING_DOWN = "shutting_down"  # the proxy is stopping: queued and new requests (503)
    NO_ROOM = "no_room"  # the server's KV pool had no room for the request in time (503)


class KvMoveError(RadixError):
    """A KV move failed; `cause` names the step.

    Callers clear the slot and fall back to a full prefill, so this rarely reaches a client.
    """

    status = 500
    err_type = "server_error"

    def __init__(self, cause: FallbackCause, message: str) -> None:
        super().__init__(f"kv move failed at {cause}: {message}")
        self.cause = cause


class ConfigError(RadixError):
    """A startup configuration problem; `fix` tells the operator what to change."""

    status = 500
    err_type = "server_error"

    def __init__(self, message: str, *, fix: str = "") -> None:
        super().__init__(message)
        self.fix = fix


class BuildError(RadixError):
    """Building the patched llama-server failed; `fix` tells the operator what to try."""

    status = 500
    err_type = "server_error"

    def __init__(self, message: str, *, fix: str = "") -> None:
        super().__init__(message)
        self.fix = fix
