"""Records that workers publish in discovery and the frontend reads."""

from __future__ import annotations

import msgspec

WIRE_VERSION = 1

DISAGGREGATION_MODES = ("agg", "prefill", "decode")


def instance_path(namespace: str, component: str, endpoint: str, instance_id: str) -> str:
    """Where one instance's records live in discovery (its InstanceRecord and ModelCard alike)."""
    return f"{namespace}/{component}/{endpoint}/{instance_id}"


class InstanceRecord(msgspec.Struct, omit_defaults=True, kw_only=True):
    """One serving endpoint of one process: where to send its requests."""

    namespace: str
    component: str
    endpoint: str
    instance_id: str  # hex, unique per process
    address: str  # "host:port" of the request-plane server
    pid: int = 0
    hostname: str = ""
    v: int = WIRE_VERSION

    @property
    def path(self) -> str:
        return instance_path(self.namespace, self.component, self.endpoint, self.instance_id)


class ModelCard(msgspec.Struct, omit_defaults=True, kw_only=True):
    """What a frontend needs to serve a model that this worker instance generates for."""

    name: str  # served model name
    namespace: str
    component: str
    endpoint: str
    instance_id: str
    engine: str = "vllm"  # "vllm" | "mocker"
    # Local folder holding tokenizer.json / tokenizer_config.json (the model folder); unused
    # when model_input is "text".
    tokenizer_path: str
    chat_template_path: str | None = None  # --custom-jinja-template
    context_length: int
    kv_block_size: int
    total_kv_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    # "tokens": the frontend tokenizes and detokenizes; "text" (--use-vllm-tokenizer): the worker
    # takes text and returns text (GenerateRequest.text), the frontend loads no tokenizer.
    model_input: str = "tokens"
    endpoint_types: list[str] = msgspec.field(default_factory=lambda: ["chat", "completions"])
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    migration_limit: int = 0
    # Where this instance publishes its KV cache events ("tcp://host:port"); None: it doesn't.
    kv_events_address: str | None = None
    # Where this instance publishes its load reports (every worker does, whatever its role or
    # prefix caching); the same address as kv_events_address when it has one.
    load_metrics_address: str | None = None
    # "agg" serves whole requests; "prefill" computes prompts' KV for decode workers to pull;
    # "decode" generates, pulling the KV that a prefill worker computed.
    disaggregation_mode: str = "agg"
    # Engines (data-parallel ranks) behind this instance; a request's dp_rank picks one.
    data_parallel_size: int = 1
    # Whether it takes GenerateRequest.prompt_embeds (the vLLM worker's --enable-prompt-embeds).
    accepts_prompt_embeds: bool = False
    # Whether it takes images (GenerateRequest.images): the vLLM worker's --enable-multimodal.
    multimodal: bool = False
    # The token id the chat template writes for each image (the model config's), which the engine widens to
    # the image's tokens; None: not known. The frontend checks a prompt's count of it and keys routing on it.
    image_token_id: int | None = None
    # The token ids the engine widens each image token to, when they are the same for every image (measured by the
    # worker at start, e.g. Idefics3 without tiling), and where the image's placeholder range (offset, length)
    # lies within them; None: unknown or size-dependent. The frontend hashes an image prompt as the engine will
    # hold it (block hashes as in the worker's KV events) and checks max_tokens against the widened prompt.
    image_placeholder: list[int] | None = None
    image_placeholder_range: tuple[int, int] | None = None
    # The id of the shared KV tier this instance reads and writes (--kv-shared-cache-dir; the id is kept in
    # that directory, so every worker that sees it announces the same one); a KV router counts that tier's
    # blocks for every instance announcing it. None: no shared tier.
    kv_shared_tier: str | None = None
    # The address its engine's other nodes joined (host:port of the data-parallel RPC, or of torch.distributed's
    # master for parallelism across nodes); None: one node. Its --headless nodes watch for this card and stop
    # when it is gone (turbine/vllm/headless.py).
    node_group: str | None = None
    # Whether its engine loads image embeddings that encode workers made (GenerateRequest.image_embeddings):
    # the vLLM worker's --take-image-embeddings. An encode worker's own card has endpoint_types ["image_encode"].
    takes_image_embeddings: bool = False
    # The instance is asleep (/engine/sleep): its instance records are withdrawn, so nothing routes to it,
    # and its card stays with this set, so that frontends answer a model whose every worker sleeps with a
    # 503 to retry (not a 404: the model exists). Put back without it on wake-up.
    sleeping: bool = False
    # What the instance answers with (an omni worker's pipeline: its final stages' output types, "text" and/or
    # "image"); None: text only, as every other worker. The frontend sends image requests only to instances
    # whose card says "image".
    output_modalities: list[str] | None = None
    # A LoRA adapter's card (None: the base model's): `name` is then the adapter's name, which is
    # also `lora_name`, and `base_model` the served name of the model it adapts (its `parent`);
    # the rest is the base card's (tokenizer, parsers, limits). One per adapter loaded on the
    # instance, under the instance's path (see `key`).
    lora_name: str | None = None
    lora_id: int | None = None
    base_model: str | None = None
    v: int = WIRE_VERSION

    @property
    def modalities(self) -> list[str]:
        return self.output_modalities if self.output_modalities is not None else ["text"]

    @property
    def path(self) -> str:
        """The path of the instance this card belongs to."""
        return instance_path(self.namespace, self.component, self.endpoint, self.instance_id)

    @property
    def key(self) -> str:
        """Where the card lives in discovery: the instance's path for its base card, below it
        for an adapter's (so an instance may publish several, and each goes with it)."""
        if self.lora_name is None:
            return self.path
        return f"{self.path}/{LORA_KEY}/{self.lora_name}"


LORA_KEY = "lora"


# The output parsers a card may name (tool_call_parser, reasoning_parser); the frontend's
# parser registry (turbine/frontend/parsers) implements exactly these, a test keeps them in step.
TOOL_CALL_PARSER_NAMES = ("harmony", "hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder")
REASONING_PARSER_NAMES = ("deepseek_r1", "harmony", "qwen3")
