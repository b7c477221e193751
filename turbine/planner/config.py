"""The planner's one config (`PlannerConfig`, checks itself) and its flags; a `--config` file
(YAML or JSON, the same names as the fields, `-` or `_`) gives values, flags given on the command
line override them."""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass, field, fields
from typing import Any

from turbine.config import (
    DEFAULT_NAMESPACE,
    ClusterSecurityConfig,
    DiscoveryConfig,
    add_cluster_security_args,
    add_discovery_args,
    check,
    cluster_security_from_args,
    config_errors_to,
    discovery_config_from_args,
    flag,
)
from turbine.flag_sources import load_config_file
from turbine.planner.connector import ROLES, connector_names
from turbine.planner.predictors import PREDICTORS

MODES = ("agg", "disagg", "prefill", "decode")
ROLES_OF_MODE = {"agg": ("agg",), "disagg": ("prefill", "decode"), "prefill": ("prefill",), "decode": ("decode",)}


@dataclass(frozen=True)
class PlannerConfig:
    profile: str = flag("--profile", default="")  # required: the engine profile JSON (turbine profile)
    mode: str = flag("--mode", default="agg")
    namespace: str = flag("--namespace", default=DEFAULT_NAMESPACE)
    model: str | None = flag("--model", default=None)  # served model name; None: all of the namespace, together
    ttft_ms: float = flag("--ttft-ms", default=500.0)
    itl_ms: float = flag("--itl-ms", default=50.0)
    adjustment_interval_s: float = flag("--adjustment-interval", default=60.0)
    fast_interval_s: float = flag("--fast-interval", default=5.0)  # 0: no load-based path
    scale_down_sensitivity: float = flag("--scale-down-sensitivity", default=0.8)
    # The throughput path sizes engines for this share of the targets: the model gives a mean latency,
    # requests scatter around it and the SLA counts each one, so 1 (plan at the targets) misses ~half.
    target_share: float = flag("--target-share", default=1.0)
    # Square-root staffing: R + beta sqrt(R) engines for R engines' worth of predicted load (0: R).
    sqrt_staffing: float = flag("--sqrt-staffing", default=0.0)
    # Expected worker start-up, s: the throughput path sizes for the load predicted until the workers
    # it starts now are ready. None: the start-ups observed (0 until one was).
    startup_s: float | None = flag("--startup-s", default=None)
    # Expected wake of a worker from the connector's sleeping pool, s (a level-1 wake of vLLM on an H100
    # took 0.2-0.6 s, registering again included ~0.5 s): used only where the connector keeps a pool.
    wake_s: float = flag("--wake-s", default=1.0)
    min_replicas: dict[str, int] = flag("--min-replicas", default_factory=dict)  # role -> n (default 1)
    max_replicas: dict[str, int] = flag("--max-replicas", default_factory=dict)  # role -> n (default 8)
    max_workers: int | None = flag("--max-workers", default=None)  # the budget: workers of all roles
    connector: str = flag("--connector", default="advisory")
    connector_options: dict[str, Any] = flag("--connector-option", default_factory=dict)
    advisory: bool = flag("--advisory", default=False)
    predictor: str = flag("--predictor", default="arima")
    frontend_url: str = flag("--frontend-url", default="http://127.0.0.1:8000")
    prometheus_url: str | None = flag("--prometheus-url", default=None)
    system_host: str = flag("--system-host", default="127.0.0.1")
    system_port: int = flag("--system-port", default=0)  # 0: any free port (logged, and in discovery)
    discovery: DiscoveryConfig = field(default_factory=DiscoveryConfig)
    security: ClusterSecurityConfig = field(default_factory=ClusterSecurityConfig)

    def __post_init__(self):
        check(self, bool(self.profile), "profile", "is required: the engine profile JSON that `turbine profile` "
                                                  "writes")
        check(self, os.path.isfile(self.profile), "profile", f"{self.profile!r}: no such file")
        check(self, self.mode in MODES, "mode", f"choose from {', '.join(MODES)}")
        for name in ("ttft_ms", "itl_ms", "adjustment_interval_s"):
            value = getattr(self, name)
            check(self, isinstance(value, (int, float)) and math.isfinite(value) and value > 0, name, "must be > 0")
        check(self, self.fast_interval_s >= 0, "fast_interval_s", "must be >= 0 (0: no load-based path)")
        check(self, self.fast_interval_s <= self.adjustment_interval_s, "fast_interval_s",
              "must not be longer than --adjustment-interval (it is the faster of the two paths)")
        check(self, self.startup_s is None or (math.isfinite(self.startup_s) and self.startup_s >= 0), "startup_s",
              "must be >= 0 seconds (leave it out to use the start-ups observed)")
        check(self, math.isfinite(self.wake_s) and self.wake_s >= 0, "wake_s", "must be >= 0 seconds")
        check(self, 0 < self.scale_down_sensitivity <= 1, "scale_down_sensitivity", "must be in (0, 1]")
        check(self, 0 < self.target_share <= 1, "target_share", "must be in (0, 1]")
        check(self, isinstance(self.sqrt_staffing, (int, float)) and math.isfinite(self.sqrt_staffing)
              and self.sqrt_staffing >= 0, "sqrt_staffing", "must be >= 0 (0: no spare)")
        roles = ROLES_OF_MODE.get(self.mode, ())
        for name in ("min_replicas", "max_replicas"):
            counts = getattr(self, name)
            for role, n in counts.items():
                check(self, role in ROLES, name, f"unknown role {role!r}; roles: {', '.join(ROLES)}")
                check(self, role in roles, name, f"role {role!r} is not planned in mode {self.mode!r} "
                                                 f"(it plans {', '.join(roles)})")
                check(self, isinstance(n, int) and n >= 0, name, f"{role}: must be an integer >= 0")
        for role in roles:
            check(self, self.minimum(role) <= self.maximum(role), "max_replicas",
                  f"{role}: the maximum {self.maximum(role)} is below the minimum {self.minimum(role)}")
        if self.max_workers is not None:
            check(self, self.max_workers >= 1, "max_workers", "must be >= 1")
            floor = sum(self.minimum(r) for r in roles)
            check(self, floor <= self.max_workers, "max_workers",
                  f"the minimums of the roles need {floor} workers, more than this budget")
        if os.path.isfile(self.profile):
            from turbine.planner.profile import load_engine_profile

            try:
                load_engine_profile(self.profile)
            except ValueError as exc:
                check(self, False, "profile", str(exc))
        names = connector_names()
        check(self, self.connector in names, "connector", f"unknown connector; choose from {', '.join(names)}")
        check(self, self.connector != "advisory" or not self.connector_options, "connector_options",
              "the advisory connector takes no options")
        check(self, self.predictor in PREDICTORS, "predictor", f"choose from {', '.join(PREDICTORS)}")
        check(self, self.frontend_url.startswith(("http://", "https://")), "frontend_url",
              "expected an http:// or https:// base URL")
        check(self, self.prometheus_url is None or self.prometheus_url.startswith(("http://", "https://")),
              "prometheus_url", "expected an http:// or https:// base URL")
        check(self, 0 <= self.system_port < 65536, "system_port", "must be a port number (0: any free port)")

    @property
    def roles(self) -> tuple[str, ...]:
        return ROLES_OF_MODE[self.mode]

    @property
    def applies(self) -> bool:
        """Whether decisions change the fleet (not advisory)."""
        return not self.advisory and self.connector != "advisory"

    def minimum(self, role: str) -> int:
        return self.min_replicas.get(role, 1)

    def maximum(self, role: str) -> int:
        return self.max_replicas.get(role, 8)


