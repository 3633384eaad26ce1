"""`tandem up --cpu-split` and the workers' --cpu-affinity: the split policy, the flags each worker gets, and (e2e)
every thread of each worker read back from /proc on the CPUs it was given."""

from __future__ import annotations

import argparse
import os

import pytest

from tandem.common.flags import ConfigError
from tandem.common.launcher.cpu_split import shares_cpus, worker_flags
from tandem.common.launcher.up import Stack, add_up_args, config_from_args
from tests.common.launcher.test_up import STACK_FLAGS, UpProcess
from tests.common.rpc.helpers import free_port

PD = ["prefill-0", "decode-0"]


def up_config(*argv: str):
    parser = argparse.ArgumentParser()
    add_up_args(parser)
    return config_from_args(parser.parse_args(list(argv)))


def affinity(flags: dict[str, list[str]]) -> dict[str, str]:
    assert all(f[0] == "--cpu-affinity" for f in flags.values()), flags
    return {name: f[1] for name, f in flags.items()}


def test_pin_gives_each_worker_a_disjoint_slice_and_the_spare_cpus_to_decode():
    assert affinity(worker_flags("pin", PD, [0, 1], False, False)) == {"prefill-0": "0", "decode-0": "1"}
    assert affinity(worker_flags("pin", PD, [0, 1, 2], False, False)) == {"prefill-0": "0", "decode-0": "1-2"}
    assert affinity(worker_flags("pin", ["prefill-0", "decode-0", "decode-1"], [2, 3, 5, 7, 8], False, False)) == {
        "prefill-0": "2", "decode-0": "3,5", "decode-1": "7-8"}
    assert affinity(worker_flags("pin", ["worker-0", "worker-1"], [0, 1, 2, 3], False, False)) == {
        "worker-0": "0-1", "worker-1": "2-3"}


def test_auto_sizes_each_workers_threads_to_its_share_without_pinning():
    assert worker_flags("auto", PD, [0, 1, 2, 3], False, False) == {"prefill-0": ["--num-threads", "2"],
                                                                    "decode-0": ["--num-threads", "2"]}
    assert worker_flags("auto", ["prefill-0", "decode-0", "decode-1"], list(range(7)), False, False) == {
        "prefill-0": ["--num-threads", "2"], "decode-0": ["--num-threads", "3"], "decode-1": ["--num-threads", "2"]}
    unified = ["worker-0", "worker-1"]
    assert worker_flags("auto", unified, [0, 1], False, False) == {"worker-0": ["--num-threads", "1"],
                                                                   "worker-1": ["--num-threads", "1"]}


def test_a_prefill_decode_stack_with_under_two_cpus_a_worker_shares_them_all():
    for cpus in ([0, 1], [0, 1, 2]):
        assert shares_cpus("auto", PD, cpus, False, False)
        assert worker_flags("auto", PD, cpus, False, False) == {}  # every CPU each: torch's own thread count
    assert not shares_cpus("auto", PD, [0, 1, 2, 3], False, False)  # two each: split
    assert not shares_cpus("auto", ["worker-0", "worker-1"], [0, 1], False, False)  # both busy all the time
    assert not shares_cpus("auto", PD, [0, 1], True, False)  # --num-threads/--cpu-affinity given
    assert not shares_cpus("auto", PD, [0, 1], False, True)  # TP/PP/DP or the planner
    assert not shares_cpus("auto", PD, [0], False, False)
    assert shares_cpus("shared", ["worker-0"], list(range(8)), True, True)  # asked for: always
    assert worker_flags("shared", PD, list(range(8)), False, False) == {}
    assert not shares_cpus("pin", PD, [0, 1], False, False) and not shares_cpus("off", PD, [0, 1], False, False)


def test_auto_and_pin_set_nothing_when_flags_size_or_a_worker_is_several_processes_or_cpus_are_too_few():
    for spec in ("auto", "pin"):
        assert worker_flags(spec, PD, [0, 1], True, False) == {}
        assert worker_flags(spec, PD, [0, 1], False, True) == {}
        assert worker_flags(spec, PD, [0], False, False) == {}
    assert worker_flags("off", PD, [0, 1, 2, 3], False, False) == {}


def test_explicit_split_pins_cpus_per_role():
    assert affinity(worker_flags("1:3", PD, [0, 1, 2, 3], False, False)) == {"prefill-0": "0", "decode-0": "1-3"}
    with pytest.raises(ConfigError, match="cannot give"):
        worker_flags("2:2", PD, [0, 1, 2], False, False)
    with pytest.raises(ConfigError, match="drop --cpu-affinity"):
        worker_flags("1:1", PD, [0, 1], True, False)
    with pytest.raises(ConfigError, match="unified ones"):
        worker_flags("1:1", ["worker-0"], [0, 1], False, False)
    for bad in ("2", "0:1", "a:b", "1:", "even"):
        with pytest.raises(ConfigError, match="--cpu-split"):
            worker_flags(bad, PD, [0, 1], False, False)


