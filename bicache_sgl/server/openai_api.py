"""OpenAI-compatible routes: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``.

This module is the router: the model routes are here, the two generation routes in
:mod:`~bicache_sgl.server.openai_completions` and :mod:`~bicache_sgl.server.openai_chat`, what
they share in :mod:`~bicache_sgl.server.openai_common`. They reuse the native request machinery
(:class:`~bicache_sgl.server.protocol.Item`, :class:`~bicache_sgl.server.bridge.Submission`); only
the request and response shapes differ. Every handler is a module-level function and reaches the
shared :class:`~bicache_sgl.server.state.ServerState` through ``request.app.state.server``. Which
request fields are implemented, and which are refused with a 400 naming them, is decided in
:mod:`bicache_sgl.server.fields`.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from bicache_sgl.server.openai_chat import chat_completions
from bicache_sgl.server.openai_common import check_model, model_card, response_format_schema
from bicache_sgl.server.openai_completions import completions
from bicache_sgl.server.responses import ORJSONResponse
from bicache_sgl.server.state import get_state

__all__ = ["response_format_schema", "router"]

router = APIRouter()


@router.get("/v1/models")
async def list_models(request: Request) -> ORJSONResponse:
    return ORJSONResponse({"object": "list", "data": [model_card(get_state(request))]})


@router.get("/v1/models/{model_id:path}")
async def get_model(request: Request, model_id: str) -> ORJSONResponse:
    state = get_state(request)
    check_model(state, model_id)
    return ORJSONResponse(model_card(state))


router.add_api_route("/v1/completions", completions, methods=["POST"])
router.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
