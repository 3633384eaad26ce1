"""HiCache across workers: a second unified worker on the first one's storage directory reuses its pages (its own
device and host tiers start empty, so every cached token came from disk) and answers the same greedy text; the
router's /flush_cache {"tier": "disk"} empties the directory."""

from __future__ import annotations

import pytest

from tandem.common.launcher.children import free_port
from tests.services.router.conftest import RouterProcess, readiness, start_worker, wait_until
from tests.services.router.test_openai_extras import call

pytestmark = pytest.mark.e2e

PROMPT = "the quick brown fox jumps over the lazy dog " * 6


def hicache_flags(directory: str) -> list[str]:
    return ["--enable-hierarchical-cache", "--hicache-storage-backend", "file", "--hicache-storage-dir", directory,
            "--hicache-storage-prefetch-policy", "wait_complete"]


def serve_once(model: str, directory: str, body: dict, tier: str | None = None) -> dict:
    """One worker + router: the completion's reply (and, with `tier`, that tier flushed), then both stopped (the
    worker's shutdown drains its storage writes)."""
    worker = start_worker(model, port := free_port(), *hicache_flags(directory))
    router = RouterProcess("--worker", f"grpc://127.0.0.1:{port}", "--model-path", model, "--served-model-name",
                           "tiny")
    try:
        wait_until(lambda: readiness(router) == 200, 60, "router readiness")
        status, reply, _ = call(router, "/v1/completions", body)
        assert status == 200, reply
        if tier is not None:
            status, flushed, _ = call(router, "/flush_cache", {"tier": tier})
            assert status == 200 and flushed["success"], flushed
            status, error, _ = call(router, "/flush_cache", {"tier": "l4"})
            assert status == 400 and error["error"]["param"] == "tier"
        return reply
    finally:
        router.stop()
        assert worker.stop() == 0, "worker did not shut down cleanly:\n" + "".join(worker.log[-40:])


def test_second_worker_reuses_the_first_ones_storage_pages(tiny_llama, tmp_path):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    first = serve_once(tiny_llama, str(tmp_path), body)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert any(tmp_path.iterdir()), "the first worker stored no page"
    second = serve_once(tiny_llama, str(tmp_path), body, tier="disk")
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # nothing else could have held them
    assert not any(tmp_path.iterdir()), "flush_cache tier disk left pages"
