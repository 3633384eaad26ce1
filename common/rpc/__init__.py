"""gRPC edge of a worker: SglangScheduler servicer, server, and the `tandem worker` command."""
