"""The frontend's view of discovery: which models are served, by which live instances."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from turbine.config import RequestPlaneConfig
from turbine.frontend.models.busy_queue import BusyConfig, BusyQueue
from turbine.frontend.models.decode_cache import DecodeCaches
from turbine.frontend.models.tokenizer import TextTokenizer
from turbine.protocol.discovery import InstanceRecord, ModelCard
from turbine.protocol.encode import IMAGE_ENCODE
from turbine.router.policy import Router

log = logging.getLogger("turbine.frontend")

TEXT_MODE = "text"  # a card's model_input when its workers tokenize (preprocess/text_mode.py)


def is_text_mode(card: ModelCard) -> bool:
    return card.model_input == TEXT_MODE


@dataclass
class ServedModel:
    name: str
    card: ModelCard
    tokenizer: TextTokenizer | None  # None: text mode (the worker tokenizes; see text_mode.py)
    router: Router
    instances: list[InstanceRecord] = field(default_factory=list)
    cards: dict[str, ModelCard] = field(default_factory=dict)  # instance id -> its card
    # Disaggregated serving: the model's prefill workers (none: it is served aggregated).
    prefill_router: Router | None = None
    prefill_instances: list[InstanceRecord] = field(default_factory=list)
    prefill_cards: dict[str, ModelCard] = field(default_factory=dict)
    prefill_queued_tokens: dict[str, int] = field(default_factory=dict)  # instance id -> prompt tokens in flight
    decode_caches: DecodeCaches | None = None  # set while prefill workers exist
    # A LoRA adapter served as a model (its workers' adapter cards): requests carry its name as
    # lora_name and go only to the instances that hold it; tokenizer, router and decode caches are
    # its base model's (`parent`), whose router's block hashes the adapter name salts.
    lora_name: str | None = None
    parent: str | None = None
    # Its base model is disaggregated but no prefill worker holds the adapter: served aggregated.
    lora_fallback: bool = False
    # Disaggregated encode: the model's encode workers (cards with endpoint type "image_encode"), which turn
    # images into embeddings for the workers that take them (encode.py); none: the workers encode themselves.
    encode_instances: list[InstanceRecord] = field(default_factory=list)
    # Busy thresholds and the request queue (busy_queue.py; None: off), the base model's for its adapters.
    busy_queue: BusyQueue | None = None


class ModelTable:
    """Rebuilt from every discovery snapshot; lookups are plain dict reads on the hot path."""

    def __init__(self, registry, make_router, namespace: str | None = None, busy: BusyConfig = BusyConfig(),
                 request_plane: RequestPlaneConfig = RequestPlaneConfig()):
        self.registry = registry
        self.request_plane = request_plane
        self._other_plane: set[str] = set()  # instances on another request plane, warned about once
        self._mixed_limits: dict[str, tuple] = {}  # model -> its workers' differing migration limits, warned
        self.busy = busy
        self._busy_queues: dict[str, BusyQueue] = {}  # model -> its queue (kept across snapshots, as routers)
        self.make_router = make_router
        self.namespace = namespace
        self.models: dict[str, ServedModel] = {}
        self.asleep: frozenset[str] = frozenset()  # models whose every worker sleeps (their cards say so)
        self.first_seen: dict[str, int] = {}  # model -> when this frontend first saw it (Unix seconds): `created`
        self._tokenizers: dict[tuple[str, str | None], TextTokenizer] = {}
        self._routers: dict[str | tuple[str, str], Router] = {}
        self._decode_caches: dict[str, DecodeCaches] = {}  # model -> its decode workers' prompts
        self.first_snapshot = asyncio.Event()  # set once the first discovery snapshot is applied

    def _on_our_plane(self, rec: InstanceRecord) -> bool:
        """Whether we can call the instance (its address is on our request plane); warns once if not."""
        if self.request_plane.serves(rec.address):
            return True
        if rec.instance_id not in self._other_plane:
            self._other_plane.add(rec.instance_id)
            other = "tcp" if self.request_plane.kind == "nats" else "nats"
            log.warning("instance %s (%s/%s) serves on the %s request plane, this frontend on %s (--request-plane): "
                        "not routed to", rec.instance_id, rec.namespace, rec.component, other, self.request_plane.kind)
        return False

    async def run(self) -> None:
        async for instances, cards in self.registry.watch():
            try:
                await self._apply(instances, cards)
            except Exception:  # a bad card must not stop the watcher
                log.exception("could not apply discovery snapshot")
            self.first_snapshot.set()

    async def _apply(self, instances: list[InstanceRecord], cards: list[ModelCard]) -> None:
        busy = self.busy
        by_path = {rec.path: rec for rec in instances if self._on_our_plane(rec)}
        models: dict[str, ServedModel] = {}
        prefill: list[tuple[ModelCard, InstanceRecord]] = []
        encoders: list[tuple[ModelCard, InstanceRecord]] = []
        adapters = [c for c in cards if c.lora_name is not None]
        sleeping: set[str] = set()
        for card in sorted((c for c in cards if c.lora_name is None), key=lambda c: c.instance_id):
            if self.namespace and card.namespace != self.namespace:
                continue
            if card.sleeping:  # routed to again once it wakes (its records and awake card come back)
                sleeping.add(card.name)
                continue
            rec = by_path.get(card.path)
            if rec is None:
                continue  # the card outlived its instance record (or arrived first)
            if card.disaggregation_mode == "prefill":
                prefill.append((card, rec))
                continue
            if IMAGE_ENCODE in card.endpoint_types:
                encoders.append((card, rec))
                continue
            model = models.get(card.name)
            if model is None:
                tokenizer = None if is_text_mode(card) else await self._tokenizer(card)
                if tokenizer is None and not is_text_mode(card):
                    continue
                router = self._routers.get(card.name)
                if router is None:
                    router = self._routers[card.name] = self.make_router(card)
                model = models[card.name] = ServedModel(card.name, card, tokenizer, router)
                if busy.enabled:
                    model.busy_queue = self._busy_queues.setdefault(card.name, BusyQueue(busy))
                self.first_seen.setdefault(card.name, int(time.time()))
            elif is_text_mode(card) != is_text_mode(model.card):
                log.warning("worker %s of model %r is in %s mode, its peers in %s mode: skipped",
                            card.instance_id, card.name, card.model_input, model.card.model_input)
                continue
            elif card.kv_block_size != model.card.kv_block_size or card.context_length != model.card.context_length:
                log.warning("worker %s of model %r differs from its peers (block size %d vs %d, context %d vs %d)",
                            card.instance_id, card.name, card.kv_block_size, model.card.kv_block_size,
                            card.context_length, model.card.context_length)
            model.instances.append(rec)
            model.cards[card.instance_id] = card
        self._attach_prefill_workers(models, prefill)
        for card, rec in encoders:
            if card.name in models:  # (an encode worker alone serves nothing)
                models[card.name].encode_instances.append(rec)
        for name, model in models.items():
            model.router.instances_changed(model.instances, model.cards)
            self._warn_on_mixed_migration_limits(model)
            if name not in self.models or len(self.models[name].instances) != len(model.instances):
                log.info("model %r served by %d worker(s)", name, len(model.instances))
        for name, model in self._adapters(models, adapters, by_path).items():
            models[name] = model
            self.first_seen.setdefault(name, int(time.time()))
            old = self.models.get(name)
            if old is None or len(old.instances) != len(model.instances):
                log.info("adapter %r of model %r served by %d worker(s)", name, model.parent, len(model.instances))
        for name in self.models.keys() - models.keys():
            log.info("model %r has no live worker any more", name)
        self.models = models
        self.asleep = frozenset(sleeping - models.keys())
        if busy.enabled:  # each queue's waiters see the workers now live (a worker that joined is free)
            live: dict[str, dict[str, list[InstanceRecord]]] = {name: {} for name in self._busy_queues}
            for name, model in models.items():
                live[model.parent or name][name] = model.instances
            for name, queue in self._busy_queues.items():
                queue.set_instances(live[name])

    def _decode_caches_of(self, name: str, block_size: int, instances: list[InstanceRecord]) -> DecodeCaches:
        """The model's decode workers' likely caches, kept across snapshots (anew if the block size
        changed), forgetting workers no longer among `instances`."""
        caches = self._decode_caches.get(name)
        if caches is None or caches.block_size != block_size:
            caches = self._decode_caches[name] = DecodeCaches(block_size)
        caches.keep_only({i.instance_id for i in instances})
        return caches

    def _warn_on_mixed_migration_limits(self, model: ServedModel) -> None:
        """A model's migration limit is its first card's (the lowest instance id), unless the frontend's
        --migration-limit overrides it: workers started with different --migration-limit values are
        named once per change, or streams would migrate or not depending on which worker came first."""
        limits = tuple(sorted((iid, card.migration_limit) for iid, card in model.cards.items()))
        if len({limit for _, limit in limits}) < 2:
            self._mixed_limits.pop(model.name, None)
            return
        if self._mixed_limits.get(model.name) != limits:
            self._mixed_limits[model.name] = limits
            log.warning("model %r: its workers were started with different --migration-limit values (%s); the model "
                        "uses %d, worker %s's (the lowest instance id): start them alike, or set --migration-limit on "
                        "the frontend", model.name, ", ".join(f"{iid}: {limit}" for iid, limit in limits),
                        model.card.migration_limit, model.card.instance_id)

    def _adapters(self, models: dict[str, ServedModel], cards: list[ModelCard],
                  by_path: dict[str, InstanceRecord]) -> dict[str, ServedModel]:
        """The LoRA adapters served: each on the instances whose base card is served and that
        hold it (an adapter's prefill workers: the base's prefill workers that hold it)."""
        adapters: dict[str, ServedModel] = {}
        prefill: list[tuple[ModelCard, InstanceRecord]] = []
        for card in sorted(cards, key=lambda c: c.instance_id):
            if self.namespace and card.namespace != self.namespace:
                continue
            rec = by_path.get(card.path)
            base = models.get(card.base_model or "")
            if rec is None or base is None:
                continue  # its instance (or the base model) is not served
            name = card.lora_name
            if name in models:
                log.warning("adapter %r on worker %s has the name of a served model: skipped", name, card.instance_id)
                continue
            if card.disaggregation_mode == "prefill":
                if card.instance_id in base.prefill_cards:
                    prefill.append((card, rec))
                continue
            if card.instance_id not in base.cards:
                continue  # its base card was skipped
            model = adapters.get(name)
            if model is None:
                model = adapters[name] = ServedModel(name, card, base.tokenizer, base.router, lora_name=name,
                                                     parent=base.name, busy_queue=base.busy_queue)
            elif model.parent != base.name:
                log.warning("adapter %r on worker %s adapts model %r, on other workers %r: skipped", name,
                            card.instance_id, base.name, model.parent)
                continue
            model.instances.append(rec)
            model.cards[card.instance_id] = card
        for card, rec in prefill:
            model = adapters.get(card.lora_name)
            if model is None or model.parent != card.base_model:
                continue  # no decode worker holds it
            base = models[model.parent]
            model.prefill_instances.append(rec)
            model.prefill_cards[card.instance_id] = card
            model.prefill_router, model.prefill_queued_tokens = base.prefill_router, base.prefill_queued_tokens
        for name, model in adapters.items():
            base = models[model.parent]
            model.lora_fallback = bool(base.prefill_instances) and not model.prefill_instances
            if model.prefill_instances:  # the decode workers' likely caches of this adapter's prompts
                model.decode_caches = self._decode_caches_of(name, base.card.kv_block_size, model.instances)
            else:
                self._decode_caches.pop(name, None)
        return adapters

    def _attach_prefill_workers(self, models: dict[str, ServedModel],
                                prefill: list[tuple[ModelCard, InstanceRecord]]) -> None:
        """Prefill workers serve a model only beside its decode (or aggregated) workers."""
        for card, rec in prefill:
            model = models.get(card.name)
            if model is None:
                continue  # no worker to decode: nothing to hand the KV to
            if is_text_mode(model.card):
                log.warning("prefill worker %s of model %r: skipped (the model is served in text mode, which "
                            "serves whole requests)", card.instance_id, card.name)
                continue
            if card.kv_block_size != model.card.kv_block_size:
                log.warning("prefill worker %s of model %r has KV block size %d, its decode workers %d: "
                            "skipped (the KV could not be handed over)",
                            card.instance_id, card.name, card.kv_block_size, model.card.kv_block_size)
                continue
            model.prefill_instances.append(rec)
            model.prefill_cards[card.instance_id] = card
        for name, model in models.items():
            old = self.models.get(name)
            if model.prefill_instances:
                router = self._routers.get(("prefill", name))
                if router is None:
                    router = self._routers[("prefill", name)] = self.make_router(
                        model.prefill_cards[model.prefill_instances[0].instance_id])
                model.prefill_router = router
                router.instances_changed(model.prefill_instances, model.prefill_cards)
                if old is not None:
                    model.prefill_queued_tokens = old.prefill_queued_tokens
                model.decode_caches = self._decode_caches_of(name, model.card.kv_block_size, model.instances)
            else:
                self._decode_caches.pop(name, None)
            if len(old.prefill_instances if old else ()) != len(model.prefill_instances):
                if model.prefill_instances:
                    log.info("model %r: disaggregated serving with %d prefill worker(s)",
                             name, len(model.prefill_instances))
                elif old is not None:
                    log.info("model %r: no prefill worker left; decode workers prefill themselves", name)

    async def _tokenizer(self, card: ModelCard) -> TextTokenizer | None:
        key = (card.tokenizer_path, card.chat_template_path)
        tok = self._tokenizers.get(key)
        if tok is None:
            try:
                tok = await asyncio.to_thread(TextTokenizer.from_dir, card.tokenizer_path,
                                              chat_template_path=card.chat_template_path)
            except Exception as exc:
                log.error("cannot load the tokenizer of model %r from %s: %s", card.name, card.tokenizer_path, exc)
                return None
            self._tokenizers[key] = tok
        return tok
