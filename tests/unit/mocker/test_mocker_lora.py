"""The simulated engine keeps a LoRA adapter's KV cache apart from the base model's, as vLLM does:
the same prompt under an adapter finds no base blocks cached, and its stored blocks go out with
the adapter's name, which the router's hashes are salted with."""

from __future__ import annotations

from turbine.mocker.kv_cache import BlockPool
from turbine.mocker.scheduler import Scheduler, Sequence
from turbine.mocker.tokens import Choice, TokenSampler, prompt_seed
from turbine.protocol.kv_events import BlockStored
from turbine.router.indexer import KvIndexer, WorkerKey
from turbine.router.hashing import block_hashes

SAMPLER = TokenSampler(500, eos_token_ids=[2], special_token_ids=[0, 1, 2], natural_output_len=0)
PROMPT = list(range(100, 117))  # 4 full blocks of 4, and one token


def run(sched: Scheduler, seq_id: str, lora_name: str | None) -> Sequence:
    choice = Choice(seed=prompt_seed(PROMPT), index=0, min_tokens=0, stop_token_ids=frozenset(), ignore_eos=True)
    seq = Sequence(seq_id=seq_id, choice=choice, tokens=list(PROMPT), num_prompt_tokens=len(PROMPT), max_tokens=1,
                   lora_name=lora_name)
    sched.add(seq)
    while sched.has_work():
        sched.complete(sched.schedule())
    return seq


def test_an_adapters_prefix_cache_is_its_own_and_its_events_name_it():
    events: list[tuple[object, str | None]] = []
    pool = BlockPool(32, 4, on_event=lambda event, lora_name=None: events.append((event, lora_name)))
    sched = Scheduler(pool, SAMPLER, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    assert run(sched, "base", None).num_cached_tokens == 0
    assert run(sched, "sql", "sql").num_cached_tokens == 0  # the base's blocks are not the adapter's
    assert run(sched, "sql-again", "sql").num_cached_tokens == 16
    assert run(sched, "other", "other").num_cached_tokens == 0
    stored = [(e, lora) for e, lora in events if isinstance(e, BlockStored)]
    assert [lora for _, lora in stored] == [None, "sql", "other"]
    # a router fed these events finds the adapter's prefix only under the adapter's name
    index = KvIndexer(4)
    for event, lora in stored:
        index.apply(WorkerKey("w"), event, lora)
    assert index.find_matches(block_hashes(PROMPT, 4, lora_name="sql")) == {WorkerKey("w"): 4}
    assert index.find_matches(block_hashes(PROMPT, 4)) == {WorkerKey("w"): 4}
    assert index.find_matches(block_hashes(PROMPT, 4, lora_name="nope")) == {}
