"""vLLM v1's scheduler, simulated: continuous batching over a paged KV cache.

Each step has a token budget (max_num_batched_tokens). Running sequences are served first,
in admission order; one that needs a block when none is left preempts the newest running
sequence (its blocks are freed and it goes back to the head of the waiting queue, to be
recomputed later; possibly itself). Waiting sequences are admitted only in steps without
preemption, up to max_num_seqs, after a prefix-cache lookup; a prompt larger than what is
left of the budget is prefilled in chunks over several steps. A sequence samples a token
in the step that computes the last of its known tokens.

KV tiers (`tiers`, kv_tiers.py; aggregated and prefill workers): a waiting sequence's prompt continues past
its prefix-cache hit onto the blocks the tiers hold; those are loaded, not computed: they count as
cached (as vLLM counts a connector's tokens) and their load time is the step's `onboard_s`. Every full
block entered into the prefix cache is offered to the tiers (write-through).

Disaggregated decode (vLLM's WAITING_FOR_REMOTE_KVS): a sequence whose prompt KV comes from a
prefill worker gets its blocks at admission but computes nothing; it waits in `pulling` until
the caller lands its KV (`land`), then rejoins the head of the waiting queue with all of its
prompt computed but the last token, which the next step recomputes to produce logits.
Landed sequences stay ahead of every other waiting one: they need no more blocks to start.

LoRA (vLLM's rule): the running batch holds sequences of at most `lora_slots.capacity` distinct
adapters; a waiting sequence of another adapter is skipped (it keeps its place) while they are
all taken. A step's adapters are brought into the engine's active slots (an LRU); those not
there yet are the step's `lora_swaps`, which the engine charges time for.

The scheduler is synchronous and knows no time: `schedule()` plans a step, the caller
lets the step's (simulated) time pass, then `complete()` applies it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from turbine.mocker.kv_cache import BlockPool, block_hash
from turbine.mocker.kv_tiers import KvTiers
from turbine.mocker.timing import attention_pairs
from turbine.mocker.tokens import Choice, TokenSampler
from turbine.router.hashing import block_hashes as router_block_hashes
from turbine.worker.lora_slots import LoraSlots

WAITING, PULLING, RUNNING, FINISHED = "waiting", "pulling", "running", "finished"


@dataclass(eq=False)
class Sequence:
    """One choice of one request."""

    seq_id: str
    choice: Choice
    tokens: list[int]  # the prompt, then every generated token
    num_prompt_tokens: int
    max_tokens: int
    status: str = WAITING
    num_computed: int = 0  # tokens whose KV is in the cache
    blocks: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)  # chained hashes of the full blocks of `tokens`
    num_cached_blocks: int = 0  # leading blocks already offered to the prefix cache
    num_cached_tokens: int = -1  # prefix-cache hit at first admission; -1 before that
    answer_len: int | None = None  # from TokenSampler.answer_len
    num_preemptions: int = 0
    kv_to_pull: bool = False  # decode side: the prompt's KV is to be pulled from a prefill worker
    num_pull_tokens: int = 0  # tokens pulled: the prompt less what the local prefix cache had
    lora_name: str | None = None  # the LoRA adapter it runs under: its blocks are another cache
    router_hashes: list[int] = field(default_factory=list)  # with KV tiers: the router's hashes of those blocks

    @property
    def num_output_tokens(self) -> int:
        return len(self.tokens) - self.num_prompt_tokens


@dataclass
class Step:
    """One planned forward pass."""

    scheduled: list[tuple[Sequence, int]]  # (sequence, tokens computed for it in this step)
    prefill_tokens: int  # tokens of prompts (or recomputed sequences) in this step
    prefill_pairs: float  # their attention work: sum of p * (c + p/2), see timing.py
    decode_seqs: int  # sequences computing just their last sampled token
    decode_kv_tokens: int  # context length summed over those sequences
    pulls: list[Sequence] = field(default_factory=list)  # sequences that started pulling KV in this step
    lora_swaps: int = 0  # adapters this step brings into an active slot
    onboard_s: float = 0.0  # unscaled seconds of loading KV blocks from the tiers (kv_tiers.py)


@dataclass
class SeqOutput:
    seq: Sequence
    token: int
    finish_reason: str | None = None  # "stop" | "length"
    stop_reason: int | None = None  # the stop token id that ended the sequence, if any
    block_ids: list[int] | None = None  # when finished: the blocks it held (a prefill's KV, to hand over)


class Scheduler:
    def __init__(self, pool: BlockPool, sampler: TokenSampler, *, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int, lora_slots: LoraSlots | None = None,
                 tiers: KvTiers | None = None):
        self.pool = pool
        self.tiers = tiers  # None: no KV tiers
        self._onboard_s = 0.0  # the step being planned: seconds of loads from the tiers
        self.lora_slots = lora_slots  # None: LoRA off
        self.sampler = sampler
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.pulling: list[Sequence] = []  # holding blocks while their KV is in transit, oldest first

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.pulling)

    @property
    def num_queued(self) -> int:
        """Sequences queued for admission: the waiting ones less those whose pulled KV has landed (they hold
        their blocks), as the vLLM worker's load report counts (turbine/vllm/load_metrics.py)."""
        return sum(1 for seq in self.waiting if not seq.blocks)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.pulling)

    def add(self, seq: Sequence) -> None:
        seq.answer_len = self.sampler.answer_len(seq.choice)
        self._extend_hashes(seq)
        self.waiting.append(seq)

    def abort(self, seq: Sequence) -> None:
        """Drop a sequence now, freeing its blocks (a cancelled request)."""
        if seq.status == WAITING:
            self.waiting.remove(seq)
        elif seq.status == RUNNING:
            self.running.remove(seq)
        elif seq.status == PULLING:
            self.pulling.remove(seq)
        self._free(seq)  # a waiting sequence holds blocks only once its pulled KV landed
        seq.status = FINISHED

    def land(self, seqs: list[Sequence]) -> None:
        """The pulled KV of these pulling sequences has arrived: the prompt counts as computed
        except its last token (vLLM's decode side recomputes it), and they wait at the head of
        the queue for their one-token prefill."""
        for seq in seqs:
            self.pulling.remove(seq)
            seq.status = WAITING
            seq.kv_to_pull = False  # after a preemption it recomputes locally, as vLLM does
            seq.num_computed = len(seq.tokens) - 1
            # Cached only now that their contents are there (vLLM delays caching them too).
            num_full = seq.num_computed // self.pool.block_size
            if num_full > seq.num_cached_blocks:
                self.pool.cache_full_blocks(seq.blocks, seq.hashes, seq.num_cached_blocks, num_full, seq.tokens,
                                         seq.lora_name)
                seq.num_cached_blocks = num_full
        self._requeue_at_head(seqs)

    def schedule(self) -> Step:
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Sequence, int]] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(len(seq.tokens) - seq.num_computed, budget)
            while not self._allocate(seq, n):
                victim = self.running.pop()  # the newest running sequence
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status != RUNNING:
                break
            scheduled.append((seq, n))
            budget -= n
            i += 1

        # Like vLLM: no admissions in a step that had to preempt.
        pulls = []
        self._onboard_s = 0.0
        slots = self.lora_slots
        batch_loras = {s.lora_name for s in self.running if s.lora_name} if slots is not None else set()
        skipped: list[Sequence] = []  # waiting sequences of an adapter for which no slot is free
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if (slots is not None and seq.lora_name and seq.lora_name not in batch_loras
                    and len(batch_loras) >= slots.capacity):
                skipped.append(self.waiting.popleft())
                continue
            loads: list[str] = []  # the tier of each block loaded after the hits
            if seq.blocks:  # its pulled KV landed: it holds its blocks already
                hits, num_hit_tokens = [], seq.num_computed
            else:
                # A full hit still recomputes the last token: the step must produce its logits.
                loadable = (len(seq.tokens) - 1) // self.pool.block_size
                hits = self.pool.lookup(seq.hashes[:loadable])
                if self.tiers is not None and not seq.kv_to_pull:
                    loads = self.tiers.match(seq.router_hashes[len(hits):loadable])
                num_hit_tokens = (len(hits) + len(loads)) * self.pool.block_size
            if seq.kv_to_pull:
                # Blocks for the whole prompt now; the local prefix-cache hits are not pulled.
                seq.num_pull_tokens = len(seq.tokens) - num_hit_tokens
                if not self._allocate(seq, seq.num_pull_tokens, hits, cache=False):
                    break
                if seq.num_cached_tokens < 0:
                    # As vLLM reports it: the local prefix-cache hit only, not the pulled tokens.
                    seq.num_cached_tokens = num_hit_tokens
                self.waiting.popleft()
                seq.status = PULLING
                self.pulling.append(seq)
                pulls.append(seq)
                continue
            n = min(len(seq.tokens) - num_hit_tokens, budget)
            if not self._allocate(seq, n, hits, loads=loads):
                break
            self.waiting.popleft()
            seq.status = RUNNING
            self.running.append(seq)
            if seq.lora_name:
                batch_loras.add(seq.lora_name)
            if seq.num_cached_tokens < 0:
                seq.num_cached_tokens = num_hit_tokens
            scheduled.append((seq, n))
            budget -= n
        self.waiting.extendleft(reversed(skipped))  # they keep their places at the head
        lora_swaps = 0
        if slots is not None:
            step_loras = list(dict.fromkeys(seq.lora_name for seq, _ in scheduled if seq.lora_name))
            # Those already in a slot first: they become the most recent, so a swap evicts none of them.
            lora_swaps = slots.touch(sorted(step_loras, key=lambda name: name not in slots))

        prefill_tokens = decode_seqs = decode_kv_tokens = 0
        prefill_pairs = 0.0
        for seq, n in scheduled:
            if n == 1 and seq.num_output_tokens and seq.num_computed == len(seq.tokens) - 1:
                decode_seqs += 1
                decode_kv_tokens += len(seq.tokens)
            else:
                prefill_tokens += n
                prefill_pairs += attention_pairs(n, seq.num_computed)
        return Step(scheduled, prefill_tokens, prefill_pairs, decode_seqs, decode_kv_tokens, pulls, lora_swaps,
                    self._onboard_s)

    def complete(self, step: Step) -> list[SeqOutput]:
        """Apply a planned step: advance each sequence, sample, and finish those that stop.
        Sequences aborted while the step ran are skipped."""
        outputs = []
        finished = False
        for seq, n in step.scheduled:
            if seq.status != RUNNING:
                continue
            seq.num_computed += n
            if seq.num_computed < len(seq.tokens):
                continue  # a prompt chunk: no token yet
            out = self._sample(seq)
            outputs.append(out)
            if out.finish_reason is not None:
                seq.status = FINISHED
                out.block_ids = list(seq.blocks)
                self._free(seq)
                finished = True
        if finished:
            self.running = [s for s in self.running if s.status == RUNNING]
        return outputs

    # ------------------------------------------------------------------ internals

    def _sample(self, seq: Sequence) -> SeqOutput:
        token = self.sampler.token(seq.choice, seq.num_output_tokens, seq.answer_len)
        seq.tokens.append(token)
        self._extend_hashes(seq)
        # vLLM's order: length caps first, then nothing before min_tokens, then EOS, stop ids.
        out = SeqOutput(seq, token)
        if len(seq.tokens) >= self.max_model_len or seq.num_output_tokens >= seq.max_tokens:
            out.finish_reason = "length"
        elif seq.num_output_tokens < seq.choice.min_tokens:
            pass
        elif token == self.sampler.eos_token_id and not seq.choice.ignore_eos:
            out.finish_reason = "stop"
        elif token in seq.choice.stop_token_ids:
            out.finish_reason, out.stop_reason = "stop", token
        return out

    def _allocate(self, seq: Sequence, num_new: int, hits: list[int] | tuple[()] = (), cache: bool = True,
                  loads: list[str] | tuple[()] = ()) -> bool:
        """Give `seq` the blocks for `num_new` more tokens (after taking the prefix-cache `hits`
        and loading the blocks after them from the tiers `loads` names, for a sequence being
        admitted); False, changing nothing, if the pool is short. With `cache` False the new full
        blocks are not entered into the prefix cache (yet)."""
        pool, bs = self.pool, self.pool.block_size
        num_computed = seq.num_computed + (len(hits) + len(loads)) * bs
        needed = max(0, -(-(num_computed + num_new) // bs) - len(seq.blocks) - len(hits))
        # Hit blocks sitting in the LRU pool stop being available once taken.
        reclaimed = sum(1 for b in hits if pool.ref_counts[b] == 0)
        if needed + reclaimed > pool.num_available:
            return False
        if loads:
            # Before this sequence's new blocks are saved: saving may evict the tiers' least recent blocks.
            self._onboard_s += self.tiers.load(seq.router_hashes[len(hits):len(hits) + len(loads)], loads)
        if hits or loads:
            pool.acquire(hits)
            seq.blocks.extend(hits)
            seq.num_computed = num_computed
            seq.num_cached_blocks = len(hits)
        if needed:
            seq.blocks.extend(pool.allocate(needed))
        # Like vLLM, full blocks are cached when allocated, before the step computes them.
        num_full = min(num_computed + num_new, len(seq.tokens)) // bs
        if cache and num_full > seq.num_cached_blocks:
            pool.cache_full_blocks(seq.blocks, seq.hashes, seq.num_cached_blocks, num_full, seq.tokens,
                                         seq.lora_name)
            if self.tiers is not None:
                self.tiers.save(seq.router_hashes[seq.num_cached_blocks:num_full])
            seq.num_cached_blocks = num_full
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Recompute later: free everything now; the prefix cache may keep much of it."""
        self._free(seq)
        seq.status = WAITING
        seq.num_computed = 0
        seq.num_preemptions += 1
        self._requeue_at_head([seq])

    def _requeue_at_head(self, seqs: list[Sequence]) -> None:
        """Put sequences at the head of the waiting queue, in their order, but behind those whose
        pulled KV landed: these hold all their blocks and start without more, so a sequence
        queued before them that waits for blocks they hold would wait forever."""
        i = 0
        while i < len(self.waiting) and self.waiting[i].blocks:
            i += 1
        for k, seq in enumerate(seqs):
            self.waiting.insert(i + k, seq)

    def _free(self, seq: Sequence) -> None:
        self.pool.free(reversed(seq.blocks))  # suffix first: evicted before the shared prefix
        seq.blocks = []
        seq.num_cached_blocks = 0

    def _extend_hashes(self, seq: Sequence) -> None:
        bs, tokens, hashes = self.pool.block_size, seq.tokens, seq.hashes
        while (len(hashes) + 1) * bs <= len(tokens):
            start = len(hashes) * bs
            hashes.append(block_hash(hashes[-1] if hashes else None, tokens[start:start + bs], seq.lora_name))
        if self.tiers is not None and len(seq.router_hashes) < len(hashes):
            done = len(seq.router_hashes)
            seq.router_hashes += router_block_hashes(tokens[done * bs:len(hashes) * bs], bs, lora_name=seq.lora_name,
                                                     parent=seq.router_hashes[-1] if done else None)
