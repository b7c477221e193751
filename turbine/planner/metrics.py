"""The planner's Prometheus metrics (its own registry): what it observed, what it predicts, what
one engine sustains, and what it decided."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class PlannerMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.observed = Gauge("turbine_planner_observed", "the last interval's traffic at the frontend, by quantity: "
                              "request_rate (1/s), isl, osl (tokens), ttft_seconds, itl_seconds, kv_hit_rate",
                              ["quantity"], registry=r)
        self.predicted = Gauge("turbine_planner_predicted", "the predictor's traffic for the next interval "
                               "(request_rate, isl, osl, kv_hit_rate)", ["quantity"], registry=r)
        self.engine_rate = Gauge("turbine_planner_engine_requests_per_second",
                                 "requests per second one engine of the role sustains under the targets "
                                 "(performance model)", ["role"], registry=r)
        self.reachable = Gauge("turbine_planner_target_reachable",
                               "1 when one engine of the role can meet its target at all, else 0", ["role"], registry=r)
        self.throughput_replicas = Gauge("turbine_planner_throughput_replicas",
                                         "the throughput-based path's workers per role (clamped): the load-based "
                                         "path's lower bound", ["role"], registry=r)
        self.target_replicas = Gauge("turbine_planner_target_replicas", "the last decision's workers per role",
                                     ["role"], registry=r)
        self.current_replicas = Gauge("turbine_planner_current_replicas", "workers per role running now",
                                      ["role"], registry=r)
        self.starting_replicas = Gauge("turbine_planner_starting_replicas",
                                       "workers per role asked for and not ready yet (counted as capacity)",
                                       ["role"], registry=r)
        self.sleeping_replicas = Gauge("turbine_planner_sleeping_replicas",
                                       "workers per role asleep in the connector's sleeping pool (woken first on a "
                                       "step up)", ["role"], registry=r)
        self.estimated = Gauge("turbine_planner_engine_estimate_ms",
                               "load-based path: the mean over a role's engines of the estimated ttft / itl (ms) "
                               "from their load reports", ["role", "quantity"], registry=r)
        self.decisions = Counter("turbine_planner_decisions", "decisions that changed a role's target, by path "
                                 "(startup, throughput, load, demand) and direction (up, down)", ["path", "role", "direction"],
                                 registry=r)
        self.horizon = Gauge("turbine_planner_horizon_intervals", "intervals ahead the throughput path provisions "
                             "for: 1 + ceil(expected start-up / interval)", registry=r)
        self.startup = Gauge("turbine_planner_startup_seconds", "the last observed worker start-up, s", ["role"],
                             registry=r)
        self.decision_id = Gauge("turbine_planner_decision_id", "the id of the last decision", registry=r)
        self.errors = Counter("turbine_planner_errors", "failed steps, by where: scrape, connector",
                              ["where"], registry=r)
