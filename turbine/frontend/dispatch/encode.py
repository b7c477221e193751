"""The encode hand-off (issue #19's E/PD and E/P/D): before a request with images goes to its workers, an
encode worker (`python -m turbine.vllm --multimodal-encode-worker`) turns the images into embeddings, and the
request carries where they are (GenerateRequest.image_embeddings) to the prefill/decode (or prefill, then
decode) workers, whose engines load them instead of running the vision encoder.

When: the model has encode workers, and every worker the request may go to takes embeddings (cards that say
`takes_image_embeddings`). Which encode worker: the first image's hash picks one (the same image goes to the
same worker, whose embedding cache then answers), the next in turn when one cannot be reached, fails or times
out; when none is left the workers encode the images themselves (they have them too). An image the encode
worker refuses is the client's fault (400). Transport: --image-embedding-transport (nixl or file)."""

from __future__ import annotations

import asyncio
import logging

import msgspec

from turbine.frontend.dispatch.disagg import DisaggConfig
from turbine.frontend.errors import RequestError, failure_of
from turbine.frontend.models.table import ServedModel
from turbine.protocol import errors as codes
from turbine.protocol.encode import ENCODE_ENDPOINT, EncodeReply, EncodeRequest
from turbine.protocol.generate import GenerateRequest
from turbine.runtime.errors import RemoteError

log = logging.getLogger("turbine.frontend")


def wants_remote_encode(model: ServedModel, request: GenerateRequest) -> bool:
    return (bool(request.images) and bool(model.encode_instances) and request.image_embeddings is None
            and all(card.takes_image_embeddings for card in (*model.cards.values(), *model.prefill_cards.values())))


async def remote_encode(model: ServedModel, client, request: GenerateRequest, cfg: DisaggConfig) -> GenerateRequest:
    """The request with its images' embeddings' locations, or as it was when no encode worker answered."""
    pool = sorted(model.encode_instances, key=lambda i: i.instance_id)
    first = int(request.images[0].hash[:8], 16) % len(pool)
    encode = EncodeRequest(request_id=request.request_id, images=request.images,
                           transport=cfg.image_embedding_transport)
    for inst in pool[first:] + pool[:first]:
        try:
            async with asyncio.timeout(cfg.encode_timeout_s):
                async with client.stream(inst.address, ENCODE_ENDPOINT, encode, EncodeReply) as stream:
                    reply = await anext(stream)
        except RemoteError as exc:
            if exc.code == codes.INVALID_REQUEST:
                raise failure_of(exc, inst.instance_id) from exc
            log.warning("request %s: encode worker %s failed (%s); trying another", request.request_id,
                        inst.instance_id, exc)
            continue
        except (asyncio.CancelledError, RequestError):
            raise
        except Exception as exc:  # noqa: BLE001 - unreachable, gone, timed out, undecodable: the next one
            log.warning("request %s: encode worker %s failed (%s: %s); trying another", request.request_id,
                        inst.instance_id, type(exc).__name__, exc)
            continue
        if [e.hash for e in reply.embeddings] != [i.hash for i in request.images]:
            log.warning("request %s: encode worker %s answered for other images; trying another",
                        request.request_id, inst.instance_id)
            continue
        return msgspec.structs.replace(request, image_embeddings=reply.embeddings)
    log.warning("request %s: no encode worker answered; the workers encode its images themselves",
                request.request_id)
    return request
