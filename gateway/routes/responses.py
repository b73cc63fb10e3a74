"""OpenAI's Responses API: create (whole, streamed, or in the background), retrieve, list input items, cancel,
delete. The work is gateway/responses/; here is HTTP: errors before the first event keep their status, a client
that leaves aborts the generation."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse

from gateway import streaming
from gateway.auth import authenticate
from gateway.responses.encoding import sse
from gateway.responses.requests import ResponsesRequest
from gateway.responses.service import Responses
from gateway.service import Caller
from gateway.wire import schemas

router = APIRouter(tags=["responses"])


def responses_of(request: Request) -> Responses:
    """The Responses service of the app serving ``request``."""
    return request.app.state.responses


@router.post("/v1/responses", responses=schemas.generation(schemas.Response, schemas.RESPONSE_EVENTS))
async def create_response(body: ResponsesRequest, request: Request, caller: Caller = Depends(authenticate)):
    responses = responses_of(request)
    turn = await responses.begin(body, caller)
    if body.background:
        return JSONResponse(await responses.start_background(turn))
    if not body.stream:
        return JSONResponse(await streaming.until_disconnect(request, responses.answer(turn)))
    try:  # errors before the first token keep their HTTP status; a client gone by then aborts the work
        head = await streaming.until_disconnect(request, streaming.first(turn.chunks))
    except BaseException:
        await turn.chunks.aclose()
        raise

    async def body_bytes():
        async for event in responses.events(turn, head):
            yield sse(event)

    return StreamingResponse(body_bytes(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


@router.get("/v1/responses/{response_id}", responses=schemas.ok(schemas.Response, 404, 503))
async def retrieve_response(response_id: str, request: Request, caller: Caller = Depends(authenticate)):
    return (await responses_of(request).retrieve(caller, response_id)).response


@router.get("/v1/responses/{response_id}/input_items", responses=schemas.ok(schemas.InputItemList, 404, 503))
async def list_input_items(response_id: str, request: Request, caller: Caller = Depends(authenticate),
                           order: Literal["asc", "desc"] = "desc", limit: int = Query(20, ge=1, le=100),
                           after: str | None = None):
    """OpenAI's list of a response's input items: newest first unless ``order=asc``, ``limit`` at a time, the
    page ``after`` an item id."""
    items = (await responses_of(request).retrieve(caller, response_id)).input_items
    items = items[::-1] if order == "desc" else items
    if after is not None:
        ids = [item["id"] for item in items]
        items = items[ids.index(after) + 1:] if after in ids else []
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}


@router.post("/v1/responses/{response_id}/cancel", responses=schemas.ok(schemas.Response, 404, 503))
async def cancel_response(response_id: str, request: Request, caller: Caller = Depends(authenticate)):
    return await responses_of(request).cancel(caller, response_id)


@router.delete("/v1/responses/{response_id}", responses=schemas.ok(schemas.ResponseDeleted, 404, 503))
async def delete_response(response_id: str, request: Request, caller: Caller = Depends(authenticate)):
    return await responses_of(request).delete(caller, response_id)
