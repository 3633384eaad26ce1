"""`tandem bench kv`: NIXL WRITE throughput of a prompt's KV into a decode process vs an in-process copy."""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from dataclasses import asdict

import numpy as np
import torch

from tandem.common.flags import refuse_abbreviations
from tandem.common.memory.huge_pages import thp_mode
from tandem.common.memory.kv_pool import MHATokenToKVPool
from tandem.common.transfer.kv_manager import DecodeKVManager, KVReceiver, KVSender, PrefillKVManager
from tandem.common.transfer.messages import KVLayout, KVPoll, TransferConfig

DEFAULT_TOKENS = "1024,4096,16384"


def register(bench_subparsers) -> None:
    p = bench_subparsers.add_parser("kv", help="KV transfer throughput: NIXL WRITE to a second process vs memory copy",
                                    formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--tokens", default=DEFAULT_TOKENS, help="comma-separated prompt lengths")
    p.add_argument("--repeats", type=int, default=5, help="transfers per prompt length")
    p.add_argument("--layers", type=int, default=8, help="KV layout: layers")
    p.add_argument("--kv-heads", type=int, default=4, help="KV layout: KV heads")
    p.add_argument("--head-dim", type=int, default=64, help="KV layout: dimensions per head")
    p.add_argument("--page-size", type=int, default=16, help="KV layout: tokens per page")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "float8_e4m3fn",
                                                           "float8_e5m2"], help="KV layout: dtype")
    p.add_argument("--nixl-progress-thread", action="store_true",
                   help="let NIXL run its own (busy-polling) progress thread")
    p.add_argument("--nixl-threads", type=int, default=0,
                   help="NIXL UCX threads each WRITE is split between (0: the transfer thread posts it alone)")
    p.add_argument("--base-pages", action="store_true",
                   help="allocate both pools on 4 KiB pages, as before pools were put on transparent huge pages")
    p.add_argument("--scattered", action="store_true",
                   help="WRITE the pages in a random order on both sides (one descriptor a page), not one run; "
                        "the copy columns stay contiguous")
    p.add_argument("--output", default=None, help="also write the results as JSON to this path")
    p.set_defaults(func=run)


