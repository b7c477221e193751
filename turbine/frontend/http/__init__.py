"""The http stage: routes, auth, body limits, request ids, client disconnects, overload control,
the SSE response, the OpenAPI document; writes each API's answer as JSON or SSE (api.py)."""
