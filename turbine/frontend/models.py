"""The frontend's view of discovery: which models are served, by which live instances."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from turbine.frontend.router import Router
from turbine.frontend.tokenizer import TextTokenizer
from turbine.protocol.discovery import InstanceRecord, ModelCard

log = logging.getLogger("turbine.frontend")


@dataclass
class ServedModel:
    name: str
    card: ModelCard
    tokenizer: TextTokenizer
    router: Router
    instances: list[InstanceRecord] = field(default_factory=list)
    cards: dict[str, ModelCard] = field(default_factory=dict)  # instance id -> its card


class ModelTable:
    """Rebuilt from every discovery snapshot; lookups are plain dict reads on the hot path."""

    def __init__(self, registry, make_router, namespace: str | None = None):
        self.registry = registry
        self.make_router = make_router
        self.namespace = namespace
        self.models: dict[str, ServedModel] = {}
        self._tokenizers: dict[tuple[str, str | None], TextTokenizer] = {}
        self._routers: dict[str, Router] = {}

    async def run(self) -> None:
        async for instances, cards in self.registry.watch():
            try:
                await self._apply(instances, cards)
            except Exception:  # a bad card must not stop the watcher
                log.exception("could not apply discovery snapshot")

    async def _apply(self, instances: list[InstanceRecord], cards: list[ModelCard]) -> None:
        by_path = {rec.path: rec for rec in instances}
        models: dict[str, ServedModel] = {}
        for card in sorted(cards, key=lambda c: c.instance_id):
            if self.namespace and card.namespace != self.namespace:
                continue
            rec = by_path.get(f"{card.namespace}/{card.component}/{card.endpoint}/{card.instance_id}")
            if rec is None:
                continue  # the card outlived its instance record (or arrived first)
            model = models.get(card.name)
            if model is None:
                tokenizer = await self._tokenizer(card)
                if tokenizer is None:
                    continue
                router = self._routers.get(card.name)
                if router is None:
                    router = self._routers[card.name] = self.make_router(card)
                model = models[card.name] = ServedModel(card.name, card, tokenizer, router)
            elif card.kv_block_size != model.card.kv_block_size or card.context_length != model.card.context_length:
                log.warning("worker %s of model %r differs from its peers (block size %d vs %d, context %d vs %d)",
                            card.instance_id, card.name, card.kv_block_size, model.card.kv_block_size,
                            card.context_length, model.card.context_length)
            model.instances.append(rec)
            model.cards[card.instance_id] = card
        for name in self.models.keys() - models.keys():
            log.info("model %r has no live worker any more", name)
        for name, model in models.items():
            model.router.instances_changed(model.instances, model.cards)
            if name not in self.models or len(self.models[name].instances) != len(model.instances):
                log.info("model %r served by %d worker(s)", name, len(model.instances))
        self.models = models

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
