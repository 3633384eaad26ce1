"""The flags vLLM and SGLang users type: their spellings parse to Tandem's config; unsupported values are refused."""

from __future__ import annotations

import logging

import pytest

from tandem.common.cli import build_parser
from tandem.common.config import EngineConfig, check_quantization_flags, engine_config_from_args, log_remote_code
from tandem.common.flags import ConfigError, from_flags
from tandem.common.launcher.up import config_from_args as up_config_from_args
from tandem.common.launcher.up import router_argv
from tandem.services.router.config import RouterConfig


REQUIRED = {"generate": ["--input", "in.jsonl", "--output", "out.jsonl"]}


def _engine(command: str, *argv: str) -> EngineConfig:
    args = build_parser(command).parse_args([command, "--model", "/m", *REQUIRED.get(command, []), *argv])
    return from_flags(EngineConfig, args)


ENGINE_ALIASES = [
    (["--tensor-parallel-size", "2"], ["--tp-size", "2"]),
    (["--pipeline-parallel-size", "2"], ["--pp-size", "2"]),
    (["--data-parallel-size", "2"], ["--dp-size", "2"]),
    (["--max-num-seqs", "7"], ["--max-running-requests", "7"]),
    (["--gpu-memory-utilization", "0.8"], ["--mem-fraction-static", "0.8"]),
    (["--no-enable-prefix-caching"], ["--disable-radix-cache"]),
    (["--disable-radix-cache", "--enable-prefix-caching"], []),
    (["--kv-cache-dtype", "auto"], []),
]


@pytest.mark.parametrize("command", ["worker", "prefill", "decode", "generate", "up"])
@pytest.mark.parametrize("anchor,tandem", ENGINE_ALIASES)
def test_an_anchor_spelling_parses_to_the_same_engine_config(command, anchor, tandem):
    config = _engine(command, *anchor)
    assert config == _engine(command, *tandem)
    assert config != _engine(command) or not tandem


def test_the_router_takes_vllms_tokenizer_as_its_tokenizer_directory():
    parse = build_parser("router").parse_args
    by_tokenizer = from_flags(RouterConfig, parse(["router", "--tokenizer", "/tok"]))
    assert by_tokenizer.model_path == "/tok"
    assert by_tokenizer == from_flags(RouterConfig, parse(["router", "--model-path", "/tok"]))
    assert by_tokenizer.tokenizer_cache_dir == RouterConfig().tokenizer_cache_dir


def test_online_quantization_is_passed_to_the_loader_and_other_methods_are_refused(tmp_path):
    config = engine_config_from_args(build_parser("worker").parse_args(
        ["worker", "--model", str(tmp_path), "--quantization", "int8"]))
    assert config.linear_options()["quantization"] == "int8"  # every load_model call takes linear_options()
    # A checkpoint's own method, as vLLM command lines name it, is left to the loader to match (test_quant_base).
    assert engine_config_from_args(build_parser("worker").parse_args(
        ["worker", "--model", str(tmp_path), "--quantization", "awq"])).quantization == "awq"
    argv = ["--quantization", "nf4"]
    with pytest.raises(ConfigError, match="--quantization nf4: online quantization supports fp8, int8"):
        engine_config_from_args(build_parser("worker").parse_args(["worker", "--model", str(tmp_path), *argv]))
    with pytest.raises(ConfigError, match="--quantization nf4"):  # before `tandem up` starts any worker
        up_config_from_args(build_parser("up").parse_args(["up", *argv]))


def test_an_unknown_kv_cache_dtype_is_refused_naming_the_flag(tmp_path):
    argv = ["--kv-cache-dtype", "int4"]
    with pytest.raises(ConfigError, match="--kv-cache-dtype must be one of auto, bfloat16, bf16, float16, fp16, fp8, fp8_e4m3, fp8_e5m2, "
                                          "got 'int4'"):
        engine_config_from_args(build_parser("worker").parse_args(["worker", "--model", str(tmp_path), *argv]))
    with pytest.raises(ConfigError, match="--kv-cache-dtype"):  # before `tandem up` starts any worker
        up_config_from_args(build_parser("up").parse_args(["up", *argv]))


