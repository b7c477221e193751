"""The omni worker (`--omni --stage-configs-path FILE`): a vLLM-Omni multi-stage pipeline (`AsyncOmni`, e.g.
text→text or text→image) as the worker host's engine kind, behind the same `generate` endpoint as the vLLM worker.

The pipeline is served in text mode (its card says `model_input: "text"`): the frontend sends the chat's messages
or the completion's prompt (GenerateRequest.text), rendered here into an `OmniTextPrompt`; text outputs go back
as deltas with the usage on the choice's last chunk, image outputs as PNG files (GenerateOutput.images). The card
says its output modalities (the final stages' output types), so image requests reach only image pipelines.

vLLM-Omni is imported only when the worker is built (`parse_worker_args` has already refused `--omni` where it
cannot run, with the reason), so `turbine.vllm` imports on builds without it."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import logging
import re
import uuid
from collections.abc import AsyncIterator

from turbine.model.prepare import tokenizer_folder
from turbine.protocol import errors as codes
from turbine.protocol.generate import ClearKvBlocksRequest, GenerateOutput, GenerateRequest, StatusReply, Usage
from turbine.runtime.errors import InvalidRequest, RequestFailed
from turbine.runtime.registration import CLEAR_KV_BLOCKS
from turbine.runtime.status_server import Health
from turbine.worker import health_check
from turbine.worker.events import InstanceEvents
from turbine.worker.host import Instance
from turbine.worker.worker_metrics import WorkerMetrics

log = logging.getLogger("turbine.vllm")

ENGINE_CHECK_INTERVAL_S = 2.0
CANARY_TIMEOUT_S = 60.0  # a diffusion stage's steps take longer than one token


def render_prompt(text, tokenizer) -> str:
    """The request's text as the pipeline's prompt: a completion's prompt as given; a chat's messages through the
    tokenizer's chat template when it has one, else the user messages' text joined (a pipeline whose first stage
    is a diffusion model, which takes a plain prompt). InvalidRequest when there is nothing to say."""
    if text.prompt is not None:
        return text.prompt
    messages = text.messages or []
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=text.add_generation_prompt,
                                             **(text.chat_template_kwargs or {}))
    said = [_message_text(m) for m in messages if m.get("role") == "user"]
    if not any(said):
        raise InvalidRequest("messages: no user message with text (the pipeline's prompt)")
    return "\n".join(s for s in said if s)


def _message_text(message: dict) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return ""


def png_bytes(image) -> bytes:
    """An output image (PIL, or a numpy array: pil_image) as a PNG file."""
    buf = io.BytesIO()
    pil_image(image).save(buf, format="PNG")
    return buf.getvalue()


def pil_image(image):
    """A PIL image of a pipeline's output image: PIL already, or a numpy array (HWC; a leading batch axis taken
    off; floats in [0, 1], or [-1, 1] when any is negative; integers as 0-255), as some of vLLM-Omni's diffusion
    pipelines return them."""
    from PIL import Image

    if isinstance(image, Image.Image):
        return image
    arr = image  # a numpy array: its own methods (numpy is theirs to bring, not imported here)
    while arr.ndim > 3:
        arr = arr[0]
    if arr.dtype.kind == "f":
        if arr.min() < 0:
            arr = arr.clip(-1.0, 1.0) * 0.5 + 0.5
        arr = (arr.clip(0.0, 1.0) * 255).round()
    arr = arr.clip(0, 255).astype("uint8")
    if arr.ndim == 3 and arr.shape[-1] == 1:
        arr = arr[..., 0]
    return Image.fromarray(arr)


def output_images(out) -> list:
    """The images of an output: its own (a diffusion stage's), or those of the stage output it wraps; a nested
    list (a layered model's) flattened one level, as vLLM-Omni's own server does."""
    images = list(getattr(out, "images", None) or [])
    if not images:
        images = list(getattr(getattr(out, "request_output", None), "images", None) or [])
    flat = []
    for image in images:
        flat.extend(image if isinstance(image, list) else [image])
    return flat


_STAGE_GEN_MS = re.compile(r"stage_(\d+)_gen_ms")


def stage_seconds(out) -> dict[str, float]:
    """Each stage's generation time of a finished request, by stage id: vLLM-Omni's `stage_durations` of the final
    output (milliseconds, keyed `stage_<id>_gen_ms`)."""
    found = {}
    for key, value in (getattr(out, "stage_durations", None) or {}).items():
        match = _STAGE_GEN_MS.fullmatch(str(key))
        if match and isinstance(value, (int, float)):
            found[match.group(1)] = value / 1000.0
    return found


class OmniHandlers:
    """`generate` on an AsyncOmni pipeline: one request through every stage; cancellation aborts it in every
    stage (AsyncOmni.abort by the request's id), as the vLLM worker's handlers abort theirs."""

    def __init__(self, omni, metrics: WorkerMetrics, stage_types: list[str], modalities: list[str], tokenizer,
                 on_success=None):
        self.omni = omni
        self.metrics = metrics
        self.stage_types = stage_types  # "llm" | "diffusion", per stage
        self.modalities = modalities
        self.tokenizer = tokenizer
        self.on_success = on_success

    def prompt(self, req: GenerateRequest) -> dict:
        """The OmniTextPrompt (a TypedDict: a plain dict) or the token prompt of the request."""
        if req.images or req.prompt_embeds is not None or req.image_embeddings:
            raise InvalidRequest("an omni pipeline takes text only (no images, prompt embeddings)")
        if req.text is not None:
            prompt = {"prompt": render_prompt(req.text, self.tokenizer)}
        elif not req.token_ids:
            raise InvalidRequest("the request has neither text nor token ids")
        else:
            prompt = {"prompt_token_ids": list(req.token_ids)}
        if req.image is not None:
            # As vLLM-Omni's own image server asks: pipelines that can answer in several modalities (BAGEL,
            # Cosmos3, ...) pick text-to-image from the prompt's modalities.
            prompt["modalities"] = ["image"]
        return prompt

    def sampling_params_list(self, req: GenerateRequest) -> list:
        """One sampling-params object per stage: the pipeline's defaults, the request's sampling on its LLM
        stages (delta outputs, as streamed) and its image size, count and seed on its diffusion stages."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = []
        for kind, default in zip(self.stage_types, self.omni.default_sampling_params_list):
            if kind == "llm":
                s = req.sampling
                fields = {k: v for k, v in (
                    ("temperature", s.temperature), ("top_p", s.top_p), ("top_k", s.top_k), ("min_p", s.min_p),
                    ("seed", s.seed), ("presence_penalty", s.presence_penalty),
                    ("frequency_penalty", s.frequency_penalty), ("repetition_penalty", s.repetition_penalty),
                    ("max_tokens", req.stop.max_tokens), ("min_tokens", req.stop.min_tokens),
                    ("stop_token_ids", req.stop.stop_token_ids)) if v is not None}
                if req.text is not None and req.text.stop:
                    fields["stop"] = list(req.text.stop)
                if req.image is None and s.n != 1:
                    fields["n"] = s.n
                base = default if isinstance(default, SamplingParams) else SamplingParams()
                p = base.clone()
                for k, v in fields.items():
                    setattr(p, k, v)
                p.output_kind = RequestOutputKind.DELTA
                # Its own checks and derived fields again (greedy at temperature 0, the stop strings' buffer).
                p.__post_init__()
                params.append(p)
            else:
                changes = {}
                if req.image is not None:
                    changes = {k: v for k, v in (("width", req.image.width), ("height", req.image.height))
                               if v is not None}
                    changes["num_outputs_per_prompt"] = req.sampling.n
                if req.sampling.seed is not None:
                    changes["seed"] = req.sampling.seed
                if default is None:  # as vllm-omni builds a diffusion stage's defaults
                    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

                    default = OmniDiffusionSamplingParams()
                params.append(dataclasses.replace(default, **changes) if changes else default)
        return params

    async def generate(self, req: GenerateRequest, ctx) -> AsyncIterator[GenerateOutput]:
        try:
            if req.image is not None and "image" not in self.modalities:
                raise InvalidRequest("image: this pipeline answers with " + " and ".join(self.modalities))
            if req.image is None and "text" not in self.modalities:
                raise InvalidRequest("image: this pipeline answers with images only; the request asks for text")
            prompt = self.prompt(req)
            params = self.sampling_params_list(req)
        except InvalidRequest:
            self.metrics.error("invalid_request")
            raise
        omni_id = f"{req.request_id}-{uuid.uuid4().hex[:8]}"  # unique per attempt, as the vLLM worker's
        # A pipeline with text and image outputs answers a text request with its text only.
        wanted = ["image"] if req.image is not None else ["text"] if "image" in self.modalities else None
        completion = {}
        prompt_len = len(req.token_ids)
        finished = False
        self.metrics.inflight.inc()
        try:
            async for out in self.omni.generate(prompt, request_id=omni_id, sampling_params_list=params,
                                                output_modalities=wanted):
                if getattr(out, "error", None):
                    raise RequestFailed(f"the pipeline failed: {out.error}", code=codes.ENGINE_FAILURE)
                kind = getattr(out, "final_output_type", "text")
                if kind == "image":
                    if out.finished:  # the images of the finished request only: nothing to encode before
                        pngs = await asyncio.to_thread(lambda imgs=output_images(out): [png_bytes(i) for i in imgs])
                        self._observe_stages(out)
                        yield GenerateOutput(token_ids=[], images=pngs, finish_reason="stop",
                                             usage=Usage(prompt_tokens=prompt_len, completion_tokens=0))
                    finished = out.finished
                    continue
                if out.prompt_token_ids:
                    prompt_len = len(out.prompt_token_ids)
                for comp in out.outputs:
                    completion[comp.index] = completion.get(comp.index, 0) + len(comp.token_ids)
                    chunk = GenerateOutput(token_ids=list(comp.token_ids), index=comp.index, text=comp.text or "")
                    if comp.finish_reason is not None:
                        if comp.finish_reason in ("abort", "error"):
                            self.metrics.error("engine_failure")
                            raise RequestFailed(f"the pipeline ended the request ({comp.finish_reason})",
                                                code=codes.ENGINE_FAILURE)
                        chunk.finish_reason = comp.finish_reason
                        chunk.usage = Usage(prompt_tokens=prompt_len, completion_tokens=completion[comp.index],
                                            cached_tokens=out.num_cached_tokens or 0)
                    yield chunk
                finished = out.finished
                if finished:
                    self._observe_stages(out)
            self.metrics.request_done("success")
            if self.on_success is not None:
                self.on_success()
        except RequestFailed:
            raise
        except ValueError as exc:  # vLLM-Omni's and vLLM's input checks
            self.metrics.error("invalid_request")
            raise InvalidRequest(str(exc)) from exc
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.metrics.error("engine_failure")
            raise RequestFailed(f"the pipeline failed: {type(exc).__name__}: {exc}", code=codes.ENGINE_FAILURE) \
                from exc
        finally:
            self.metrics.inflight.dec()
            if not finished:
                # The caller cancelled or went away: every stage drops the request now.
                self.metrics.cancellations.inc()
                await self.omni.abort(omni_id)

    def _observe_stages(self, out) -> None:
        for stage, seconds in stage_seconds(out).items():
            self.metrics.omni_stage(stage, seconds)

    async def canary(self, req: GenerateRequest) -> None:
        """The health check's request through the pipeline, not counted as served."""
        omni_id = f"{req.request_id}-{uuid.uuid4().hex[:8]}"
        finished = False
        try:
            async for out in self.omni.generate(self.prompt(req), request_id=omni_id,
                                                sampling_params_list=self.sampling_params_list(req)):
                if getattr(out, "error", None):
                    raise RequestFailed(f"the pipeline failed: {out.error}", code=codes.ENGINE_FAILURE)
                finished = out.finished
        finally:
            if not finished:
                await self.omni.abort(omni_id)

    async def clear_kv_blocks(self, req: ClearKvBlocksRequest, ctx) -> AsyncIterator[StatusReply]:
        try:
            ok = await self.omni.reset_prefix_cache()
        except Exception as exc:
            yield StatusReply(status="error", message=f"{type(exc).__name__}: {exc}")
            return
        yield StatusReply(status="success" if ok else "error",
                          message="KV cache cleared" if ok else "prefix cache not reset")


class OmniEngine:
    """The omni pipeline as an engine kind for the worker host: one instance."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.instance_id = uuid.uuid4().hex[:16]
        self.metrics = WorkerMetrics({"namespace": cfg.namespace, "component": cfg.component,
                                      "model": cfg.served_model_name, "worker_id": self.instance_id})
        self.omni = None
        self.events: InstanceEvents | None = None
        self._handlers: OmniHandlers | None = None
        self._server = None

    async def build(self, *, checkpoint: bool) -> None:
        """Nothing: start() builds the pipeline."""

    def checkpoint_refusal(self) -> str | None:
        return "the omni worker cannot be checkpointed: its pipeline's stages run in processes of their own"

    async def quiesce(self) -> None:
        raise NotImplementedError(self.checkpoint_refusal())

    async def resume(self) -> None:
        raise NotImplementedError(self.checkpoint_refusal())

    def restore_identity(self, identity) -> None:
        raise NotImplementedError(self.checkpoint_refusal())

    async def start(self, plane, health: Health) -> list[Instance]:
        from vllm_omni.entrypoints.async_omni import AsyncOmni

        cfg = self.cfg
        self.events = InstanceEvents(plane, self.instance_id, kv_events=False, kv_events_buffer=cfg.kv_events_buffer)
        omni = self.omni = AsyncOmni(model=cfg.model_path, stage_configs_path=cfg.stage_configs_path)
        metas = [omni.engine.get_stage_metadata(i) for i in range(omni.num_stages)]
        stage_types = [getattr(m, "stage_type", "llm") for m in metas]
        modalities = list(dict.fromkeys(m.final_output_type for m in metas
                                        if getattr(m, "final_output", False) and m.final_output_type))
        served = [m for m in modalities if m in ("text", "image")]
        if served != modalities or not served:
            raise RuntimeError(f"--stage-configs-path {cfg.stage_configs_path}: the pipeline's outputs are "
                               f"{modalities or 'none'}; Turbine serves text and image outputs")
        tokenizer = None
        if "llm" in stage_types:
            tokenizer = await omni.get_tokenizer()
        self._handlers = OmniHandlers(omni, self.metrics, stage_types, served, tokenizer, on_success=health.succeeded)
        server = cfg.request_plane_config.server(cfg.host, cfg.port)
        server.register(cfg.endpoint, GenerateRequest, self._handlers.generate)
        server.register(CLEAR_KV_BLOCKS, ClearKvBlocksRequest, self._handlers.clear_kv_blocks)
        self._server = server
        vcfg = omni.vllm_config  # the comprehension (LLM) stage's; None for a diffusion-only pipeline
        card = cfg.model_card(
            self.instance_id, engine="vllm-omni", tokenizer_path=tokenizer_folder(cfg.model_path),
            context_length=vcfg.model_config.max_model_len if vcfg is not None else 0,
            kv_block_size=vcfg.cache_config.block_size if vcfg is not None else 16,
            total_kv_blocks=(vcfg.cache_config.num_gpu_blocks or 0) if vcfg is not None else 0,
            max_num_seqs=vcfg.scheduler_config.max_num_seqs if vcfg is not None else 1,
            max_num_batched_tokens=vcfg.scheduler_config.max_num_batched_tokens if vcfg is not None else 0,
            model_input="text", output_modalities=served, **self.events.card_fields())
        return [Instance(server, card, metrics=self.metrics)]

    async def canary(self) -> str | None:
        # The default payload: one greedy token after the BOS of AsyncOmni's own tokenizer (its LLM stage's).
        bos = health_check.bos_token_id(self._handlers.tokenizer) if self._handlers.tokenizer is not None \
            else health_check.DEFAULT_BOS
        try:
            req = health_check.generate_request(self.cfg.health_check_payload, bos=bos,
                                                text_mode=self._handlers.tokenizer is None)
            async with asyncio.timeout(CANARY_TIMEOUT_S):
                await self._handlers.canary(req)
        except TimeoutError:
            return f"canary generate did not finish in {CANARY_TIMEOUT_S:.0f}s"
        except Exception as exc:
            return f"canary generate failed: {type(exc).__name__}: {exc}"
        return None

    def failure(self) -> str | None:
        return "a pipeline stage is dead" if self.omni is not None and self.omni.errored else None

    async def died(self) -> str:
        while True:
            await asyncio.sleep(ENGINE_CHECK_INTERVAL_S)
            try:
                await self.omni.check_health()
            except Exception as exc:
                return f"vLLM-Omni pipeline: {type(exc).__name__}: {exc}"

    def refresh_gauges(self) -> None:
        """No per-stage gauges yet."""

    def serving(self) -> None:
        log.info("omni worker %s serving %r (%s) at %s", self.instance_id, self.cfg.served_model_name,
                 " + ".join(self._handlers.modalities), self._server.address)

    async def close(self) -> None:
        if self.omni is not None:
            self.omni.shutdown()  # every stage's process, and the orchestrator
        if self.events is not None:
            self.events.close()
