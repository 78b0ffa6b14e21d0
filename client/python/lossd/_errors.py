"""The errors of lossd's Python client."""
import grpc

from .v1 import lossd_pb2 as pb

# What gRPC says when nothing listens where a call went.
_NO_SERVER_SIGNS = ("Connection refused", "failed to connect", "Failed to connect",
                    "DNS resolution failed")


class LossdError(RuntimeError):
    """A failed call: the gRPC status code name (e.g. "INVALID_ARGUMENT") and the server's
    message, and what code acts on: `reason`, the name of the server's ErrorInfo.Reason
    ("QUEUE_FULL", "PENDING_MEMORY", "HEAD_MOVED", ...) or None, and `field`, the request field the
    error is about or None."""

    def __init__(self, method, code, message, reason=None, field=None):
        super().__init__(f"{method}: {code}: {message}")
        self.method = method
        self.code = code
        self.message = message
        self.reason = reason
        self.field = field

    @classmethod
    def from_rpc_error(cls, method, error, address=None):
        """The error of a failed gRPC call; with the client's address, a call that reached no
        server says where it looked and what to start."""
        details = error.details() or ""
        code = error.code().name
        if address is not None and code == "UNAVAILABLE" and any(
                sign in details for sign in _NO_SERVER_SIGNS):
            details += (f" -- no lossd server answers at {address}: start one there (for "
                        f"example `lossd_server --listen={address}`), or give the Client the "
                        f"address a running server listens on")
        reason, field = _error_info(error)
        return cls(method, code, details, reason=reason, field=field)


def _error_info(error):
    """(reason, field) of the ErrorInfo in a failed call's status details (the
    grpc-status-details-bin trailer, an RpcStatus), each None when absent."""
    try:
        metadata = error.trailing_metadata() or ()
    except Exception:  # an error that is no call (raised before one began) has no trailers
        return None, None
    for key, value in metadata:
        if key != "grpc-status-details-bin":
            continue
        try:
            status = pb.RpcStatus.FromString(value)
        except Exception:  # not ours: a proxy's, say
            return None, None
        return _status_info(status)
    return None, None


def _status_info(status):
    """(reason, field) of the ErrorInfo in an RpcStatus's details, each None when absent."""
    for detail in status.details:
        info = pb.ErrorInfo()
        if detail.Unpack(info):
            reason = pb.ErrorInfo.Reason.Name(info.reason)
            return (None if info.reason == pb.ErrorInfo.REASON_UNSPECIFIED else reason,
                    info.field or None)
    return None, None


def from_rpc_status(method, status):
    """The error of a call that ended with `status` (an RpcStatus with a code other than 0), as
    the Compute socket's FRAME_STATUS carries it: the same as the call over gRPC would raise."""
    reason, field = _status_info(status)
    return LossdError(method, _code_name(status.code), status.message, reason=reason, field=field)


def _code_name(code):
    """The name of a gRPC status code number, as LossdError carries it."""
    for status in grpc.StatusCode:
        if status.value[0] == code:
            return status.name
    return str(code)
