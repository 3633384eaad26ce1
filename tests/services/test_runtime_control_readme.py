"""docs/runtime-control.md's RL loop, run as written against `tandem up` (a prefill/decode pair and the router):
both workers take the update, the pair keeps serving, and the output changes with the weights."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.common.launcher.test_up import STACK_FLAGS, UpProcess
from tests.common.rpc.helpers import REPO_ROOT, cli_in_process

pytestmark = pytest.mark.e2e

DOC = Path(REPO_ROOT, "docs", "runtime-control.md").read_text()


def readme_blocks() -> tuple[list[str], str]:
    section = DOC.split("## An RL loop against `tandem up`", 1)[1]
    bash = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    python = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    commands = [line.split("#", 1)[0].strip() for line in bash.splitlines() if line.strip()]
    return commands, python


def test_readme_rl_loop_against_tandem_up(tmp_path, monkeypatch):
    commands, script = readme_blocks()
    *creates, up = commands
    for command in creates:
        argv = shlex.split(command.replace("/tmp/", f"{tmp_path}/"))
        assert argv[:3] == ["tandem", "model", "create"]
        assert cli_in_process(argv[1:]) == 0  # the console script's main, in this process: no interpreter to start
    env_part, up_part = up.split(" tandem up ", 1)
    name, value = env_part.split("=", 1)
    monkeypatch.setenv(name, value)
    flags = shlex.split(up_part.replace("/tmp/", f"{tmp_path}/").replace("--port 8000", "--port 0"))
    stack = UpProcess(*flags, *STACK_FLAGS)
    try:
        run = subprocess.run([sys.executable, "-c", script.replace("/tmp/", f"{tmp_path}/")], cwd=REPO_ROOT,
                             env={**os.environ, "TANDEM_URL": stack.url}, capture_output=True, text=True, timeout=180)
        assert run.returncode == 0, run.stderr + "".join(stack.err[-40:])
        assert run.stdout.splitlines() == ["update: True", "version: step-1", "changed: True"]
    finally:
        stack.proc.terminate()
        assert stack.proc.wait(60) == 0, "".join(stack.err[-40:])