_FIELD_OF_FLAG = {f.metadata["flag"]: f.name for f in fields(PlannerConfig) if "flag" in f.metadata}


def _role_counts(text: str) -> dict[str, int] | int:
    """"2" (every role) or "prefill=1,decode=2"."""
    text = text.strip()
    try:
        if "=" not in text:
            return int(text)
        out = {}
        for part in text.split(","):
            role, _, n = part.partition("=")
            out[role.strip()] = int(n)
        return out
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or ROLE=N,ROLE=N, got {text!r}") from None


def _option(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key.strip(), value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="turbine planner", argument_default=argparse.SUPPRESS,
                                description="The SLA planner: sizes the fleet per role to meet TTFT / ITL targets.")
    p.add_argument("--config", help="YAML or JSON file of these settings (field names, e.g. ttft_ms, min_replicas: "
                                    "{prefill: 1}); flags given here override it")
    p.add_argument("--profile", help="engine profile JSON (from `turbine profile` / `turbine mocker calibrate`)")
    p.add_argument("--mode", choices=MODES, help="which roles to plan: agg, disagg (prefill + decode), prefill, "
                                                 "decode (default agg)")
    p.add_argument("--namespace", help="the workers' namespace (default turbine)")
    p.add_argument("--model", help="served model name to plan for (default: every model of the namespace, "
                                   "counted together)")
    p.add_argument("--ttft-ms", type=float, help="time-to-first-token target, ms (default 500)")
    p.add_argument("--itl-ms", type=float, help="inter-token latency target, ms (default 50)")
    p.add_argument("--adjustment-interval", type=float,
                   help="seconds between throughput-based decisions (observe, predict, size; default 60)")
    p.add_argument("--fast-interval", type=float,
                   help="seconds between load-based +-1 decisions from the workers' load reports (default 5; 0: off)")
    p.add_argument("--scale-down-sensitivity", type=float,
                   help="load-based scale-down only when every engine is under this share of the targets (0.8)")
    p.add_argument("--target-share", type=float,
                   help="the throughput path sizes engines for this share of the TTFT and ITL targets (default 1)")
    p.add_argument("--sqrt-staffing", type=float, help="square-root staffing: the throughput path keeps "
                   "R + BETA sqrt(R) engines for R engines' worth of predicted load (default 0: R)")
    p.add_argument("--startup-s", type=float, help="expected worker start-up, s: the throughput path sizes for the "
                                                   "load predicted until new workers are ready (default: observed)")
    p.add_argument("--wake-s", type=float, help="expected wake of a worker from the connector's sleeping pool, s "
                   "(default 1: a level-1 wake of vLLM on an H100 took 0.2-0.6 s); used where the connector keeps "
                   "a pool (the local connector's sleep_pool)")
    p.add_argument("--min-replicas", type=_role_counts, help="N or ROLE=N,...: fewest workers per role (default 1)")
    p.add_argument("--max-replicas", type=_role_counts, help="N or ROLE=N,...: most workers per role (default 8)")
    p.add_argument("--max-workers", type=int, help="budget: most workers of all roles together (default: none)")
    p.add_argument("--connector", help=f"what applies decisions: {', '.join(connector_names())} (default advisory)")
    p.add_argument("--connector-option", type=_option, action="append",
                   help="KEY=VALUE for the connector (repeatable; the connector says which it takes)")
    p.add_argument("--advisory", action="store_true",
                   help="log decisions and change nothing (the connector is only asked what runs)")
    p.add_argument("--predictor", choices=PREDICTORS, help="load predictor (default arima)")
    p.add_argument("--frontend-url", help="the frontend whose /metrics are scraped (default http://127.0.0.1:8000)")
    p.add_argument("--prometheus-url", help="read the frontend's metrics from this Prometheus server's HTTP API "
                                            "instead of scraping the frontend")
    p.add_argument("--system-host", help="the planner's /health and /metrics listener (default 127.0.0.1)")
    p.add_argument("--system-port", type=int, help="its port (default 0: any free port)")
    add_discovery_args(p)
    add_cluster_security_args(p, listens=False)
    return p


