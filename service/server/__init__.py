"""The scheduler process's gRPC edge (grpc.aio): server, servicer, conversion, status codes, wake-ups, metrics."""
