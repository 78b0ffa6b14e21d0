#!/usr/bin/env python3
"""Container health check for lossd_server: calls the standard gRPC health service
(/grpc.health.v1.Health/Check) and exits 0 when the server answers SERVING, 1 otherwise.

lossd_server reports SERVING once its heads are loaded and NOT_SERVING while it drains after
SIGTERM. Needs only python3-grpcio: the two tiny health messages are encoded here by hand, so no
generated stubs (and no grpc_health_probe binary) are needed.

    healthcheck.py [--address=127.0.0.1:50051] [--service=NAME] [--timeout=3]
                   [--tls_ca=ca.pem [--tls_server_name=lossd.example]]
"""
import argparse
import sys

import grpc

CHECK = "/grpc.health.v1.Health/Check"
STATUS_NAMES = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}
SERVING = 1


def _varint(value):
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def encode_request(service):
    """HealthCheckRequest { string service = 1; }"""
    data = service.encode()
    return b"\x0a" + _varint(len(data)) + data if data else b""


def decode_status(message):
    """HealthCheckResponse { ServingStatus status = 1; }: the status, 0 when absent."""
    status, i = 0, 0
    while i < len(message):
        key, i = _read_varint(message, i)
        field, wire_type = key >> 3, key & 7
        if wire_type == 0:
            value, i = _read_varint(message, i)
            if field == 1:
                status = value
        elif wire_type == 2:
            length, i = _read_varint(message, i)
            i += length
        elif wire_type == 1:
            i += 8
        elif wire_type == 5:
            i += 4
        else:
            raise ValueError(f"unexpected wire type {wire_type}")
    return status


def _read_varint(data, i):
    value, shift = 0, 0
    while True:
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, i
        shift += 7


def check(address, service="", timeout=3.0, tls_ca=None, tls_server_name=None):
    """Returns (exit code, one line saying why)."""
    if tls_ca:
        with open(tls_ca, "rb") as f:
            credentials = grpc.ssl_channel_credentials(root_certificates=f.read())
        options = [("grpc.ssl_target_name_override", tls_server_name)] if tls_server_name else []
        channel = grpc.secure_channel(address, credentials, options=options)
    else:
        channel = grpc.insecure_channel(address)
    with channel:
        call = channel.unary_unary(CHECK, request_serializer=None, response_deserializer=None)
        try:
            response = call(encode_request(service), timeout=timeout)
        except grpc.RpcError as e:
            return 1, f"{address}: health check failed: {e.code().name} {e.details()}"
    status = decode_status(response)
    name = STATUS_NAMES.get(status, str(status))
    return (0 if status == SERVING else 1), f"{address}: {name}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--address", default="127.0.0.1:50051", help="lossd_server's gRPC HOST:PORT")
    parser.add_argument("--service", default="", help="service name to check; empty: the server")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    parser.add_argument("--tls_ca", help="PEM root certificate when the server runs with TLS")
    parser.add_argument("--tls_server_name", help="name in the server's certificate, if not the address")
    args = parser.parse_args(argv)
    code, line = check(args.address, args.service, args.timeout, args.tls_ca, args.tls_server_name)
    print(line, file=sys.stdout if code == 0 else sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
