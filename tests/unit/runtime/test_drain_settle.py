"""drain_and_stop after unregistering: a router that has not seen the unregistration yet may still
send a request on the connection it holds; within the settle time it is served, not cut off."""

import asyncio

import pytest

from turbine.protocol.generate import GenerateOutput, GenerateRequest, StopConditions
from turbine.runtime.lifecycle import drain_and_stop
from turbine.runtime.request_plane import RequestPlaneClient, RequestPlaneServer

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def generate(r: GenerateRequest, ctx):
    for i in range(r.stop.max_tokens or 0):
        yield GenerateOutput(token_ids=[i])
        await asyncio.sleep(0.01)


async def late_request(settle_s: float) -> list[int] | Exception:
    server = RequestPlaneServer()
    server.register("generate", GenerateRequest, generate)
    await server.start()
    client = RequestPlaneClient()
    try:
        warm = GenerateRequest(request_id="warm", model="m", token_ids=[1], stop=StopConditions(max_tokens=1))
        assert [o.token_ids async for o in client.stream(server.address, "generate", warm, GenerateOutput)]
        # The worker is idle and "unregistered" now; a request comes 0.2 s later on the same connection.
        stopping = asyncio.create_task(drain_and_stop([server], grace_s=5, settle_s=settle_s))
        await asyncio.sleep(0.2)
        late = GenerateRequest(request_id="late", model="m", token_ids=[1], stop=StopConditions(max_tokens=5))
        try:
            stream = client.stream(server.address, "generate", late, GenerateOutput)
            return [t async for o in stream for t in o.token_ids]
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            return exc
        finally:
            await stopping
    finally:
        await client.close()


async def test_a_request_sent_within_the_settle_time_is_served():
    assert await late_request(settle_s=1.0) == [0, 1, 2, 3, 4]


async def test_without_settling_an_idle_worker_is_gone_before_the_late_request():
    assert isinstance(await late_request(settle_s=0.0), Exception)
