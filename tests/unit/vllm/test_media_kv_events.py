"""Image blocks in the worker's KV events (issue #19): the relay turns vLLM's per-block image keys (identifier,
offset) into media keys, and the frontend's KV router computes the same block hashes for the prompt as the engine
holds it (the card's placeholder widening each image token), so a repeated image and prefix matches the whole
prompt from events, and another image behind the same text matches only the blocks before the image.

vLLM's side is vLLM's own code: its extra keys (generate_block_hash_extra_keys, to_event_extra_keys) for a
request whose images sit where the processor put them, carried through msgpack as its publisher sends them."""

from __future__ import annotations

import time
from types import SimpleNamespace

import msgspec
import pytest
from prometheus_client import CollectorRegistry

vllm_events = pytest.importorskip("vllm.distributed.kv_events")

from vllm.multimodal.inputs import PlaceholderRange  # noqa: E402
from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, to_event_extra_keys  # noqa: E402

from turbine.protocol.discovery import InstanceRecord, ModelCard  # noqa: E402
from turbine.protocol.generate import GenerateRequest, ImageInput  # noqa: E402
from turbine.protocol.kv_events import BlockStored  # noqa: E402
from turbine.router.config import KvRouterConfig  # noqa: E402
from turbine.router.hashing import block_hashes, media_block_keys, media_key, widen_images  # noqa: E402
from turbine.router.indexer import KvIndexer, WorkerKey  # noqa: E402
from turbine.router.metrics import RouterMetrics  # noqa: E402
from turbine.router.policy import RouterConfig, make_router  # noqa: E402
from turbine.vllm.kv_events_relay import translate  # noqa: E402
from turbine.worker.kv_cache_state import KvCacheState  # noqa: E402

BS = 4
IMAGE = 7  # the image token the chat template writes
PLACEHOLDER = [90, 91, IMAGE, IMAGE, IMAGE, IMAGE, IMAGE, 92]  # what the engine widens it to (Idefics3-like)
RANGE = (0, 8)  # the image's placeholder range within PLACEHOLDER (vLLM's PlaceholderRange)
RED, BLUE = "ab" * 32, "cd" * 32
W = WorkerKey("w")


def prompt(images: int = 1, text: int = 9) -> list[int]:
    """System text (6 tokens), then `images` image tokens each followed by 3 text tokens, then `text` more."""
    ids = list(range(100, 106))
    for i in range(images):
        ids += [IMAGE, 200 + i, 201 + i, 202 + i]
    return ids + list(range(300, 300 + text))


