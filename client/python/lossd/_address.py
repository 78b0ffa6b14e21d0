"""Which server addresses a Client takes, and what they name: the rules of the C++ client's
CheckServerAddress and ParseTarget (client/cpp/server_address.cc), with the same messages."""
import dataclasses

DEFAULT_PORT = 50051  # lossd_server's unless its --listen names another

# The name resolvers gRPC ships: a target that starts with one of these and a colon is a gRPC URI.
_GRPC_SCHEMES = ("dns", "unix", "unix-abstract", "ipv4", "ipv6", "vsock", "xds", "google-c2p")
_EXPECTED = "HOST:PORT or a gRPC target URI (dns:///HOST:PORT, ipv4:ADDR:PORT, unix:PATH)"


def _is_port(text):
    return text.isascii() and text.isdigit() and 1 <= int(text) <= 65535


def _host_and_port(address):
    """(whether address is HOST:PORT or [V6]:PORT with a valid port, whether the port is all that
    is missing)."""
    if address.startswith("["):
        close = address.find("]")
        if close <= 1:
            return False, False
        rest = address[close + 1:]
        if not rest:
            return False, True
        return rest[0] == ":" and _is_port(rest[1:]), False
    host, colon, port = address.partition(":")
    if not colon:
        return False, True
    # Colons after the first: an IPv6 address without brackets, whose port cannot be told apart.
    return bool(host) and ":" not in port and _is_port(port), False


def check(address, field="address"):
    """Raises ValueError, naming field, for a HOST without a port (gRPC would dial port 443, where
    no lossd listens) and for URLs such as http://HOST:PORT (gRPC cannot resolve them), with the
    address to give instead. HOST:PORT, [IPV6]:PORT and gRPC target URIs (dns:, ipv4:, ipv6:,
    unix:, unix-abstract:, vsock:, xds:) pass, the URIs left to gRPC."""
    if not isinstance(address, str) or not address:
        got = "an empty string" if address == "" else f"{type(address).__name__} {address!r}"
        raise ValueError(f"{field}: expected {_EXPECTED}, got {got}")
    scheme, colon, _ = address.partition(":")
    if colon and scheme.lower() in _GRPC_SCHEMES:
        return
    prefix = f'{field}: expected {_EXPECTED}, got "{address}"'
    separator = address.find("://")
    if separator >= 0:
        authority = address[separator + 3:].split("/", 1)[0]
        suggestion = authority if _host_and_port(authority)[0] else f"{authority}:{DEFAULT_PORT}"
        raise ValueError(f"{prefix}, a URL: gRPC takes no http:// or https:// scheme (root "
                         f'certificates turn TLS on); give "{suggestion}"')
    valid, port_missing = _host_and_port(address)
    if valid:
        return
    if port_missing:
        raise ValueError(f"{prefix}, which has no port: lossd listens on {DEFAULT_PORT} unless "
                         f'its --listen says otherwise, as in "{address}:{DEFAULT_PORT}"')
    if ":" in address.partition(":")[2]:
        raise ValueError(f"{prefix}: an IPv6 address goes in brackets, as in "
                         f'"[::1]:{DEFAULT_PORT}"')
    raise ValueError(f"{prefix}, which is not HOST:PORT with a port in [1, 65535]")


@dataclasses.dataclass(frozen=True)
class Target:
    """A channel target as the client reads it (parse_target)."""
    uri: str               # what the channels are built on: the address as written
    listed_addresses: int  # several for an ipv4:/ipv6: list, else 1
    # One server on this host: a loopback address or a Unix socket, where shared memory can
    # carry the rows instead of the connection.
    local: bool = False


def parse_target(address):
    """The Target of an address that check() takes. A DNS name (HOST:PORT, dns:) lists one
    address though it may resolve to several (a headless Service): calls that belong to one
    server then stay on the first that answers, so name one server, or a Service with one virtual
    IP, for training."""
    check(address)
    scheme, colon, rest = address.partition(":")
    if not colon or scheme.lower() not in ("ipv4", "ipv6"):
        return Target(address, 1, _is_local(address))
    # ipv4:ADDR:PORT,ADDR:PORT or, as a URI with an empty authority, ipv4:///ADDR:PORT,...
    entries = rest.lstrip("/").split(",")
    if not all(entries):
        raise ValueError(f"address: expected ADDR:PORT entries separated by commas after "
                         f'{scheme.lower()}:, got "{address}"')
    return Target(address, len(entries), len(entries) == 1 and _is_local(entries[0]))


def tcp_host(target):
    """The host of a Target that names one TCP server (HOST:PORT, dns:, or a one-entry ipv4: or
    ipv6: list), as a socket connects to it, without brackets; None for anything else (a Unix
    socket, several addresses, another resolver)."""
    if target.listed_addresses != 1:
        return None
    address = target.uri
    scheme, colon, rest = address.partition(":")
    scheme = scheme.lower()
    if colon and scheme in _GRPC_SCHEMES:
        if scheme not in ("dns", "ipv4", "ipv6"):
            return None
        address = rest.lstrip("/")
        if scheme == "dns" and rest.startswith("//") and "/" in address:  # dns://AUTHORITY/HOST
            address = address.split("/", 1)[1]
    if address.startswith("["):
        return address[1:address.find("]")] or None
    host = address.rpartition(":")[0]
    return host or None


def _is_local(address):
    """Whether one address names this host: a Unix socket, or a loopback host."""
    scheme, colon, rest = address.partition(":")
    scheme = scheme.lower()
    if colon and scheme in ("unix", "unix-abstract"):
        return True
    if colon and scheme in ("dns", "ipv4", "ipv6"):
        address = rest.lstrip("/")
        if "/" in address:  # dns://AUTHORITY/HOST:PORT
            address = address.split("/", 1)[1]
    host = address[1:address.find("]")] if address.startswith("[") else address.rpartition(":")[0]
    return host in ("localhost", "::1") or host.startswith("127.")


def replica_address(addresses, rank):
    """The address of the server replica that trainer rank `rank` trains with, when several
    servers train one head as a replica group (lossd_server --replicas=len(addresses)): rank r
    of a data-parallel job goes to addresses[r % len(addresses)], so each replica takes every
    R-th rank. addresses lists the replicas by their --replica_rank, replica 0 first."""
    addresses = list(addresses)
    if not addresses:
        raise ValueError("addresses: expected the address of every replica, replica 0 first, "
                         "got none")
    for i, address in enumerate(addresses):
        check(address, f"addresses[{i}]")
    if not (isinstance(rank, int) and rank >= 0):
        raise ValueError(f"rank: expected an int >= 0, got {rank!r}")
    return addresses[rank % len(addresses)]


def replica_group(world_size, rank, replicas):
    """(world size, rank) of trainer rank `rank` of `world_size` among the ranks that train with
    the same replica (replica_address) of `replicas`: the ranks that meet there for a step."""
    if not (isinstance(replicas, int) and replicas >= 1):
        raise ValueError(f"replicas: expected an int >= 1, got {replicas!r}")
    if replicas > world_size:
        raise ValueError(f"replicas: {replicas} server replicas for {world_size} trainer ranks; "
                         f"every replica steps with the ranks it serves, so give at most one "
                         f"replica per rank")
    replica = rank % replicas
    return len(range(replica, world_size, replicas)), rank // replicas
