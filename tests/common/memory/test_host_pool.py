"""HostKVPool: device<->host copies by slot lists, whole pages or not, in the device pool's dtype (FP8 too)."""

import pytest
import torch

from tandem.common.memory.host_pool import HostKVPool, host_pool_tokens
from tandem.common.memory.kv_pool import MHATokenToKVPool


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("whole_pages", [True, False])
def test_backup_then_load_round_trips_every_layer(dtype, whole_pages):
    device = MHATokenToKVPool(32, 4, dtype, 3, 2, 8, huge_pages=False)
    for layer in range(3):
        k, v = device.get_kv_buffer(layer)
        k.copy_(torch.randn(k.shape).to(dtype))
        v.copy_(torch.randn(v.shape).to(dtype))
    original = [t.clone() for t in device.k_buffers + device.v_buffers]
    host = HostKVPool(device, 64)
    src = torch.tensor([8, 9, 10, 11, 20, 21, 22, 23]) if whole_pages else torch.tensor([5, 9, 30, 17])
    host_slots = host.alloc(8)[: len(src)]
    host.backup(src, host_slots)
    dst = torch.tensor([4, 5, 6, 7, 28, 29, 30, 31]) if whole_pages else torch.tensor([4, 12, 13, 26])
    host.load(host_slots, dst)
    for before, after in zip(original, device.k_buffers + device.v_buffers):
        assert torch.equal(after[dst].view(torch.uint8), before[src].view(torch.uint8))
    rows = host.read_rows(host_slots)
    assert len(rows) == 6 and torch.equal(rows[0], original[0][src].view(torch.uint8))


def test_pool_accounting_and_sizing():
    device = MHATokenToKVPool(32, 4, torch.float32, 1, 1, 4, huge_pages=False)
    host = HostKVPool(device, 64)
    slots = host.alloc(12)
    assert host.used_tokens() == 12 and host.available_size() == 52
    host.free(slots)
    assert host.used_tokens() == 0
    assert host.alloc(68) is None
    assert host_pool_tokens(100, 4, 2.5, 0.0, 32) == 248
    assert host_pool_tokens(100, 4, 2.5, 1.0, 1 << 20) == 1024  # 1 GiB of 1 MiB tokens; the ratio is ignored


@pytest.mark.needs_gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("whole_pages", [True, False])
def test_cuda_pool_round_trips_through_pinned_host_memory(whole_pages):
    device = MHATokenToKVPool(32, 4, torch.bfloat16, 2, 2, 8, device="cuda")
    for buf in device.k_buffers + device.v_buffers:
        buf.copy_(torch.randn(buf.shape, device="cuda").to(torch.bfloat16))
    original = [t.clone() for t in device.k_buffers + device.v_buffers]
    host = HostKVPool(device, 64)
    assert host.k_buffers[0].is_pinned()
    src = torch.tensor([8, 9, 10, 11]) if whole_pages else torch.tensor([5, 9, 30, 17])
    dst = torch.tensor([20, 21, 22, 23]) if whole_pages else torch.tensor([4, 12, 13, 26])
    host_slots = host.alloc(4)
    host.backup(src, host_slots)
    host.load(host_slots, dst)
    torch.cuda.synchronize()
    for before, after in zip(original, device.k_buffers + device.v_buffers):
        assert torch.equal(after[dst.cuda()], before[src.cuda()])
