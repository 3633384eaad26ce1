"""KV transfer between prefill and decode workers over NIXL, paired through the bootstrap gRPC service.

Import from the modules (kv_manager, messages, failures): `failures` stays importable without torch or NIXL,
which the router relies on."""
