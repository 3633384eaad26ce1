"""NixlBackend.write_head_slices for real: two NIXL agents over pools holding different KV heads (a prefill and a
decode rank at different TP), one head-sliced WRITE, and the destination holds exactly the source's heads at their
offsets (other heads and pages untouched). On CPU (DRAM) always, on CUDA (VRAM) when a GPU is here."""

from __future__ import annotations

import time
import uuid

import numpy as np
import pytest
import torch

from tandem.common.transfer.messages import KVLayout
from tandem.common.transfer.nixl_backend import NixlBackend, RemotePool

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
LAYERS, PAGE, HEAD_DIM, PAGES = 2, 4, 8, 16


def backend(heads: int, device: str, fill: bool) -> tuple[NixlBackend, list[torch.Tensor], list[torch.Tensor]]:
    shape = (PAGES * PAGE, heads, HEAD_DIM)
    make = (lambda: torch.randn(shape, device=device)) if fill else (lambda: torch.zeros(shape, device=device))
    k, v = [make() for _ in range(LAYERS)], [make() for _ in range(LAYERS)]
    layout = KVLayout(LAYERS, PAGE, heads, HEAD_DIM, "float32", PAGES)
    return NixlBackend(f"slices-{uuid.uuid4().hex[:8]}", layout, k, v), k, v


@pytest.mark.parametrize("device", DEVICES)
def test_head_sliced_write_lands_at_the_destination_head_offsets(device):
    """Source: 4 heads (a prefill at TP 1). Destination: 2 heads (a decode rank at TP 2 holding heads 2-3): source
    heads 2..3 of pages [3, 4, 9] go to destination heads 0..1 of pages [5, 6, 1]; then source head 1 alone to
    destination head 1 of page 2 (a one-head slice)."""
    src, src_k, src_v = backend(4, device, fill=True)
    dst, dst_k, dst_v = backend(2, device, fill=False)
    remote = RemotePool.from_proto(src.add_remote(dst.metadata), dst.layout_proto())
    try:
        handles = [src.write_head_slices(remote, 2, np.array([3, 4, 9]), np.array([5, 6, 1]), [(2, 0, 2)]),
                   src.write_head_slices(remote, 2, np.array([7]), np.array([2]), [(1, 1, 1)])]
        deadline = time.monotonic() + 20
        while (states := [src.state(h) for h in handles]) != ["DONE", "DONE"]:
            assert "ERR" not in states and time.monotonic() < deadline, states
            dst.new_notifications()  # progress the target's worker, as a decode's threads do
            time.sleep(0.001)
        for h in handles:
            src.release(h)
        for src_bufs, dst_bufs in ((src_k, dst_k), (src_v, dst_v)):
            for s, d in zip(src_bufs, dst_bufs):
                want = torch.zeros_like(d)
                for sp, dp in ((3, 5), (4, 6), (9, 1)):
                    want[dp * PAGE:(dp + 1) * PAGE] = s[sp * PAGE:(sp + 1) * PAGE, 2:4]
                want[2 * PAGE:3 * PAGE, 1] = s[7 * PAGE:8 * PAGE, 1]
                assert torch.equal(d, want)
    finally:
        src.close()
        dst.close()
