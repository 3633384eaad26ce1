"""`tandem bench disagg` at its smallest on the tiny model: both policies complete the mixed workload, auto
prefills the chat turns on the decode and sends the documents through the pair, and with the prefill killed every
request is prefilled on the decode, none lost, nothing leaked."""

from __future__ import annotations

import json

import pytest

from tandem.common.bench.disagg import render_markdown
from tests.common.rpc.helpers import cli_in_process

pytestmark = pytest.mark.e2e


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_disagg_bench_tiny_run(tiny_llama, tmp_path, capsys):
    out = tmp_path / "disagg.json"
    code = cli_in_process(["bench", "disagg", "--model", tiny_llama, "--rounds", "1", "--chat-turns", "3",
                           "--documents", "2", "--document-words", "300", "--output-len", "6", "--concurrency", "3",
                           "--local-prefill-max-tokens", "64", "--output-json", str(out)])
    assert code == 0, capsys.readouterr().err[-3000:]
    result = json.loads(out.read_text())
    always, auto = result["policies"]["always"], result["policies"]["auto"]
    assert always["completed"] == auto["completed"] == 5 and always["failed"] == auto["failed"] == 0
    assert always["decisions"] == {"pair/policy_always": 5.0}
    assert auto["decisions"] == {"local/short_prompt": 3.0, "pair/long_prompt": 2.0}
    for policy in ("always", "auto"):
        down = result["prefill_down"][policy]
        assert down["completed"] == 5 and down["failed"] == 0
        # Each request ends prefilled locally (one sent before the router saw the kill tried the pair first).
        assert sum(v for k, v in down["decisions"].items() if k.startswith("local/")) == 5
        assert down["decisions"]["local/prefill_unavailable"] >= 2  # the documents at least
    assert result["leaks"] == {"decode": {"requests": 0, "kv_tokens": 0}}
    assert "prefill SIGKILLed" in render_markdown(result)
