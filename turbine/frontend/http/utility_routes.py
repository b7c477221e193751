"""vLLM's utility endpoints, in vLLM's shapes: `POST /tokenize` (a prompt, or chat messages
through the model's template -> token ids), `POST /detokenize` (token ids -> text) and
`GET /version`. They use the frontend's own tokenizer (no worker is asked); the API key
applies as on /v1/models."""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from turbine.frontend.errors import RequestError
from turbine.frontend.preprocess.schemas import decode_request
from turbine.frontend.preprocess.text_mode import refuse_in_text_mode

try:
    VERSION = importlib.metadata.version("turbine")
except importlib.metadata.PackageNotFoundError:  # run from a source tree that is not installed
    VERSION = "unknown"


class TokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    prompt: str | None = None  # either this ...
    messages: list[dict[str, Any]] | None = None  # ... or a conversation, rendered by the chat template
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (the template has them)
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    tokens: list[int]


class UtilityRoutes:
    def __init__(self, frontend, auth: Callable[[Request], JSONResponse | None]):
        self.frontend = frontend
        self.auth = auth

    def routes(self) -> list[Route]:
        return [Route("/tokenize", self.tokenize, methods=["POST"]),
                Route("/detokenize", self.detokenize, methods=["POST"]),
                Route("/version", self.version, methods=["GET"])]

    async def version(self, request: Request):
        return JSONResponse({"version": VERSION})

    async def tokenize(self, request: Request):
        return await self._answer(request, TokenizeRequest, self._tokenize)

    async def detokenize(self, request: Request):
        return await self._answer(request, DetokenizeRequest, self._detokenize)

    async def _answer(self, request: Request, kind, handler):
        if (denied := self.auth(request)) is not None:
            return denied
        try:
            body = await request.body()
            limit = self.frontend.cfg.max_request_bytes
            if len(body) > limit:
                raise RequestError(f"request body exceeds the limit of {limit} bytes", status=413)
            return JSONResponse(await handler(decode_request(body, kind)))
        except RequestError as exc:
            return JSONResponse(exc.body(), status_code=exc.status)

    def _model(self, name: str | None):
        models = self.frontend.models.models
        if name is None:
            if len(models) != 1:
                raise RequestError("model is required when the server serves more than one model", param="model")
            name = next(iter(models))
        model = models.get(name)
        if model is None:
            raise RequestError(f"the model {name!r} does not exist", param="model", status=404,
                               code="model_not_found")
        if model.tokenizer is None:
            raise refuse_in_text_mode(model.name, "tokenizing", param="model")
        return model

    async def _tokenize(self, req: TokenizeRequest) -> dict:
        if (req.prompt is None) == (req.messages is None):
            raise RequestError("give exactly one of prompt and messages", param="prompt")
        model = self._model(req.model)
        tok = model.tokenizer
        if req.messages is not None:
            if not req.messages:
                raise RequestError("messages: must contain at least one message", param="messages")
            try:
                text = tok.apply_chat_template(req.messages, add_generation_prompt=req.add_generation_prompt,
                                               tools=req.tools, **(req.chat_template_kwargs or {}))
            except ValueError as exc:
                raise RequestError(f"cannot apply the chat template: {exc}", param="messages") from None
            special = bool(req.add_special_tokens)
        else:
            text = req.prompt
            special = req.add_special_tokens is not False
        tokens = await tok.encode_off_loop(text, add_special_tokens=special)
        out = {"count": len(tokens), "max_model_len": model.card.context_length, "tokens": tokens,
               "token_strs": [tok.id_to_token(t) for t in tokens] if req.return_token_strs else None}
        return out

    async def _detokenize(self, req: DetokenizeRequest) -> dict:
        model = self._model(req.model)
        tok = model.tokenizer
        bad = [t for t in req.tokens if not 0 <= t < tok.vocab_size]
        if bad:
            raise RequestError(f"tokens: {bad[0]} is not a token id of the model (0..{tok.vocab_size - 1})",
                               param="tokens")
        return {"prompt": tok.decode(req.tokens, skip_special_tokens=False)}
