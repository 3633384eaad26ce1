"""The `tandem` console script: one subcommand per job (model, generate, bench, ...)."""

from __future__ import annotations

import argparse
import logging
import sys

from common.flags import ConfigError

LOG_LEVEL_HELP = "logging level: debug, info, warning, error"


def build_parser() -> argparse.ArgumentParser:
    from common import generate
    from common.bench import attention as bench_attention
    from common.bench import offline as bench_offline
    from common.bench import chaos as bench_chaos
    from common.bench import grammar as bench_grammar
    from common.bench import report as bench_report
    from common.launcher import up as launcher_up
    from common.bench import serve as bench_serve
    from common.transfer import bench as bench_kv
    from common.model import create as model_create
    from common.rpc import unified_worker
    from services.decode import main as decode_main
    from services.prefill import main as prefill_main
    from services.router import main as router_main

    parser = argparse.ArgumentParser(prog="tandem", description="Prefill/decode-disaggregated LLM serving")
    parser.add_argument("--log-level", default="warning", help=f"{LOG_LEVEL_HELP} (default: warning)")
    sub = parser.add_subparsers(dest="command", required=True)
    model_create.register(sub)
    generate.register(sub)
    unified_worker.register(sub)
    prefill_main.register(sub)
    decode_main.register(sub)
    router_main.register(sub)
    launcher_up.register(sub)
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
    bench_offline.register(bench)
    bench_attention.register(bench)
    bench_serve.register(bench)
    bench_kv.register(bench)
    bench_report.register(bench)
    bench_chaos.register(bench)
    bench_grammar.register(bench)
    add_log_level_to_subcommands(parser)
    return parser


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
        parser = build_parser()
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
