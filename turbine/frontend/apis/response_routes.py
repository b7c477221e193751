"""The stored-response routes beside `POST /v1/responses`: `GET` / `DELETE /v1/responses/{id}`,
`GET /v1/responses/{id}/input_items`, `POST /v1/responses/{id}/cancel`, the Conversations API
(`/v1/conversations`, its items), and the background runs (`background: true`) this frontend
process holds.

A background run is a task of the process that took the request: its record is saved `queued`
at once, and `completed` / `incomplete` / `failed` / `cancelled` when it ends. A cancel reaching
another frontend process marks the record (`cancel_requested`), which the run's process reads
every CANCEL_POLL_S."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Any

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from turbine.frontend.apis.responses import ResponsesRun, _check_metadata, messages_of
from turbine.frontend.apis.state_store import StoreUnavailable
from turbine.frontend.apis.stored_responses import Records, StoredResponse, not_found, with_ids
from turbine.frontend.errors import RequestError
from turbine.frontend.preprocess.schemas import json_object

if TYPE_CHECKING:
    from collections.abc import Callable

log = logging.getLogger("turbine.frontend")
_json = msgspec.json.Encoder()

CANCEL_POLL_S = 1.0
MAX_LIST_LIMIT = 100


class BackgroundRuns:
    """The background responses this process is generating, by id."""

    def __init__(self):
        self.tasks: dict[str, asyncio.Task] = {}
        self.runs: dict[str, ResponsesRun] = {}
        self.closing = False

    async def start(self, run: ResponsesRun) -> dict[str, Any]:
        """Saves the queued response and starts generating it; returns the queued response object."""
        queued = run.builder.response("queued")
        await run.persist(queued)
        self.runs[run.id] = run
        self.tasks[run.id] = asyncio.create_task(self._run(run), name=f"background {run.id}")
        return queued

    async def _run(self, run: ResponsesRun) -> None:
        watcher = asyncio.create_task(self._watch_cancel(run))
        try:
            final = await run.collect()
        except asyncio.CancelledError:
            final = run.builder.response("cancelled")
        except RequestError as exc:
            final = run.builder.response("failed", error={"code": "server_error" if exc.status >= 500
                                                          else "invalid_prompt", "message": exc.message})
        finally:
            watcher.cancel()
            self.tasks.pop(run.id, None)
            self.runs.pop(run.id, None)
            await run.deltas.aclose()  # a cancelled run's worker request is cancelled too
        for _ in range(1 if self.closing else 30):  # the store may be briefly down: the result is kept a while
            try:
                await run.persist(final)
                return
            except StoreUnavailable as exc:
                log.warning("background response %s: cannot save (%s); retrying", run.id, exc)
                await asyncio.sleep(1.0)
            except Exception:  # noqa: BLE001
                log.exception("background response %s: cannot save", run.id)
                return

    async def _watch_cancel(self, run: ResponsesRun) -> None:
        task = asyncio.current_task()
        records, owner = run.state.records, run.state.owner
        while True:
            await asyncio.sleep(CANCEL_POLL_S)
            with contextlib.suppress(RequestError):
                if (await records.response(run.id, owner)).cancel_requested:
                    runner = self.tasks.get(run.id)
                    if runner is not None and runner is not task:
                        runner.cancel()
                    return

    def cancel_here(self, id_: str) -> asyncio.Task | None:
        task = self.tasks.get(id_)
        if task is not None:
            task.cancel()
        return task

    async def cancel(self, id_: str) -> bool:
        """Cancels a run of this process and waits until its cancelled record is saved; False when
        the run is not here."""
        task, run = self.tasks.get(id_), self.runs.get(id_)
        if task is None or run is None:
            return False
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(task), 10)
        if task.cancelled():  # cancelled before it started: nothing saved its end
            self.tasks.pop(id_, None)
            await run.persist(run.builder.response("cancelled"))
        return True

    async def close(self) -> None:
        self.closing = True
        for task in list(self.tasks.values()):
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)


def _page(items: list[dict[str, Any]], request: Request, default_order: str) -> dict[str, Any]:
    """OpenAI's list shape over `items` (oldest first), by the query's limit / order / after."""
    q = request.query_params
    try:
        limit = int(q.get("limit", 20))
    except ValueError:
        raise RequestError("limit must be an integer", param="limit") from None
    if not 1 <= limit <= MAX_LIST_LIMIT:
        raise RequestError(f"limit must be between 1 and {MAX_LIST_LIMIT}", param="limit")
    order = q.get("order", default_order)
    if order not in ("asc", "desc"):
        raise RequestError("order must be asc or desc", param="order")
    for name in q:
        if name not in ("limit", "order", "after", "include"):
            raise RequestError(f"{name}: is not supported", param=name)
    for value in q.getlist("include"):
        raise RequestError(f"include: {value!r} is not supported on lists here", param="include")
    ordered = list(items) if order == "asc" else list(reversed(items))
    after = q.get("after")
    if after is not None:
        ids = [item.get("id") for item in ordered]
        if after not in ids:
            raise not_found("item", after, "after")
        ordered = ordered[ids.index(after) + 1:]
    page = ordered[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(ordered) > limit}


def _checked_items(items: Any, param: str = "items") -> list[dict[str, Any]]:
    """Conversation items as a client sends them, checked as Responses input would be."""
    if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
        raise RequestError(f"{param}: must be a list of items", param=param)
    if items:
        try:
            messages_of(items, None)
        except RequestError as exc:
            exc.message = exc.message.replace("input", param, 1)
            exc.param = (exc.param or "").replace("input", param, 1) or param
            raise
    if len(items) > 1000:
        raise RequestError(f"{param}: at most 1000 items at once", param=param)
    return with_ids(items)


def _conversation_json(conv) -> dict[str, Any]:
    return {"id": conv.id, "object": "conversation", "created_at": conv.created_at, "metadata": conv.metadata}


class ResponseRoutes:
    """The routes, for a frontend whose store is `records` (None: off, every route a 400)."""

    def __init__(self, records: Records | None, background: BackgroundRuns, auth: Callable, owner: Callable):
        self.records, self.background, self._auth, self._owner = records, background, auth, owner

    def routes(self) -> list[Route]:
        return [
            Route("/v1/responses/{response_id}", self.get_response, methods=["GET"]),
            Route("/v1/responses/{response_id}", self.delete_response, methods=["DELETE"]),
            Route("/v1/responses/{response_id}/input_items", self.input_items, methods=["GET"]),
            Route("/v1/responses/{response_id}/cancel", self.cancel, methods=["POST"]),
            Route("/v1/conversations", self.create_conversation, methods=["POST"]),
            Route("/v1/conversations/{conversation_id}", self.get_conversation, methods=["GET"]),
            Route("/v1/conversations/{conversation_id}", self.update_conversation, methods=["POST"]),
            Route("/v1/conversations/{conversation_id}", self.delete_conversation, methods=["DELETE"]),
            Route("/v1/conversations/{conversation_id}/items", self.list_items, methods=["GET"]),
            Route("/v1/conversations/{conversation_id}/items", self.add_items, methods=["POST"]),
            Route("/v1/conversations/{conversation_id}/items/{item_id}", self.get_item, methods=["GET"]),
            Route("/v1/conversations/{conversation_id}/items/{item_id}", self.delete_item, methods=["DELETE"]),
        ]

    async def _serve(self, request: Request, handler) -> Response:
        if (denied := self._auth(request)) is not None:
            return denied
        try:
            if self.records is None:
                raise RequestError("this frontend keeps no responses or conversations (--response-store off)",
                                   status=404, code="not_found")
            return JSONResponse(await handler(self.records, self._owner(request)))
        except RequestError as exc:
            return JSONResponse(exc.body(), status_code=exc.status)

    # -- responses --
    async def get_response(self, request: Request):
        id_ = request.path_params["response_id"]
        for name, value in request.query_params.items():
            if name == "stream" and value.lower() in ("true", "1"):
                return await self._serve(request, _raise(RequestError(
                    "stream: streaming a stored response is not supported; GET it whole", param="stream")))
            if name not in ("stream", "include", "include_obfuscation", "starting_after"):
                return await self._serve(request, _raise(RequestError(f"{name}: is not supported", param=name)))

        async def get(records: Records, owner: str):
            return (await records.response(id_, owner)).response

        return await self._serve(request, get)

    async def delete_response(self, request: Request):
        id_ = request.path_params["response_id"]

        async def delete(records: Records, owner: str):
            self.background.cancel_here(id_)
            await records.delete_response(id_, owner)
            return {"id": id_, "object": "response", "deleted": True}

        return await self._serve(request, delete)

    async def input_items(self, request: Request):
        id_ = request.path_params["response_id"]

        async def items(records: Records, owner: str):
            return _page((await records.response(id_, owner)).input_items, request, "desc")

        return await self._serve(request, items)

    async def cancel(self, request: Request):
        id_ = request.path_params["response_id"]

        async def cancel(records: Records, owner: str):
            record = await records.response(id_, owner)
            if not record.response.get("background"):
                raise RequestError(f"response {id_!r} was not created with background: true; only background "
                                   "responses can be cancelled", param="response_id")
            if record.response.get("status") not in ("queued", "in_progress"):
                return record.response  # already ended: as OpenAI, the response as it is
            if not await self.background.cancel(id_):  # running on another frontend process: it reads the mark
                await records.request_cancel(id_, owner)
                for _ in range(int(10 / 0.2)):
                    await asyncio.sleep(0.2)
                    record = await records.response(id_, owner)
                    if record.response.get("status") not in ("queued", "in_progress"):
                        break
            return (await records.response(id_, owner)).response

        return await self._serve(request, cancel)

    # -- conversations --
    async def create_conversation(self, request: Request):
        body = await request.body()

        async def create(records: Records, owner: str):
            raw = json_object(body) if body else {}
            for name in raw:
                if name not in ("items", "metadata"):
                    raise RequestError(f"{name}: is not supported", param=name)
            metadata = raw.get("metadata")
            _check_metadata_value(metadata)
            conv = await records.create_conversation(owner, _checked_items(raw.get("items") or []), metadata)
            return _conversation_json(conv)

        return await self._serve(request, create)

    async def get_conversation(self, request: Request):
        id_ = request.path_params["conversation_id"]

        async def get(records: Records, owner: str):
            return _conversation_json(await records.conversation(id_, owner))

        return await self._serve(request, get)

    async def update_conversation(self, request: Request):
        id_ = request.path_params["conversation_id"]
        body = await request.body()

        async def update(records: Records, owner: str):
            raw = json_object(body)
            for name in raw:
                if name != "metadata":
                    raise RequestError(f"{name}: is not supported (a conversation's metadata can change)",
                                       param=name)
            metadata = raw.get("metadata")
            _check_metadata_value(metadata)

            def change(conv):
                conv.metadata = metadata or {}

            return _conversation_json(await records.change_conversation(id_, owner, change))

        return await self._serve(request, update)

    async def delete_conversation(self, request: Request):
        id_ = request.path_params["conversation_id"]

        async def delete(records: Records, owner: str):
            await records.delete_conversation(id_, owner)
            return {"id": id_, "object": "conversation.deleted", "deleted": True}

        return await self._serve(request, delete)

    async def list_items(self, request: Request):
        id_ = request.path_params["conversation_id"]

        async def items(records: Records, owner: str):
            return _page((await records.conversation(id_, owner)).items, request, "desc")

        return await self._serve(request, items)

    async def add_items(self, request: Request):
        id_ = request.path_params["conversation_id"]
        body = await request.body()

        async def add(records: Records, owner: str):
            raw = json_object(body)
            for name in raw:
                if name != "items":
                    raise RequestError(f"{name}: is not supported", param=name)
            added = _checked_items(raw.get("items"))
            await records.change_conversation(id_, owner, lambda conv: conv.items.extend(added))
            return {"object": "list", "data": added, "first_id": added[0]["id"] if added else None,
                    "last_id": added[-1]["id"] if added else None, "has_more": False}

        return await self._serve(request, add)

    async def get_item(self, request: Request):
        id_, item_id = request.path_params["conversation_id"], request.path_params["item_id"]

        async def get(records: Records, owner: str):
            for item in (await records.conversation(id_, owner)).items:
                if item.get("id") == item_id:
                    return item
            raise not_found("item", item_id, "item_id")

        return await self._serve(request, get)

    async def delete_item(self, request: Request):
        id_, item_id = request.path_params["conversation_id"], request.path_params["item_id"]

        async def delete(records: Records, owner: str):
            def change(conv):
                kept = [item for item in conv.items if item.get("id") != item_id]
                if len(kept) == len(conv.items):
                    raise not_found("item", item_id, "item_id")
                conv.items = kept

            return _conversation_json(await records.change_conversation(id_, owner, change))

        return await self._serve(request, delete)


def _raise(exc: RequestError):
    async def handler(records, owner):
        raise exc

    return handler


def _check_metadata_value(metadata: Any) -> None:
    if metadata is None:
        return
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                 for k, v in metadata.items()):
        raise RequestError("metadata: must be an object of strings", param="metadata")
    _check_metadata(metadata)


__all__ = ["BackgroundRuns", "ResponseRoutes", "StoredResponse"]
