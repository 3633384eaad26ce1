"""A `--dp-size N` worker, prefill or decode process is only the controller that routes to its replicas: it never
imports torch (seconds of CPU at each start; the replicas load it). The served controller's own check is in
test_dp_worker.py (no libtorch mapped in the live process)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.common.rpc.helpers import REPO_ROOT

pytestmark = pytest.mark.e2e

# The command's real start-up, up to the controller: run_data_parallel reports instead of starting replicas.
_SCRIPT = """
import sys
import tandem.common.dp.serve as serve

def report(config, worker, tls, server_args, role=serve.DPRole()):
    print(role.role.value, config.dp_size, sorted(m for m in ("torch", "transformers") if m in sys.modules))
    return 0

serve.run_data_parallel = report
from tandem.common import cli
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("command,role", [("worker", "unified"), ("prefill", "prefill"), ("decode", "decode")])
def test_a_data_parallel_controller_starts_without_torch(tiny_llama, command, role):
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, command, "--model", tiny_llama, "--dp-size", "2",
                           "--port", "0"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == f"{role} 2 []"


def test_the_report_sees_torch_once_something_loads_it(tiny_llama):
    """The check above can fail: the same start-up after importing the engine (torch) reports it."""
    script = _SCRIPT.replace("from tandem.common import cli", "import tandem.common.engine\nfrom tandem.common import cli")
    proc = subprocess.run([sys.executable, "-c", script, "worker", "--model", tiny_llama, "--dp-size", "2"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "unified 2 ['torch']"
