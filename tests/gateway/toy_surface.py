"""A toy API surface, as a new one is added: this module, and its name in ``gateway.app.SURFACES``
(``tests/gateway/test_gateway.py`` adds it). It answers how many tokens the target reads in a text."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from gateway.entrypoints.http import AUTH

NAME = "toy"
router = APIRouter(dependencies=AUTH)


class ToyAPI:
    def __init__(self, serving) -> None:
        self.serving = serving

    def count(self, text: str) -> int:
        return len(self.serving.tokenizer(text, add_special_tokens=False).input_ids)


def build(serving, built: dict) -> ToyAPI:
    return ToyAPI(serving)


@router.post("/v1/toy/count")
async def count(body: dict, raw_request: Request) -> JSONResponse:
    return JSONResponse({"tokens": raw_request.app.state.surfaces[NAME].count(body["text"])})