def engine_event(token_ids: list[int], hashes: list[str], lora_name: str | None = None,
                 cache_salt: str | None = None):
    """vLLM's BlockStored for the engine's (widened) prompt, its extra keys computed by vLLM, sent through msgpack
    as vLLM's publisher sends it and decoded as the relay decodes it."""
    widened, ranges = widen_images(token_ids, IMAGE, PLACEHOLDER, RANGE)
    request = SimpleNamespace(
        mm_features=[SimpleNamespace(identifier=h, mm_position=PlaceholderRange(offset=o, length=n))
                     for h, (o, n) in zip(hashes, ranges)],
        lora_request=None if lora_name is None else SimpleNamespace(lora_name=lora_name, lora_path="/a"),
        cache_salt=cache_salt, prompt_embeds=None)
    full = len(widened) - len(widened) % BS
    keys, mm_idx = [], 0
    for start in range(0, full, BS):
        block_keys, mm_idx = generate_block_hash_extra_keys(request, start, start + BS, mm_idx)
        keys.append(block_keys)
    event = vllm_events.BlockStored(
        block_hashes=[1000 + i for i in range(full // BS)], parent_block_hash=None, token_ids=widened[:full],
        block_size=BS, lora_id=None, medium="GPU", lora_name=lora_name, extra_keys=to_event_extra_keys(keys))
    wire = msgspec.msgpack.encode(vllm_events.KVEventBatch(ts=time.time(), events=[event]))
    (decoded,) = msgspec.msgpack.Decoder(vllm_events.KVEventBatch).decode(wire).events
    return decoded


def kv_router(placeholder=(PLACEHOLDER, RANGE)):
    card = ModelCard(name="m", namespace="n", component="c", endpoint="generate", instance_id="w",
                     tokenizer_path="", context_length=4096, kv_block_size=BS, total_kv_blocks=100, max_num_seqs=8,
                     max_num_batched_tokens=512, multimodal=True, image_token_id=IMAGE,
                     image_placeholder=None if placeholder is None else placeholder[0],
                     image_placeholder_range=None if placeholder is None else placeholder[1])
    return make_router(RouterConfig(mode="kv", kv=KvRouterConfig(use_kv_events=False)), card,
                       RouterMetrics(CollectorRegistry()))


def frontend_hashes(router, token_ids: list[int], hashes: list[str]) -> list[int]:
    """The block hashes the frontend's KV router computes for a request with these images."""
    req = GenerateRequest(request_id="r", model="m", token_ids=token_ids,
                          images=[ImageInput(data=b"", hash=h) for h in hashes])
    ids, keys = router.hashed_ids(req)
    return block_hashes(ids, BS, media_keys=keys)


@pytest.fixture
def router():
    r = kv_router()
    r.instances_changed([InstanceRecord(namespace="n", component="c", endpoint="generate", instance_id="w",
                                        address="127.0.0.1:1")], {})
    yield r
    r.core.close()


@pytest.mark.parametrize("images, text", [(1, 9), (1, 0), (2, 5), (2, 11)])
def test_the_worker_and_the_frontend_hash_an_image_prompt_alike(router, images, text):
    ids, hashes = prompt(images, text), [RED, BLUE][:images]
    relayed = translate(engine_event(ids, hashes))
    assert isinstance(relayed, BlockStored) and relayed.media_keys is not None
    index = KvIndexer(BS)
    index.apply(W, relayed)
    ours = frontend_hashes(router, ids, hashes)
    # Every full block of the engine's prompt matches: the system text, the image blocks, the text after them.
    assert len(ours) == len(relayed.block_hashes) and index.find_matches(ours) == {W: len(ours)}


def test_another_image_behind_the_same_text_matches_only_the_blocks_before_it(router):
    ids = prompt(1, 9)
    index = KvIndexer(BS)
    index.apply(W, translate(engine_event(ids, [RED])))
    red, blue = frontend_hashes(router, ids, [RED]), frontend_hashes(router, ids, [BLUE])
    # The image's placeholder starts at token 6 (in block 1): block 0 is text only, shared; from block 1 on they
    # differ, and no block of the blue prompt is in the index.
    assert red[0] == blue[0] and not set(red[1:]) & set(blue[1:])
    assert index.find_matches(blue) == {W: 1}
    # Two images swapped are another prompt too.
    two = prompt(2, 5)
    assert frontend_hashes(router, two, [RED, BLUE])[2:] != frontend_hashes(router, two, [BLUE, RED])[2:]


def test_the_keys_follow_vllms_offsets_within_each_block():
    # Block 1 (tokens 4..7) holds the start of the image's placeholder at offset 2; block 2 holds its rest, the
    # placeholder having started 2 tokens before it (offset -2); block 3 is past it.
    assert media_block_keys([(6, 8)], [RED], 16, BS) == [0, media_key([(RED, 2)]), media_key([(RED, -2)]),
                                                         media_key([(RED, -6)])]
    assert media_block_keys([(6, 6)], [RED], 16, BS)[3] == 0
    assert media_key([(RED, 2)]) != media_key([(BLUE, 2)]) != media_key([(RED, 3)]) != 0
    # A block with no image hashes exactly as before (keys of 0 change nothing).
    assert block_hashes(list(range(8)), BS, media_keys=[0, 0]) == block_hashes(list(range(8)), BS)


def test_an_adapters_image_blocks_are_relayed_keyed_and_a_cache_salt_is_still_not():
    ids = prompt(1, 9)
    adapter = translate(engine_event(ids, [RED], lora_name="sql"))
    assert isinstance(adapter, BlockStored) and adapter.media_keys is not None
    assert translate(engine_event(ids, [RED], cache_salt="salt")) is None


def test_without_a_known_placeholder_the_frontend_keys_the_unwidened_prompt():
    r = kv_router(placeholder=None)
    try:
        ids, keys = r.hashed_ids(GenerateRequest(request_id="r", model="m", token_ids=prompt(),
                                                 images=[ImageInput(data=b"", hash=RED)]))
        assert keys is None and len(ids) == len(prompt()) + 4  # media_keyed_ids: the image's key after its token
    finally:
        r.core.close()


def test_a_snapshot_keeps_the_media_keys_and_the_index_checks_them():
    relayed = translate(engine_event(prompt(1, 9), [RED]))
    state = KvCacheState()
    state.apply(relayed)
    (batch,) = state.snapshot("w", 0, 0)
    (again,) = batch.events
    assert again.media_keys == relayed.media_keys
    bad = BlockStored(block_hashes=relayed.block_hashes, parent_hash=None, tokens=relayed.tokens,
                      block_size=BS, media_keys=relayed.media_keys[:1])
    with pytest.raises(ValueError, match="media keys"):
        KvIndexer(BS).apply(W, bad)
