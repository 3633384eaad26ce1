"""`tandem up --planner`: the planner's decisions acted on this machine. A scale-up starts a worker and adds it
to the router (POST /workers); a scale-in takes the newest worker of the role out of the router, which drains
it (DELETE /workers answers once its requests finished), and only then stops the process (SIGTERM)."""

from __future__ import annotations

import argparse
import json
import secrets
import sys
import time
import urllib.error
import urllib.request
from dataclasses import replace
from typing import Optional

from tandem.common.flags import ConfigError, add_flags, from_flags, to_argv
from tandem.common.launcher.children import BOOTSTRAP_LISTENING, Child, stop_all
from tandem.common.planner.config import PlannerConfig
from tandem.common.planner.decide import ROLES
from tandem.common.planner.watch import Watcher

# PlannerConfig fields `tandem up` sets itself: its router, its workers' metrics; --metrics-port is the workers'.
PLANNER_FIELDS_SET_BY_UP = ("router_url", "worker_metrics", "metrics_host", "metrics_port")
ADMIN_TIMEOUT_S = 30.0


def add_planner_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("planner")
    g.add_argument("--planner", action="store_true",
                   help="size the prefill and decode pools to the load: start and stop workers as `tandem planner` "
                        "decides (its flags below); a worker is drained before it stops")
    add_flags(p, PlannerConfig, title="planner", env_prefix="TANDEM_PLANNER_", exclude=PLANNER_FIELDS_SET_BY_UP,
              section_prefix="planner: ")


def planner_from_args(args: argparse.Namespace) -> Optional[PlannerConfig]:
    """The planner's config under `tandem up --planner` (None without it), checked against the stack's shape."""
    # Only the planner's own flags: --metrics-port, say, is the workers' under `tandem up`.
    config = from_flags(PlannerConfig, argparse.Namespace(**{k: v for k, v in vars(args).items()
                                                             if k not in PLANNER_FIELDS_SET_BY_UP}))
    if not args.planner:
        given = to_argv(config, "TANDEM_PLANNER_")[0]
        if given:
            raise ConfigError(f"{given[0]} is a planner setting: add --planner")
        return None
    if args.unified:
        raise ConfigError("tandem up --planner sizes prefill and decode pools; with --unified there are none "
                          "(a unified pool is not planned yet)")
    if args.dp_size > 1:
        raise ConfigError(f"tandem up --planner with --dp-size {args.dp_size}: per-replica metrics are not "
                          "implemented yet")
    config.validate()
    for role, count in (("prefill", args.prefill), ("decode", args.decode)):
        low, high = config.bounds(role)
        if not low <= count <= high:
            raise ConfigError(f"--{role} {count} is outside the planner's bounds --min-{role} {low} .. "
                              f"--max-{role} {high}")
    return config


def admin_key_for(args: argparse.Namespace) -> Optional[str]:
    """The router's admin key: the one given, or under --planner a fresh one (the launcher's alone)."""
    return args.admin_api_key or (secrets.token_urlsafe(24) if args.planner else None)


class LocalScaler:
    """Polled from `tandem up`'s main loop; owns the workers it starts and the decisions' effects."""

    def __init__(self, stack, config: PlannerConfig, admin_key: str):
        self.stack = stack
        self.admin_key = admin_key
        self.watcher = Watcher(replace(config, router_url=stack.url), worker_metrics=self.prefill_metrics)
        self.next_tick = 0.0
        self.started = {role: getattr(stack.config, role) for role in ROLES}  # names are role-N, N counting up

    def workers(self, role: str) -> list[Child]:
        return [c for c in self.stack.children if c.name.startswith(f"{role}-")]

    def prefill_metrics(self) -> list[str]:
        return [url for name, url in self.stack.metrics_urls.items() if name.startswith("prefill-")]

    def poll(self) -> None:
        if time.monotonic() < self.next_tick:
            return
        self.next_tick = time.monotonic() + self.watcher.config.interval_s
        decisions = self.watcher.tick() or {}
        for role, decision in decisions.items():
            while len(self.workers(role)) < decision.desired:
                if not self.start(role):
                    break
            while len(self.workers(role)) > max(decision.desired, 1):
                self.stop(self.workers(role)[-1], role)

    def start(self, role: str) -> bool:
        """A new worker of `role`, serving once the router has it; False (logged) when it did not start."""
        name = f"{role}-{self.started[role]}"
        self.started[role] += 1
        _say(f"planner: starting {name}")
        began = time.monotonic()
        extra = ["--bootstrap-port", "0"] if role == "prefill" else []
        child = self.stack._worker(name, role, *extra)
        try:
            port = self.stack._wait_port(child, r"worker listening on 127\.0\.0\.1:(\d+)",
                                         time.monotonic() + self.stack.config.ready_timeout_s)
            body = {"url": f"grpc://127.0.0.1:{port}", "role": role}
            if role == "prefill":
                body["bootstrap_port"] = int(child.wait_for(BOOTSTRAP_LISTENING, 1.0).group(1))
            self._admin("POST", body)
        except Exception as e:  # noqa: BLE001 - a worker that fails to start must not stop the serving stack
            _say(f"planner: {name} did not start ({e}); its last lines:\n{child.last_lines()}")
            self._discard(child)
            return False
        child.started()
        child.grpc_url = body["url"]
        _say(f"planner: {name} serving ({time.monotonic() - began:.1f}s to start)")
        return True

    def stop(self, child: Child, role: str) -> None:
        """Drain `child` out of the router (no request fails), then stop it."""
        began = time.monotonic()
        _say(f"planner: draining {child.name}")
        try:
            answer = self._admin("DELETE", {"url": child.grpc_url, "timeout_s": self.stack.config.stop_timeout_s})
            cut = answer.get("cut_off_requests", 0)
        except (urllib.error.URLError, OSError, ValueError) as e:
            cut = f"unknown ({e})"
        self._discard(child)
        _say(f"planner: stopped {child.name} ({time.monotonic() - began:.1f}s; requests cut off: {cut})")

    def _discard(self, child: Child) -> None:
        stop_all([child], self.stack.config.stop_timeout_s)
        child.close()
        self.stack.children.remove(child)
        self.stack.metrics_urls.pop(child.name, None)

    def _admin(self, method: str, body: dict) -> dict:
        request = urllib.request.Request(self.stack.url + "/workers", data=json.dumps(body).encode(), method=method,
                                         headers={"Authorization": f"Bearer {self.admin_key}",
                                                  "Content-Type": "application/json"})
        timeout = ADMIN_TIMEOUT_S + float(body.get("timeout_s", 0))
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return json.loads(resp.read())


def _say(message: str) -> None:
    print(f"tandem up: {message}", file=sys.stderr, flush=True)