def _read_file(path: str) -> dict[str, Any]:
    data = load_config_file(path)  # the processes' one --config reader (YAML, a superset of JSON)
    known = {f.name for f in fields(PlannerConfig)} - {"discovery", "security"}
    out = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        name = {"adjustment_interval": "adjustment_interval_s", "fast_interval": "fast_interval_s"}.get(name, name)
        if name not in known:
            raise ValueError(f"--config {path}: unknown setting {key!r}; settings: {', '.join(sorted(known))}")
        out[name] = value
    return out


def _counts(value: Any, roles: tuple[str, ...]) -> Any:
    return dict.fromkeys(roles, value) if isinstance(value, int) and not isinstance(value, bool) else value


def parse_planner_args(argv: list[str] | None = None) -> PlannerConfig:
    parser = build_parser()
    args = parser.parse_args(argv)
    given = vars(args)
    values: dict[str, Any] = {}
    if "config" in given:
        try:
            values.update(_read_file(given["config"]))
        except ValueError as exc:
            parser.error(str(exc))
    for f in fields(PlannerConfig):
        flag_name = f.metadata.get("flag")
        dest = flag_name and flag_name.removeprefix("--").replace("-", "_")
        if dest and dest in given:
            values[f.name] = given[dest]
    if "connector_options" in values and isinstance(values["connector_options"], list):
        values["connector_options"] = dict(values["connector_options"])
    # Discovery and security: their own flags (and env), as every process reads them.
    values["discovery"] = discovery_config_from_args(args, parser)
    values["security"] = cluster_security_from_args(args, parser)
    mode = values.get("mode", "agg")
    for name in ("min_replicas", "max_replicas"):
        if name in values:
            values[name] = _counts(values[name], ROLES_OF_MODE.get(mode, ()))
    with config_errors_to(parser):
        try:
            return PlannerConfig(**values)
        except TypeError as exc:  # a file value of the wrong shape
            parser.error(f"--config: {exc}")
