"""The KV router's Prometheus metrics, in a registry the host process owns (the frontend's,
or the standalone router's). Per-worker series are labelled with the worker's instance id
(with "/RANK" for data-parallel ranks above 0). Several frontend processes (each its own router)
add up (turbine/runtime/prometheus_multiprocess.py): a gauge of what every router sees alike (a
worker's reports, the index of its blocks) is the latest any process set; one of what each router
holds itself (blocks it sent that no report includes yet) is summed."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry):
        r = registry
        self.decisions = Counter("turbine_router_decisions", "kv routing decisions", ["model"], registry=r)
        self.overlap = Histogram("turbine_router_overlap_ratio",
                                 "share of the prompt's full blocks cached on the chosen worker",
                                 ["model"], buckets=(0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0), registry=r)
        self.decision_seconds = Histogram("turbine_router_decision_seconds", "time to choose a worker",
                                          ["model"], buckets=(1e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 5e-3, 1e-2),
                                          registry=r)
        self.indexed_blocks = Gauge("turbine_router_indexed_blocks", "blocks the kv router knows a worker holds",
                                    ["model", "worker"], registry=r, multiprocess_mode="livemostrecent")
        # Cumulative counts kept by the router's parts, advanced to their value at scrape time (`advance`).
        self.events = Counter("turbine_router_kv_events_applied", "KV events applied to the index", ["model"],
                              registry=r)
        self.event_gaps = Counter("turbine_router_kv_event_gaps", "times KV events were found missing",
                                  ["model"], registry=r)
        self.event_recoveries = Counter("turbine_router_kv_event_recoveries",
                                        "missed KV events recovered from the workers (replayed or a snapshot)",
                                        ["model"], registry=r)
        self.event_recovery_failures = Counter("turbine_router_kv_event_recovery_failures",
                                               "failed attempts to recover missed KV events (each is retried)",
                                               ["model"], registry=r)
        self.event_warnings = Counter("turbine_router_kv_event_warnings",
                                      "workers whose KV events never arrived (kind=none_arrived) or stopped "
                                      "(kind=stopped) while requests should have produced some",
                                      ["model", "worker", "kind"], registry=r)
        self.worker_active_blocks = Gauge("turbine_router_worker_kv_active_blocks",
                                          "KV blocks in use, as the worker last reported", ["model", "worker"],
                                          registry=r, multiprocess_mode="livemostrecent")
        self.worker_total_blocks = Gauge("turbine_router_worker_kv_total_blocks",
                                         "KV blocks of the worker, as it last reported", ["model", "worker"],
                                         registry=r, multiprocess_mode="livemostrecent")
        self.worker_waiting = Gauge("turbine_router_worker_waiting_requests",
                                    "requests queued on the worker, as it last reported", ["model", "worker"],
                                    registry=r, multiprocess_mode="livemostrecent")
        self.worker_running = Gauge("turbine_router_worker_running_requests",
                                    "requests running on the worker, as it last reported", ["model", "worker"],
                                    registry=r, multiprocess_mode="livemostrecent")
        self.worker_pending_blocks = Gauge("turbine_router_worker_pending_blocks",
                                           "KV blocks of requests the router sent to the worker that its "
                                           "reports do not include yet", ["model", "worker"], registry=r,
                                           multiprocess_mode="livesum")
        self.lora_decisions = Counter("turbine_router_lora_decisions",
                                      "decisions for LoRA adapter requests, by whether the chosen worker had the "
                                      "adapter active (in its slots, or with a request of it from this router)",
                                      ["model", "active"], registry=r)
        self.load_reports = Counter("turbine_router_load_reports", "worker load reports received", ["model"],
                                    registry=r)
