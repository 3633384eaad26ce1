"""The real clients users benchmark and evaluate with, run unchanged against `tandem up`: guidellm 0.8.1's default
streamed chat benchmark (TTFT and ITL need `stream_options.continuous_usage_stats`) and lm-eval 0.4.13's
`local-completions` multiple-choice task (loglikelihood: `echo` + `logprobs` on token-id prompts). Each is skipped
when its package is not installed in the running interpreter (the `test` extra installs both)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

from tests.common.launcher.test_up import UpProcess
from tests.common.rpc.helpers import free_port

TASK_DIR = pathlib.Path(__file__).parent / "data" / "lm_eval_tasks"  # tandem_tiny_mc: five questions, four choices


def requires(module: str) -> pytest.MarkDecorator:
    """Skips before the stack starts when `module` is not importable by the running interpreter."""
    return pytest.mark.skipif(importlib.util.find_spec(module) is None,
                              reason=f"{module} is not installed in {sys.executable} (the `test` extra installs it)")


def offline_env(tmp_path: pathlib.Path) -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "HF_DATASETS_CACHE": str(tmp_path / "hf-datasets")}


def run_client(args: list[str], cwd: pathlib.Path, env: dict[str, str]) -> None:
    result = subprocess.run([sys.executable, "-m", *args], cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, f"{args[0]} exited {result.returncode}:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"


@pytest.fixture(scope="module")
def stack(tiny_llama):
    up = UpProcess("--model", tiny_llama, "--unified", "1", "--num-threads", "1", "--port", str(free_port()),
                   "--max-total-tokens", "4096", "--page-size", "4", "--max-context-len", "1024")
    yield up
    up.kill()


@pytest.mark.e2e
@requires("guidellm")
def test_guidellm_streamed_benchmark_reports_ttft_and_itl(stack, tiny_llama, tmp_path):
    report = tmp_path / "guidellm.json"
    run_client(["guidellm", "run", "--disable-progress",
                "--backend", f"kind=openai_http,target={stack.url},model={os.path.basename(tiny_llama)}",
                "--profile", "kind=synchronous",
                "--constraint", "kind=max_requests,count=4",
                "--data", "kind=synthetic_text,prompt_tokens=32,output_tokens=8",
                "--tokenizer", f"kind=huggingface_auto,model={tiny_llama}",
                "--output", f"kind=json,path={report}"], tmp_path, offline_env(tmp_path))
    (benchmark,) = json.loads(report.read_text())["benchmarks"]
    metrics = benchmark["metrics"]
    assert metrics["request_totals"] == {"successful": 4, "errored": 0, "incomplete": 0, "total": 4}
    ttft = metrics["time_to_first_token_ms"]["successful"]
    itl = metrics["inter_token_latency_ms"]["successful"]
    assert ttft["count"] == 4 and ttft["min"] > 0
    assert itl["count"] == 4 * 7 and itl["min"] > 0  # 7 gaps between each request's 8 streamed tokens
    assert metrics["output_token_count"]["successful"]["total_sum"] == 4 * 8  # usage counted from the stream


@pytest.mark.e2e
@requires("lm_eval")
def test_lm_eval_multiple_choice_task_scores_every_choice(stack, tiny_llama, tmp_path):
    out = tmp_path / "lm-eval"
    run_client(["lm_eval", "--model", "local-completions",
                "--model_args", f"model={os.path.basename(tiny_llama)},base_url={stack.url}/v1/completions,"
                                f"tokenizer={tiny_llama},tokenizer_backend=huggingface,num_concurrent=1",
                "--include_path", str(TASK_DIR), "--tasks", "tandem_tiny_mc",
                "--output_path", str(out), "--log_samples"], TASK_DIR, offline_env(tmp_path))
    (results_file,) = out.rglob("results_*.json")
    results = json.loads(results_file.read_text())["results"]["tandem_tiny_mc"]
    assert results["sample_len"] == 5 and 0.0 <= results["acc,none"] <= 1.0
    (samples_file,) = out.rglob("samples_tandem_tiny_mc_*.jsonl")
    samples = [json.loads(line) for line in samples_file.read_text().splitlines()]
    assert len(samples) == 5
    for sample in samples:  # per choice one [(logprob of the choice, is greedy)], logged as strings
        scores = [float(logprob) for ((logprob, _greedy),) in sample["resps"]]
        assert len(scores) == 4 and all(math.isfinite(s) and s < 0 for s in scores)
