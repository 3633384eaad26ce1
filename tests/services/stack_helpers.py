"""A whole PD stack as real processes — prefill, decode and a router in front — plus /metrics scraping."""

from __future__ import annotations

import os
import urllib.request
from contextlib import contextmanager
from typing import Iterator, Optional

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.common.rpc.helpers import free_port
from tests.services.pd_helpers import PDPair
from tests.services.router.conftest import RouterProcess, readiness, wait_until


class PDStack:
    """Prefill + decode workers (each with a /metrics port) and a router over them."""

    def __init__(self, model_dir: str, env: Optional[dict[str, str]] = None):
        self.model_dir = model_dir
        self.prefill_metrics_port, self.decode_metrics_port = free_port(), free_port()
        with _environment(env or {}):  # the children inherit it; this process is left as it was
            self.pair = PDPair(model_dir, prefill_extra=("--metrics-port", str(self.prefill_metrics_port)),
                               decode_extra=("--metrics-port", str(self.decode_metrics_port)))
            try:
                self.router = RouterProcess(
                    "--prefill", f"grpc://{self.pair.prefill.address},{self.pair.prefill.bootstrap_port}",
                    "--decode", f"grpc://{self.pair.decode.address}", "--model-path", model_dir,
                    "--served-model-name", "tiny")
            except Exception:
                self.pair.close()
                raise
        wait_until(lambda: readiness(self.router) == 200, 60, "router readiness")

    @property
    def url(self) -> str:
        return self.router.url

    def scrape(self, which: str) -> "Scrape":
        port = {"router": self.router.port, "prefill": self.prefill_metrics_port,
                "decode": self.decode_metrics_port}[which]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            return Scrape(resp.read().decode())

    def close(self) -> None:
        router_code = self.router.stop()
        self.pair.close()
        assert router_code == 0, "router did not shut down cleanly:\n" + "".join(self.router.log[-40:])


class Scrape:
    """One Prometheus text exposition; value() finds a sample by name and labels."""

    def __init__(self, text: str):
        self.text = text
        self.samples = [s for family in text_string_to_metric_families(text) for s in family.samples]

    def value(self, name: str, **labels: str) -> float:
        found = [s.value for s in self.samples
                 if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
        if not found:
            pytest.fail(f"no sample {name}{labels} in:\n{self.text}")
        return sum(found)

    def values(self, name: str, **labels: str) -> dict[tuple, float]:
        return {tuple(sorted(s.labels.items())): s.value for s in self.samples
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())}


@contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old
