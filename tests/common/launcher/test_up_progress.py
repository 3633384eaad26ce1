"""`tandem up`'s progress lines while workers start: a worker compiling the CPU attention kernels is named as such,
and so is the wait of the others for it, instead of a silent "load the model"."""

from __future__ import annotations

import time

import pytest

from tandem.common.launcher import up
from tandem.common.launcher.children import Child, stop_all

LISTENING = r"worker listening on 127\.0\.0\.1:(\d+)"


def _worker(stack: up.Stack, name: str, script: str, port: int, tmp_path) -> Child:
    """A stand-in worker (a shell running `script`) that then says where it listens and stays up, as a worker does."""
    child = Child(name, ["bash", "-c", f"{script}; echo 'worker listening on 127.0.0.1:{port}'; exec sleep 60"],
                  str(tmp_path))
    stack.children.append(child)
    return child


def _compiles(seconds: float) -> str:
    return (f"echo 'WARNING: {up.COMPILING_KERNELS} (once, up to about 60 s) in /x'; sleep {seconds}; "
            f"echo 'WARNING: {up.COMPILED_KERNELS} in {seconds}.0 s'")


def test_the_wait_names_the_worker_that_compiles_the_kernels_and_those_waiting_for_it(tmp_path, monkeypatch,
                                                                                      capsys):
    monkeypatch.setattr(up, "PROGRESS_S", 0.2)
    stack = up.Stack(up.UpConfig(), model_path=str(tmp_path))
    try:
        first = _worker(stack, "prefill-0", _compiles(1), 4321, tmp_path)
        assert stack._wait_port(first, LISTENING, time.monotonic() + 60) == 4321
        compiler = _worker(stack, "decode-0", _compiles(2), 4322, tmp_path)
        waiting = _worker(stack, "prefill-1", "sleep 3", 4323, tmp_path)  # its turn on the build's flock
        assert stack._wait_port(waiting, LISTENING, time.monotonic() + 60) == 4323
        assert stack._wait_port(compiler, LISTENING, time.monotonic() + 60) == 4322
    finally:
        stop_all(stack.children, timeout=5)
    err = capsys.readouterr().err
    assert "tandem up: still waiting for prefill-0 to compile the CPU attention kernels (once) (" in err
    assert ("tandem up: still waiting for prefill-1 to load the model; decode-0 compiles the CPU attention kernels "
            "(once) and the others wait (") in err
    assert "tandem up: still waiting for prefill-1 to load the model and listen (" in err  # once decode-0 is done
    # While prefill-0 compiles, its wait is never called a model load; between its "compiled" line and its "listening"
    # line the progress loop may well tick once, and then "load the model and listen" is what it is doing.
    lines = err.splitlines()
    compiled = lines.index(f"[prefill-0] WARNING: {up.COMPILED_KERNELS} in 1.0 s")
    assert not any("still waiting for prefill-0 to load the model" in line for line in lines[:compiled])


def test_a_worker_that_exits_is_named_with_its_exit_code_and_one_that_listened_first_is_not_lost(tmp_path,
                                                                                               monkeypatch):
    monkeypatch.setattr(up, "PROGRESS_S", 0.1)
    stack = up.Stack(up.UpConfig(), model_path=str(tmp_path))
    try:
        early = Child("prefill-0", ["bash", "-c", "echo loading; exit 3"], str(tmp_path))
        stack.children.append(early)
        with pytest.raises(up.ChildFailed, match="prefill-0 exited with code 3 before it was ready"):
            stack._wait_port(early, LISTENING, time.monotonic() + 60)
        late = Child("decode-0", ["bash", "-c", "echo 'worker listening on 127.0.0.1:4320'"], str(tmp_path))
        stack.children.append(late)
        late.proc.wait()
        read = late.wait_for

        def tick_ends_before_the_line_is_read(pattern, timeout):  # what a loaded machine did in CI
            late.wait_for = read
            raise RuntimeError(f"decode-0 not ready after {timeout:.0f}s")

        late.wait_for = tick_ends_before_the_line_is_read
        assert stack._wait_port(late, LISTENING, time.monotonic() + 60) == 4320
    finally:
        stop_all(stack.children, timeout=5)
