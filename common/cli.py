"""The `tandem` console script: one subcommand per job (model, generate, bench, ...)."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from tandem.common.flags import ConfigError, refuse_abbreviations

LOG_LEVEL_HELP = "logging level: debug, info, warning, error"


# Each subcommand's module, in help order. A process imports only its own command's module(s): a router or a worker
# rank that imported every command would load torch, the bench tools and the router for nothing (seconds of CPU each).
COMMANDS = {
    "model": ("tandem.common.model.create",),
    "generate": ("tandem.common.generate",),
    "worker": ("tandem.common.rpc.unified_worker",),
    "prefill": ("tandem.services.prefill.main",),
    "decode": ("tandem.services.decode.main",),
    "router": ("tandem.services.router.main",),
    "up": ("tandem.common.launcher.up",),
    "planner": ("tandem.common.planner.main",),
}
# Likewise under `tandem bench`: the load generator (`bench serve`) never imports torch, whose import alone costs
# ~2.5 s of CPU, which a served benchmark's client would otherwise spend beside the server it measures.
BENCH_COMMANDS = {"offline": "tandem.common.bench.offline", "attention": "tandem.common.bench.attention",
                  "gemm": "tandem.common.bench.gemm",
                  "serve": "tandem.common.bench.serve", "kv": "tandem.common.transfer.bench",
                  "report": "tandem.common.bench.report", "chaos": "tandem.common.bench.chaos",
                  "grammar": "tandem.common.bench.grammar", "stall": "tandem.common.bench.stall",
                  "peer": "tandem.common.bench.peer", "moe": "tandem.common.bench.moe",
                  "quant": "tandem.common.bench.quant",
                  "kv-cache": "tandem.common.bench.kv_cache", "disagg": "tandem.common.bench.disagg",
                  "hicache": "tandem.common.bench.hicache"}


def build_parser(command: str | None = None, bench_command: str | None = None) -> argparse.ArgumentParser:
    """The whole parser, or (`command`, a known subcommand) one with only that subcommand registered; under
    `bench`, only `bench_command` when it is a known one."""
    parser = argparse.ArgumentParser(prog="tandem", description="Prefill/decode-disaggregated LLM serving")
    parser.add_argument("--log-level", default="warning", help=f"{LOG_LEVEL_HELP} (default: warning)")
    sub = parser.add_subparsers(dest="command", required=True)
    known = command in COMMANDS or command == "bench"
    for name, modules in COMMANDS.items():
        if not known or name == command:
            for module in modules:
                importlib.import_module(module).register(sub)
    if not known or command == "bench":
        bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
        for name, module in BENCH_COMMANDS.items():
            if bench_command not in BENCH_COMMANDS or name == bench_command:
                importlib.import_module(module).register(bench)
    add_log_level_to_subcommands(parser)
    return refuse_abbreviations(parser)


def command_of(argv: list[str]) -> str | None:
    """The subcommand argv names (the first word after the top-level options), or None (`-h`, or none given)."""
    words = iter(argv)
    for word in words:
        if word == "--log-level":
            next(words, None)
        elif word.startswith("--log-level="):
            continue
        elif word.startswith("-"):
            return None
        else:
            return word
    return None


def parser_for(argv: list[str]) -> argparse.ArgumentParser:
    """The parser for this command line, with only the (bench) subcommand it names registered."""
    command = command_of(argv)
    bench_command = command_of(argv[argv.index(command) + 1:]) if command == "bench" else None
    return build_parser(command, bench_command)


def add_log_level_to_subcommands(parser: argparse.ArgumentParser) -> None:
    """Accept --log-level after the subcommand too (`tandem worker --log-level info`), at every depth."""
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        for subparser in action.choices.values():
            # SUPPRESS: a subcommand that does not repeat the flag keeps the value given before it.
            subparser.add_argument("--log-level", default=argparse.SUPPRESS,
                                   help=f"{LOG_LEVEL_HELP} (default: the one before the subcommand, warning)")
            add_log_level_to_subcommands(subparser)


def main(argv: list[str] | None = None) -> int:
    try:
        argv = sys.argv[1:] if argv is None else argv
        parser = parser_for(argv)
    except ConfigError as e:  # a TANDEM_* variable that does not parse
        print(f"tandem: error: {e}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except ValueError as e:  # config and input errors carry a message meant for the user
        print(f"tandem: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
