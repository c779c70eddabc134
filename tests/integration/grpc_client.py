"""The stock PyPI gRPC clients, run under the test tools' venv
(deploy/install-test-tools.sh) by the suites, which run under the system
python:

  grpc_client.py reflection HOST:PORT   the services a server lists
  grpc_client.py health HOST:PORT [SERVICE]   one Check: the status's name
"""
import sys

import grpc


def main():
    command, target = sys.argv[1], sys.argv[2]
    channel = grpc.insecure_channel(target)
    if command == "reflection":
        from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
            ProtoReflectionDescriptorDatabase)
        database = ProtoReflectionDescriptorDatabase(channel)
        services = list(database.get_services())
        # Each listed service must also resolve to its descriptor.
        for service in services:
            database.FindFileContainingSymbol(service)
        print("\n".join(services))
    elif command == "health":
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        stub = health_pb2_grpc.HealthStub(channel)
        service = sys.argv[3] if len(sys.argv) > 3 else ""
        response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        print(health_pb2.HealthCheckResponse.ServingStatus.Name(response.status))
    else:
        raise SystemExit(f"unknown command {command}")


if __name__ == "__main__":
    main()