def _pool(layout: KVLayout, random: bool, huge_pages: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """K and V buffers allocated as a worker allocates its KV pool (MHATokenToKVPool)."""
    pool = MHATokenToKVPool((layout.num_pages - 1) * layout.page_size, layout.page_size, getattr(torch, layout.dtype),
                            layout.num_layers, layout.num_kv_heads, layout.head_dim, huge_pages=huge_pages)
    if random:
        for buf in pool.k_buffers + pool.v_buffers:
            if pool.quantized:  # no normal_ for FP8: the transfer moves bytes, whatever they mean
                buf.view(torch.uint8).random_(0, 256)
            else:
                buf.normal_()
    return pool.k_buffers, pool.v_buffers


def _decode_main(layout_fields: dict, port: int, progress_thread: bool, threads: int, huge_pages: bool, conn) -> None:
    """The decode process: one receiver per room it is told about; reports each room's outcome."""
    layout = KVLayout(**layout_fields)
    k, v = _pool(layout, random=False, huge_pages=huge_pages)
    with DecodeKVManager(layout, k, v, TransferConfig(engine_id="bench-decode", nixl_progress_thread=progress_thread,
                                                       nixl_threads=threads)) as manager:
        conn.send("ready")
        while (msg := conn.recv()) is not None:
            room, dst_pages = msg
            receiver = KVReceiver(manager, room, "127.0.0.1", port)
            receiver.init(dst_pages)
            while receiver.poll() not in (KVPoll.Success, KVPoll.Failed):
                time.sleep(0.001)
            conn.send((receiver.poll().name, str(receiver.failure)))


def _wait(sender: KVSender, states: tuple[KVPoll, ...], timeout_s: float = 120) -> KVPoll:
    end = time.monotonic() + timeout_s
    while sender.poll() not in states and time.monotonic() < end:
        time.sleep(0.0002)
    return sender.poll()


def _nixl_seconds(manager: PrefillKVManager, conn, room: int, pages: list[int], dst_pages: list[int] | None = None) -> float:
    sender = KVSender(manager, room)
    conn.send((room, pages if dst_pages is None else dst_pages))
    if _wait(sender, (KVPoll.WaitingForInput, KVPoll.Failed)) != KVPoll.WaitingForInput:
        raise RuntimeError(f"room {room} never bootstrapped: {sender.failure}")
    start = time.perf_counter()
    sender.send(pages, is_last=True)
    state = _wait(sender, (KVPoll.Success, KVPoll.Failed))
    elapsed = time.perf_counter() - start
    decode_state, reason = conn.recv()
    if state != KVPoll.Success or decode_state != "Success":
        raise RuntimeError(f"room {room} failed: prefill {sender.failure}, decode {reason}")
    return elapsed


def _copy_seconds(src: tuple, dst: tuple, layout: KVLayout, num_pages: int, threads: int | None = None) -> float:
    """An in-process copy of the same pages: torch's own thread count, or `threads` (1: a plain memcpy)."""
    rows = slice(layout.page_size, (1 + num_pages) * layout.page_size)  # pages 1..num_pages
    saved = torch.get_num_threads()
    torch.set_num_threads(threads or saved)
    try:
        start = time.perf_counter()
        for s_buf, d_buf in zip(src[0] + src[1], dst[0] + dst[1]):
            d_buf[rows].copy_(s_buf[rows])
        return time.perf_counter() - start
    finally:
        torch.set_num_threads(saved)


def _gbps(nbytes: int, name: str, seconds: list[float]) -> dict:
    return {f"{name}_gbps_best": nbytes / min(seconds) / 1e9, f"{name}_gbps_median": nbytes / statistics.median(seconds) / 1e9}


def run(args: argparse.Namespace) -> int:
    token_counts = [int(t) for t in args.tokens.split(",") if t.strip()]
    if not token_counts or min(token_counts) <= 0 or args.repeats < 1:
        raise ValueError("--tokens needs positive prompt lengths and --repeats must be >= 1")
    max_pages = max(-(-t // args.page_size) for t in token_counts)
    layout = KVLayout(args.layers, args.page_size, args.kv_heads, args.head_dim, args.dtype, num_pages=max_pages + 1)
    huge_pages = not args.base_pages
    src = _pool(layout, random=True, huge_pages=huge_pages)
    copy_dst = _pool(layout, random=False, huge_pages=huge_pages)
    ctx = mp.get_context("spawn")
    rng = np.random.default_rng(0)
    results = []
    with PrefillKVManager(layout, *src, TransferConfig(
            engine_id="bench-prefill", nixl_progress_thread=args.nixl_progress_thread, nixl_threads=args.nixl_threads)) as manager:
        conn, child_conn = ctx.Pipe()
        decode = ctx.Process(target=_decode_main, args=(asdict(layout), manager.bootstrap_port, args.nixl_progress_thread,
                                                                  args.nixl_threads, huge_pages, child_conn), daemon=True)
        decode.start()
        try:
            if not conn.poll(120) or conn.recv() != "ready":
                raise RuntimeError("decode process did not start")
            room = 1
            _copy_seconds(src, copy_dst, layout, max_pages)  # warm-up: first touch of the copy target
            _nixl_seconds(manager, conn, room, [1])  # warm-up: connection set-up is not throughput
            for tokens in token_counts:
                num_pages = -(-tokens // args.page_size)
                nbytes = layout.transfer_bytes(num_pages)
                pages = list(range(1, num_pages + 1))
                # --scattered: pages in a random order on both sides, as in pools that served a while
                src_pages, dst_pages = (rng.permutation(pages).tolist(), rng.permutation(pages).tolist()) if args.scattered else (pages, None)
                nixl, copy, memcpy = [], [], []
                for _ in range(args.repeats):
                    room += 1
                    nixl.append(_nixl_seconds(manager, conn, room, src_pages, dst_pages))
                    copy.append(_copy_seconds(src, copy_dst, layout, num_pages))
                    memcpy.append(_copy_seconds(src, copy_dst, layout, num_pages, threads=1))
                results.append({"tokens": tokens, "bytes": nbytes, "copy_threads": torch.get_num_threads(),
                                **_gbps(nbytes, "nixl", nixl), **_gbps(nbytes, "copy", copy), **_gbps(nbytes, "memcpy", memcpy)})
        finally:
            conn.send(None)
            decode.join(timeout=30)
            if decode.is_alive():
                decode.kill()
    pages = "4 KiB pages" if args.base_pages else f"transparent huge pages where allowed (kernel THP mode: {thp_mode()})"
    pages += "; NIXL pages scattered" if args.scattered else ""
    _print_table(layout, pages, results)
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"layout": asdict(layout), "repeats": args.repeats, "pools": pages, "results": results}, f, indent=2)
    return 0


def _print_table(layout: KVLayout, pages: str, results: list[dict]) -> None:
    print(f"KV layout: {layout.num_layers} layers, {layout.num_kv_heads} kv heads, head_dim {layout.head_dim}, "
          f"{layout.dtype}, page_size {layout.page_size}  (GB/s = 1e9 bytes/s; best / median)")
    print(f"pools on {pages}; copy: torch copy_ on {results[0]['copy_threads']} threads, memcpy: on 1")
    print(f"{'tokens':>7} {'MiB':>8} {'NIXL WRITE':>17} {'copy':>17} {'memcpy':>17} {'NIXL/copy':>10} {'NIXL/memcpy':>12}")
    for r in results:
        cols = " ".join(f"{r[f'{n}_gbps_best']:>8.2f} / {r[f'{n}_gbps_median']:<6.2f}" for n in ("nixl", "copy", "memcpy"))
        print(f"{r['tokens']:>7} {r['bytes'] / 2**20:>8.1f} {cols} {r['nixl_gbps_median'] / r['copy_gbps_median']:>10.2f} "
              f"{r['nixl_gbps_median'] / r['memcpy_gbps_median']:>12.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m tandem.common.transfer.bench")
    register(parser.add_subparsers(dest="bench_command", required=True))
    ns = refuse_abbreviations(parser).parse_args()
    raise SystemExit(ns.func(ns))