@pytest.mark.parametrize("value", ["auto", "fp8", "fp8_e4m3", "fp8_e5m2"])
def test_kv_cache_dtypes_pass(value):
    check_quantization_flags(value, None)


def test_tandem_up_passes_the_kv_cache_dtype_to_every_worker():
    config = up_config_from_args(build_parser("up").parse_args(["up", "--kv-cache-dtype", "fp8_e5m2"]))
    assert config.engine_flags == ["--kv-cache-dtype", "fp8_e5m2"]


def test_trust_remote_code_is_accepted_and_says_no_remote_code_runs(caplog):
    assert _engine("worker", "--trust-remote-code").trust_remote_code
    with caplog.at_level(logging.WARNING, logger="tandem.common.config"):
        log_remote_code(False)
        assert not caplog.records
        log_remote_code(True)
    assert "never runs a model repository's code" in caplog.text


@pytest.mark.parametrize("argv", [
    ["worker", "--model", "/m", "--max-running", "4"],
    ["generate", *REQUIRED["generate"], "--max-prefill", "8"],
    ["router", "--worker", "grpc://h:1", "--tokenizer-cache", "/d"],
    ["up", "--ready-time", "5"],
    ["up", "--chat-temp", "/t.jinja"],
])
def test_abbreviations_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser(argv[0]).parse_args(argv)
    assert exit_.value.code == 2
    assert "unrecognized arguments" in capsys.readouterr().err


def test_up_passes_its_router_flags_on_to_the_router(tmp_path):
    template = tmp_path / "t.jinja"
    args = build_parser("up").parse_args([
        "up", "--chat-template", str(template), "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
        "--admin-api-key", "admin", "--policy", "random", "--decode-policy", "least_load", "--no-kv-admission",
        "--max-queued", "5", "--queue-timeout-s", "3.5", "--max-running-requests", "9", "--api-key", "client"])
    assert router_argv(args) == [
        "--admin-api-key", "admin", "--chat-template", str(template), "--tool-call-parser", "hermes",
        "--reasoning-parser", "qwen3", "--policy", "random", "--decode-policy", "least_load",
        "--max-queued-requests", "5", "--no-kv-admission", "--queue-timeout-s", "3.5"]
    config = up_config_from_args(args)
    assert config.router_flags == router_argv(args)
    # --max-running-requests is the engine's (every worker's), --api-key `tandem up`'s own (the banner shows it).
    assert config.engine_flags == ["--max-running-requests", "9"] and config.api_key == "client"


def test_up_passes_no_router_flag_by_default():
    assert router_argv(build_parser("up").parse_args(["up"])) == []


def test_up_help_groups_the_router_flags(capsys):
    with pytest.raises(SystemExit):
        build_parser("up").parse_args(["up", "--help"])
    text = capsys.readouterr().out
    for section in ("router: serving:", "router: routing:", "router: health and back-pressure:"):
        assert section in text


def test_up_gives_vllms_tokenizer_to_its_workers_and_its_router(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = build_parser("up").parse_args(["up", "--tokenizer", "tok", "--tensor-parallel-size", "2",
                                          "--no-enable-prefix-caching", "--chat-template", "t.jinja"])
    config = up_config_from_args(args)
    tok = str(tmp_path / "tok")
    assert config.engine_flags == ["--tokenizer", tok, "--disable-radix-cache", "--tp-size", "2"]
    assert config.tokenizer_path == tok  # the router's --model-path
    assert config.router_flags == ["--chat-template", str(tmp_path / "t.jinja")]
    assert _engine("worker", "--tokenizer", "/tok").tokenizer_dir == "/tok"
    assert _engine("worker").tokenizer_dir == "/m"
