"""A step load for `tandem up --planner` tests: closed-loop streaming clients whose number the test steps up
and down, each request's TTFT, mean ITL and outcome recorded."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Optional


@dataclass
class Result:
    started: float
    ttft_s: Optional[float]
    itl_s: Optional[float]  # mean gap between output chunks
    tokens: int  # completion tokens, as the final usage chunk reports
    error: Optional[str]  # None: finished with a finish_reason


class StepLoad:
    """`clients` threads; the first `active` of them send requests back to back (completions, streamed)."""

    def __init__(self, url: str, model: str, clients: int, prompt: str, max_tokens: int):
        self.url, self.model, self.prompt, self.max_tokens = url, model, prompt, max_tokens
        self.active = 0
        self.results: list[Result] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)]
        for t in self._threads:
            t.start()

    def _client(self, index: int) -> None:
        while not self._stop.is_set():
            if index >= self.active:
                time.sleep(0.05)
                continue
            result = self.one()
            with self._lock:
                self.results.append(result)

    def one(self) -> Result:
        body = {"model": self.model, "prompt": self.prompt, "max_tokens": self.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        request = urllib.request.Request(self.url + "/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        started = time.monotonic()
        stamps: list[float] = []
        finished, tokens = False, 0
        try:
            with urllib.request.urlopen(request, timeout=120) as resp:
                for raw in resp:
                    line = raw.decode().strip()
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
                    for choice in chunk["choices"]:
                        if choice.get("text"):
                            stamps.append(time.monotonic())
                        finished = finished or choice.get("finish_reason") is not None
        except (urllib.error.URLError, OSError, ValueError) as e:
            return Result(started, None, None, tokens, f"{type(e).__name__}: {e}")
        gaps = [b - a for a, b in zip(stamps, stamps[1:])]
        return Result(started, stamps[0] - started if stamps else None, sum(gaps) / len(gaps) if gaps else None,
                      tokens, None if finished else "the stream ended without a finish_reason")

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=150)


def attainment(results: list[Result], ttft_slo_s: float, itl_slo_s: float) -> float:
    """Fraction of requests that finished within both targets (a failed request misses them)."""
    if not results:
        return 1.0
    met = [r for r in results if r.error is None and r.ttft_s is not None and r.ttft_s <= ttft_slo_s
           and (r.itl_s is None or r.itl_s <= itl_slo_s)]
    return len(met) / len(results)
