"""`tandem planner` as a process: it reads a router's /metrics and serves its plan on --metrics-port."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tandem.common.telemetry.metrics import RouterMetrics, WorkerSample
from tests.common.rpc.helpers import REPO_ROOT

WORKERS = [WorkerSample("127.0.0.1:1", "prefill", True, 0, 0, 0, "closed"),
           WorkerSample("127.0.0.1:2", "decode", True, 0, 0, 0, "closed"),
           WorkerSample("127.0.0.1:3", "decode", True, 0, 0, 0, "closed")]


def fake_router() -> ThreadingHTTPServer:
    metrics = RouterMetrics()
    metrics.watch(lambda: WORKERS, lambda: 0, lambda: 0)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = metrics.render()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.mark.e2e
def test_the_planner_process_serves_its_plan():
    router = fake_router()
    proc = subprocess.Popen([sys.executable, "-m", "tandem.common.cli", "planner", "--router-url",
                             f"http://127.0.0.1:{router.server_address[1]}", "--interval-s", "0.2", "--window-s",
                             "0.4", "--metrics-host", "127.0.0.1", "--metrics-port", "0", "--min-decode", "2"],
                            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        port = int(re.search(r"metrics on http://127\.0\.0\.1:(\d+)/", proc.stdout.readline()).group(1))
        deadline, text = time.monotonic() + 60, ""
        while 'tandem_planner_desired_replicas{role="decode"}' not in text and time.monotonic() < deadline:
            time.sleep(0.2)
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert 'tandem_planner_desired_replicas{role="prefill"} 1.0' in text
        assert 'tandem_planner_desired_replicas{role="decode"} 2.0' in text
        assert 'tandem_planner_observed_replicas{role="decode"} 2.0' in text
    finally:
        proc.kill()
        proc.wait()
        router.shutdown()
