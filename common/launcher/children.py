"""A child process of `tandem up`: its own process group, its output prefixed and forwarded, a clean stop."""

from __future__ import annotations

import collections
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO, Optional

TAIL_LINES = 40


# The line a prefill worker prints once its bootstrap server listens (it binds --bootstrap-port 0 itself).
# Anchored: a data-parallel controller forwards its replicas' lines too, each after "[dp N] ".
BOOTSTRAP_LISTENING = r"^tandem prefill bootstrap server listening on 127\.0\.0\.1:(\d+)"


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now, for a process started next to bind.

    Picked outside the kernel's ephemeral range (net.ipv4.ip_local_port_range), where every bind to port 0 and
    every outgoing connection takes its port: a port from that range could be taken — by a UCX listener, say —
    in the seconds between this pick and the child's bind."""
    low, high = _ephemeral_range()
    below = range(max(1024, low - 20000), low)  # ports a process binds only when told to
    above = range(high + 1, 65536)
    candidates = list(below) + list(above)
    for port in random.sample(candidates, min(len(candidates), 200)):
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # every candidate taken: the OS's pick
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = map(int, f.read().split())
        return low, high
    except (OSError, ValueError):  # not Linux: the IANA range
        return 49152, 65535


class Child:
    """One `python -m tandem.common.cli ...` process; `wait_for(pattern)` finds a line of its output."""

    def __init__(self, name: str, argv: list[str], cwd: str, log_dir: Optional[str] = None,
                 env: Optional[dict[str, str]] = None):
        """`env`: variables set on top of this process's environment."""
        self.name = name
        self.grpc_url: Optional[str] = None  # a worker's, once it listens
        env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
        # A process group of its own: the terminal's Ctrl-C reaches `tandem up` alone, which then stops
        # every child in order instead of all of them racing to die at once.
        self.proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, text=True, errors="replace", start_new_session=True)
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._lines_seen = threading.Condition()
        self._startup_lines: Optional[list[str]] = []
        self._sink: IO[str] = open(os.path.join(log_dir, f"{name}.log"), "a") if log_dir else sys.stderr
        self._reader = threading.Thread(target=self._forward, name=f"log-{name}", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _forward(self) -> None:
        prefix = f"[{self.name}] "
        for line in self.proc.stdout:
            # Written before it is seen: whatever a waiter prints because of a line comes after the line itself.
            try:
                self._sink.write(prefix + line if self._sink is sys.stderr else line)
                self._sink.flush()
            except (ValueError, OSError):  # our stderr or the log file went away; keep draining the pipe
                pass
            with self._lines_seen:
                self.tail.append(line.rstrip("\n"))
                if self._startup_lines is not None:
                    self._startup_lines.append(line)
                self._lines_seen.notify_all()
        with self._lines_seen:
            self._lines_seen.notify_all()

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        """The first output line matching `pattern`; RuntimeError if the child exits or time runs out first."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        checked = 0
        with self._lines_seen:
            while True:
                for line in self._startup_lines[checked:]:
                    match = regex.search(line)
                    if match:
                        return match
                checked = len(self._startup_lines)
                if self.proc.poll() is not None and not self._reader.is_alive():
                    raise RuntimeError(f"{self.name} exited with code {self.proc.returncode} before it was ready")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"{self.name} not ready after {timeout:.0f}s")
                self._lines_seen.wait(min(left, 0.5))

    def said(self, text: str) -> bool:
        """Whether a line of its start-up output holds `text`."""
        with self._lines_seen:
            return any(text in line for line in self._startup_lines or ())

    def started(self) -> None:
        """Start-up is over: stop keeping every line (a long-running child only keeps its tail)."""
        with self._lines_seen:
            self._startup_lines = None

    def exited(self) -> Optional[int]:
        return self.proc.poll()

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def last_lines(self) -> str:
        self._reader.join(timeout=2)
        return "\n".join(self.tail)

    def close(self) -> None:
        self._reader.join(timeout=2)
        if self._sink is not sys.stderr:
            self._sink.close()


def stop_all(children: list[Child], timeout: float) -> dict[str, Optional[int]]:
    """SIGTERM each child's group, wait up to `timeout` for all of them, then SIGKILL what is left."""
    for child in children:
        if child.exited() is None:
            child.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    codes: dict[str, Optional[int]] = {}
    for child in children:
        try:
            codes[child.name] = child.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.signal_group(signal.SIGKILL)
            codes[child.name] = child.proc.wait()
        child.signal_group(signal.SIGKILL)  # any grandchild left behind in its group
    return codes
