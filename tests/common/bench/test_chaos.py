"""`tandem bench chaos --short` (what CI runs) on the tiny model: every phase runs, faults are seen and recovered
from, and no worker keeps a request or a KV token afterwards."""

from __future__ import annotations

import json

import pytest

from tandem.common.bench.chaos import render_doc
from tests.common.rpc.helpers import cli_in_process

pytestmark = pytest.mark.e2e


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_chaos_short_run_recovers_and_leaks_nothing(tiny_llama, tmp_path, capsys):
    out, doc = tmp_path / "chaos.json", tmp_path / "reliability.md"
    # The entry point's main in this process (the stack it starts is processes): no interpreter of its own to start
    code = cli_in_process(["bench", "chaos", "--short", "--model", tiny_llama, "--output-json", str(out),
                           "--write-doc", str(doc)])
    assert code == 0, capsys.readouterr().err[-3000:]
    result = json.loads(out.read_text())
    mixed, killed, stopped, prefill_killed, burst = result["phases"]
    # Client disconnects are no errors, and every other request completes.
    assert mixed["requests"] == 32 and mixed["ok"] + mixed["disconnected"] == 32 and not mixed["errors"]
    assert mixed["disconnected"] > 0
    # A decode killed under traffic: its streams move to the other decode mid-stream, nothing fails, and traffic
    # is served once it is back.
    assert killed["migrated"] > 0 and not killed["errors"], killed
    assert killed["ok"] == killed["requests"] and killed["time_to_recovery_s"] is not None, killed
    # The prefill stopped or killed: the decodes prefill every request themselves (local-prefill fallback).
    for fault in (stopped, prefill_killed):
        assert fault["ok"] == fault["requests"] > 0 and not fault["errors"], fault
        assert fault["local_prefill"] > 0, fault
    assert burst["requests"] == 32 and burst["ok"] + sum(burst["errors"].values()) == 32
    assert set(result["leaks"]) == {"prefill", "decode-0", "decode-1"}
    assert all(leak == {"requests": 0, "kv_tokens": 0} for leak in result["leaks"].values()), result["leaks"]
    assert "decode SIGKILL" in doc.read_text() and doc.read_text() == render_doc(result)
