"""The standalone KV router's request-plane contract (`python -m turbine.router`).

`best_worker` answers which worker instance should serve a prompt; `first_token` and
`finished` tell the router how that request went, so that its load accounting stays right.
Errors (unknown model, no live worker, bad input) come back in-band in `error`, like the
workers' own invalid-request answers."""

from __future__ import annotations

import msgspec

WIRE_VERSION = 1

BEST_WORKER = "best_worker"
FIRST_TOKEN = "first_token"
FINISHED = "finished"
ROUTER_COMPONENT = "router"  # the component the router service registers under


class BestWorkerRequest(msgspec.Struct, omit_defaults=True, kw_only=True):
    model: str
    token_ids: list[int]
    lora_name: str | None = None
    # Set: the decision is counted as load on the chosen worker until `finished` names it.
    # None: a query only; nothing is counted.
    request_id: str | None = None
    # Choose among the model's instances of this component (e.g. "prefill"); None: the one
    # component that serves the model (an error if several do).
    component: str | None = None
    v: int = WIRE_VERSION


class BestWorkerReply(msgspec.Struct, omit_defaults=True, kw_only=True):
    instance_id: str = ""
    address: str = ""  # request-plane "host:port" of the chosen instance
    endpoint: str = ""  # its generate endpoint
    component: str = ""
    dp_rank: int = 0
    overlap_blocks: int = 0  # leading prompt blocks already cached on that worker
    prompt_blocks: int = 0  # full blocks in the prompt
    error: str | None = None  # set when no decision could be made (the other fields are empty)
    v: int = WIRE_VERSION


class RequestNotice(msgspec.Struct, kw_only=True):
    """`first_token` / `finished` of a request that `best_worker` placed (by its request_id)."""

    request_id: str
    v: int = WIRE_VERSION
