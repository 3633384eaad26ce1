"""Tandem's observability: OpenTelemetry traces (opt-in via OTEL_* variables, `tracing`, `propagation`) and
Prometheus metrics (`metrics`, `metrics_server`). Import the submodule you need."""
