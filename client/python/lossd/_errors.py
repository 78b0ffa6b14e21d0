"""The errors of lossd's Python client."""
import grpc

# What gRPC says when nothing listens where a call went.
_NO_SERVER_SIGNS = ("Connection refused", "failed to connect", "Failed to connect",
                    "DNS resolution failed")


class LossdError(RuntimeError):
    """A failed call: the gRPC status code name (e.g. "INVALID_ARGUMENT") and the server's
    message."""

    def __init__(self, method, code, message):
        super().__init__(f"{method}: {code}: {message}")
        self.method = method
        self.code = code
        self.message = message

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
        return cls(method, code, details)


def _code_name(code):
    """The name of a gRPC status code number, as LossdError carries it."""
    for status in grpc.StatusCode:
        if status.value[0] == code:
            return status.name
    return str(code)