def test_each_worker_gets_its_own_flags(tiny_llama, monkeypatch):
    monkeypatch.setattr("tandem.common.launcher.up.usable_cpus", lambda: [0, 1, 2, 3])
    config = up_config("--model", tiny_llama, "--cpu-split", "1:3", "--no-tls")
    assert config.worker_cpus == {"prefill-0": ["--cpu-affinity", "0"], "decode-0": ["--cpu-affinity", "1-3"]}
    stack = Stack(config, tiny_llama)
    spawned = {}
    monkeypatch.setattr(stack, "_spawn", lambda name, *argv, env=None: spawned.setdefault(name, list(argv)))
    stack._worker("decode-0", "decode")
    argv = spawned["decode-0"]
    assert argv[argv.index("--cpu-affinity") + 1] == "1-3"
    assert up_config("--model", tiny_llama).worker_cpus == {"prefill-0": ["--num-threads", "2"],
                                                            "decode-0": ["--num-threads", "2"]}
    assert up_config("--model", tiny_llama).worker_env == {}
    monkeypatch.setattr("tandem.common.launcher.up.usable_cpus", lambda: [0, 1])
    shared = up_config("--model", tiny_llama, "--no-tls")
    assert shared.worker_cpus == {} and shared.worker_env == {"OMP_WAIT_POLICY": "PASSIVE"}
    stack = Stack(shared, tiny_llama)
    envs = {}
    monkeypatch.setattr(stack, "_spawn", lambda name, *argv, env=None: envs.setdefault(name, env))
    stack._worker("prefill-0", "prefill")
    assert envs["prefill-0"] == {"OMP_WAIT_POLICY": "PASSIVE"}
    # --num-threads given: the user sized the workers' threads; auto leaves them be.
    assert up_config("--model", tiny_llama, "--num-threads", "1").worker_cpus == {}
    assert up_config("--model", tiny_llama, "--prefill-tp-size", "2").worker_cpus == {}


def allowed_cpus(pid: int) -> set[str]:
    """Cpus_allowed_list of every thread of `pid`."""
    lists = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/status") as f:
            lists.update(line.split()[1] for line in f if line.startswith("Cpus_allowed_list:"))
    return lists


@pytest.mark.e2e
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 usable CPUs")
def test_up_pins_every_thread_of_each_worker_to_its_slice(tiny_llama):
    cpus = sorted(os.sched_getaffinity(0))
    up = UpProcess("--model", tiny_llama, "--cpu-split", "1:1", "--port", str(free_port()), "--no-tls", *STACK_FLAGS)
    try:
        pids = up.child_pids()
        assert allowed_cpus(pids["prefill-0"]) == {str(cpus[0])}
        assert allowed_cpus(pids["decode-0"]) == {str(cpus[1])}
        assert (f"CPUs (--cpu-split): prefill-0 --cpu-affinity {cpus[0]}, decode-0 --cpu-affinity {cpus[1]}"
                in "".join(up.err))
        from openai import OpenAI

        with OpenAI(base_url=up.url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
            done = client.completions.create(model=os.path.basename(tiny_llama), prompt="the quick", max_tokens=4,
                                             temperature=0)
        assert done.usage.completion_tokens == 4  # the pinned pair serves
    finally:
        up.kill()


def environment(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(item.decode().partition("=")[::2] for item in f.read().split(b"\0") if b"=" in item)


@pytest.mark.e2e
def test_shared_workers_wait_passively_and_serve(tiny_llama):
    up = UpProcess("--model", tiny_llama, "--cpu-split", "shared", "--port", str(free_port()), "--no-tls",
                   *STACK_FLAGS)
    try:
        pids = up.child_pids()
        for name in ("prefill-0", "decode-0"):
            assert environment(pids[name]).get("OMP_WAIT_POLICY") == "PASSIVE", name
        assert environment(pids["router"]).get("OMP_WAIT_POLICY") == os.environ.get("OMP_WAIT_POLICY")  # workers only
        assert "CPUs (--cpu-split): every worker on every CPU, OMP_WAIT_POLICY=PASSIVE" in "".join(up.err)
        from openai import OpenAI

        with OpenAI(base_url=up.url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
            done = client.completions.create(model=os.path.basename(tiny_llama), prompt="the quick", max_tokens=4,
                                             temperature=0)
        assert done.usage.completion_tokens == 4
    finally:
        up.kill()
