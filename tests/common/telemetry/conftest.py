"""Fixtures of the telemetry tests: a real OTLP receiver on 127.0.0.1."""

from tests.common.telemetry.otlp_receiver import otlp_receiver  # noqa: F401 - pytest finds fixtures in conftest
