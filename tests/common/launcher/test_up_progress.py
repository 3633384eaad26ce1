"""`tandem up`'s progress lines while a worker starts: a worker compiling the CPU attention kernels is named as such,
not as a silent model load."""

from __future__ import annotations

import time

from tandem.common.launcher import up
from tandem.common.launcher.children import Child, stop_all

LISTENING = r"worker listening on 127\.0\.0\.1:(\d+)"


def _worker(name: str, first_line: str, port: int, tmp_path) -> Child:
    """A stand-in worker (a shell): prints `first_line`, works a second, then says where it listens."""
    script = f"echo '{first_line}'; sleep 1; echo 'worker listening on 127.0.0.1:{port}'"
    return Child(name, ["bash", "-c", script], str(tmp_path))


def test_the_wait_for_a_compiling_worker_says_it_is_compiling(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(up, "PROGRESS_S", 0.2)
    stack = up.Stack(up.UpConfig(), model_path=str(tmp_path))
    workers = []
    try:  # one after the other, so each one's wait is seen
        workers.append(_worker("prefill-0", f"WARNING: {up.COMPILING_KERNELS} (once, about 20 s) in /x", 4321,
                               tmp_path))
        assert stack._wait_port(workers[-1], LISTENING, time.monotonic() + 60) == 4321
        workers.append(_worker("decode-0", "NIXL INFO Backend UCX was instantiated", 4322, tmp_path))
        assert stack._wait_port(workers[-1], LISTENING, time.monotonic() + 60) == 4322
    finally:
        stop_all(workers, timeout=5)
    err = capsys.readouterr().err
    assert "tandem up: still waiting for prefill-0 to compile the CPU attention kernels (once) (" in err
    assert "still waiting for prefill-0 to load the model" not in err
    assert "tandem up: still waiting for decode-0 to load the model and listen (" in err
