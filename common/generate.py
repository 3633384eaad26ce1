"""`tandem generate`: offline batch generation from a JSONL file through the in-process Engine (or DP replicas)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional

from tandem.common.config import add_engine_args, engine_config_from_args
from tandem.common.errors import InvalidRequestError
from tandem.common.model.builtin import resolve_model
from tandem.common.sampling.params import SamplingParams
from tandem.common.scheduler.io_struct import GenerateRequest
from tandem.common.tokenizer import load_tokenizer

_LINE_KEYS = {"id", "input_ids", "text", "sampling_params", "return_logprob", "top_logprobs_num",
              "logprob_start_len"}


def parse_line(line: str, lineno: int, tokenizer) -> tuple[object, GenerateRequest]:
    """One input line → (user id, request); raises InvalidRequestError naming the problem."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise InvalidRequestError(f"line {lineno}: not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise InvalidRequestError(f"line {lineno}: expected a JSON object")
    unknown = set(obj) - _LINE_KEYS
    if unknown:
        raise InvalidRequestError(f"line {lineno}: unknown keys {sorted(unknown)}; allowed: {sorted(_LINE_KEYS)}")
    user_id = obj.get("id", lineno)
    if ("input_ids" in obj) == ("text" in obj):
        raise InvalidRequestError(f"line {lineno}: give exactly one of input_ids or text", "input_ids")
    input_ids = obj["input_ids"] if "input_ids" in obj else tokenizer.encode(obj["text"]).ids
    if not isinstance(input_ids, list):
        raise InvalidRequestError(f"line {lineno}: input_ids must be a list of ints", "input_ids")
    params = SamplingParams.from_dict(obj.get("sampling_params") or {})
    req = GenerateRequest(
        rid=f"line-{lineno}", input_ids=input_ids, sampling_params=params,
        return_logprob=bool(obj.get("return_logprob", False)),
        top_logprobs_num=int(obj.get("top_logprobs_num", 0)),
        logprob_start_len=int(obj.get("logprob_start_len", -1)),
    )
    return user_id, req


def _line_id(line: str, lineno: int):
    """The user's id of a line that failed to parse, so its error can be matched up."""
    try:
        obj = json.loads(line)
        return obj.get("id", lineno) if isinstance(obj, dict) else lineno
    except json.JSONDecodeError:
        return lineno


def result_lines(user_id, req: GenerateRequest, result, tokenizer) -> list[dict]:
    lines = []
    for seq in result.sequences:
        line = {
            "id": user_id, "index": seq.index, "output_ids": seq.output_ids,
            "text": tokenizer.decode(seq.output_ids, skip_special_tokens=req.sampling_params.skip_special_tokens),
            "finish_reason": seq.finish_reason.to_dict() if seq.finish_reason else None,
            "prompt_tokens": result.prompt_tokens, "completion_tokens": len(seq.output_ids),
            "cached_tokens": result.cached_tokens,
        }
        if req.return_logprob:
            line["logprobs"] = seq.logprobs
            if req.top_logprobs_num:
                line["top_logprobs"] = [[[tid, lp] for tid, lp in row] for row in seq.top_logprobs]
            if seq.input_logprobs is not None:
                line["input_logprobs"] = seq.input_logprobs
            if seq.input_top_logprobs is not None:
                line["input_top_logprobs"] = [[[tid, lp] for tid, lp in row] for row in seq.input_top_logprobs]
        lines.append(line)
    return lines


def run(args: argparse.Namespace) -> int:
    from tandem.common.dp.engine_pool import open_engine  # torch: -h and flag errors answer without it

    args.model_path = resolve_model(args.model_path)  # a built-in name (or none: the default) is made on first use
    config = engine_config_from_args(args)
    tokenizer = load_tokenizer(config.tokenizer_dir).tokenizer
    src = sys.stdin if args.input == "-" else open(args.input, encoding="utf-8")
    parsed: list[tuple[object, Optional[GenerateRequest], Optional[str]]] = []
    with src:
        for lineno, line in enumerate(src, 1):
            if line.strip():
                try:
                    parsed.append((*parse_line(line, lineno, tokenizer), None))
                except InvalidRequestError as e:
                    parsed.append((_line_id(line, lineno), None, str(e)))
    failures = 0
    with open_engine(config) as engine:  # --dp-size N: N replicas, each request on one
        handles = []
        for user_id, req, error in parsed:
            if req is not None:
                try:
                    handles.append(engine.submit(req))
                    continue
                except InvalidRequestError as e:
                    error = str(e)
            handles.append(error)
        dst = sys.stdout if args.output == "-" else open(args.output, "w", encoding="utf-8")
        with dst:
            for (user_id, req, _), handle in zip(parsed, handles):
                if isinstance(handle, str) or handle is None:
                    failures += 1
                    dst.write(json.dumps({"id": user_id, "error": handle}) + "\n")
                    continue
                result = handle.result()
                if result.error is not None:
                    failures += 1
                    dst.write(json.dumps({"id": user_id, "error": result.error.message}) + "\n")
                    continue
                for line in result_lines(user_id, req, result, tokenizer):
                    dst.write(json.dumps(line, ensure_ascii=False) + "\n")
    if failures:
        print(f"{failures} request(s) failed; see the 'error' field in the output", file=sys.stderr)
    return 1 if failures else 0


def register(subparsers) -> None:
    p = subparsers.add_parser("generate", help="offline batch generation: JSONL in, JSONL out")
    p.add_argument("--input", required=True, help="JSONL file of requests, '-' for stdin (required)")
    p.add_argument("--output", required=True, help="JSONL file for results, '-' for stdout (required)")
    add_engine_args(p, require_model=False)
    p.set_defaults(func=run)
