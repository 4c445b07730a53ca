"""Exit 0 when a gRPC server reports SERVING on grpc.health.v1, 1 otherwise.

The image's HEALTHCHECK and the compose healthchecks run this; it needs only grpcio and
grpcio-health-checking, which the scheduler image has. One line on stderr says why a
check failed.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="127.0.0.1:50051", help="HOST:PORT to ask")
    parser.add_argument(
        "--service",
        default="lattice.scheduler.v1.Scheduler",
        help='health service name ("" is the whole server)',
    )
    parser.add_argument("--timeout-seconds", type=float, default=2.0)
    args = parser.parse_args(argv)
    with grpc.insecure_channel(args.target) as channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service),
                timeout=args.timeout_seconds,
                wait_for_ready=False,
            )
        except grpc.RpcError as err:
            print(
                f"health check of {args.target} failed: {err.code().name}: {err.details()}",
                file=sys.stderr,
            )
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    if response.status != health_pb2.HealthCheckResponse.SERVING:
        print(f"{args.target} service {args.service!r} is {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
