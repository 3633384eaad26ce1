"""The installed distribution: one import name, `tandem`, whatever the user's own folders are called.

A wheel built from this checkout is installed into a fresh venv, and `tandem` runs from a directory that holds
its own `common/` and `services/` packages (as an RL pipeline's repository often does)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
PARTS = ("common", "services")

def _source_packages() -> set[str]:
    """Every folder with an __init__.py under common/ and services/, as its installed dotted name."""
    return {"tandem." + ".".join(init.parent.relative_to(REPO_ROOT).parts)
            for part in PARTS for init in (REPO_ROOT / part).rglob("__init__.py") if "__pycache__" not in init.parts}


def test_pyproject_lists_every_package_under_tandem():
    """setuptools installs only the packages pyproject names: a new folder missing there would be left out of a
    wheel (an editable install would still find it, so only this test notices)."""
    tool = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert set(tool["packages"]) == _source_packages()
    assert tool["package-dir"] == {f"tandem.{part}": part for part in PARTS}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # From a copy: setuptools builds in the source tree, and a build/ left by an earlier build (with a module
    # since removed) would ride along in the wheel.
    source = out / "source"
    shutil.copytree(REPO_ROOT, source, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".shim", ".whl"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation",
                           "--quiet", "-w", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    (path,) = out.glob("tandem_serve-*.whl")
    return path


@pytest.mark.e2e
def test_the_wheel_holds_only_tandem(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        info = next(n for n in names if n.endswith(".dist-info/top_level.txt"))
        assert archive.read(info).decode().split() == ["tandem"]
        record = archive.read(next(n for n in names if n.endswith(".dist-info/RECORD"))).decode()
    tops = {line.split(",")[0].split("/")[0] for line in record.splitlines() if line}
    assert tops == {"tandem", wheel.name.split("-")[0] + "-" + wheel.name.split("-")[1] + ".dist-info"}
    packages = {"/".join(n.split("/")[:-1]).replace("/", ".") for n in names if n.endswith("/__init__.py")}
    assert packages == _source_packages()
    # Package data: the router's API definition and the cpu attention backend's C++ sources.
    for data in ("tandem/services/router/router.proto", "tandem/common/model/attention/cpu/paged_attention.cpp",
                 "tandem/common/model/attention/cpu/kernels.h"):
        assert data in names


def _fresh_venv(root: Path) -> Path:
    """A venv without this environment's site-packages on its own path list (so not the editable install's
    finder, which a .pth there starts), reaching torch and the other dependencies through a plain path entry."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    python = root / "bin" / "python"
    venv_site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip()
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    Path(venv_site, "dependencies.pth").write_text("\n".join(sorted(deps)) + "\n")  # paths only: no .pth runs
    return python


@pytest.mark.e2e
def test_a_wheel_install_runs_beside_the_users_own_common_and_services(wheel, tmp_path, tiny_llama):
    python = _fresh_venv(tmp_path / "venv")
    # --ignore-installed: the editable install of this checkout is visible as metadata; it must stay untouched.
    proc = subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--no-deps", "--ignore-installed",
                           str(wheel)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    user = tmp_path / "rl-pipeline"
    for part in PARTS:
        (user / part).mkdir(parents=True)
        (user / part / "__init__.py").write_text(f"WHOSE = 'user {part}'\n")
    tandem = tmp_path / "venv" / "bin" / "tandem"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

    def run(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run(argv, cwd=user, env=env, capture_output=True, text=True, timeout=300)

    where = run(str(python), "-c", "import common, services, tandem.common.cli as cli; "
                "print(common.WHOSE, services.WHOSE, cli.__file__, sep='|')")
    assert where.returncode == 0, where.stderr
    users_common, users_services, cli_file = where.stdout.strip().split("|")
    assert (users_common, users_services) == ("user common", "user services")
    assert Path(cli_file).is_relative_to(tmp_path / "venv")  # the wheel's copy, not this checkout's
    help_ = run(str(tandem), "--help")
    assert help_.returncode == 0 and "generate" in help_.stdout, help_.stderr
    src = user / "in.jsonl"
    src.write_text(json.dumps({"id": 0, "input_ids": [5, 9, 33], "sampling_params": {"max_new_tokens": 4,
                                                                                      "temperature": 0}}) + "\n")
    generated = run(str(tandem), "generate", "--model", tiny_llama, "--input", str(src), "--output", "-",
                    "--max-total-tokens", "256")
    assert generated.returncode == 0, generated.stderr
    (line,) = [json.loads(text) for text in generated.stdout.splitlines() if text.startswith("{")]
    assert line["id"] == 0 and len(line["output_ids"]) == 4
