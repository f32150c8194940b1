"""The dry runs: what would be sent to the backend for a chat or completion body (``/v1/specprefill/compress``),
and the inspector's data (every token's score, and the plan at every keep rate of its slider), without
calling the backend."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

import torch
from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse, JSONResponse

from common.errors import InvalidRequestError, OverloadedError, parse_body
from common.json_wire import WireJSONResponse
from common.protocol import ChatCompletionRequest, CompletionRequest
from common.selection import always_kept, applied_keep_rate, select_tokens
from common.tokenize import token_pieces
from gateway.entrypoints.http import AUTH, require_key_in_browser
from gateway.entrypoints.inspector import KEEP_RATES, inspection, page, runs
from gateway.planning.policy import RequestOptions, request_options
from gateway.planning.prompt import Prompt
from gateway.serving import GatewayServing


class DryRunAPI:
    def __init__(self, serving: GatewayServing) -> None:
        self.serving = serving

    async def compress(
        self, body: dict[str, Any], headers: Mapping[str, str], return_scores: bool = False
    ) -> dict[str, Any]:
        """What would be sent to the backend for this chat or completion body, without sending it; with
        ``return_scores`` (or ``"return_scores": true`` in the body) also the draft's score of every prompt token."""
        serving = self.serving
        return_scores = bool(body.pop("return_scores", False)) or return_scores
        request, options, prompt = self._dry_request(body, headers)
        scored = await self._scores(prompt.token_ids) if return_scores else None
        plan = await serving.plan(prompt, options, serving.unsupported(request), dry_run=True, scored=scored)
        answer = {
            "original_tokens": plan.original_tokens,
            "kept_tokens": plan.kept_tokens,
            "keep_rate": plan.keep_rate,
            "status": plan.status,
            "reason": plan.reason,
            "plan": plan.kind,
            "token_ids": plan.kept_token_ids(),
            "position_ids": plan.sent_position_ids(),
        }
        if scored is not None:
            answer["scores"] = [float(s) for s in scored[0].tolist()]
        return answer

    async def inspect(self, body: dict[str, Any], headers: Mapping[str, str]) -> dict[str, Any]:
        """The inspector's data: the prompt's tokens and scores, and the dry-run plan at every keep rate of
        the slider's grid, all from one draft call (``gateway.entrypoints.inspector``)."""
        serving = self.serving
        request, options, prompt = self._dry_request(body, headers)
        unsupported = serving.unsupported(request)
        start = time.perf_counter()
        scores, cache = await self._scores(prompt.token_ids)
        draft_ms = (time.perf_counter() - start) * 1e3
        config = serving.draft.config

        special = serving.planner.special_ids

        async def entry(rate: float) -> dict[str, Any]:
            rate_options = RequestOptions(rate, options.enabled)
            plan = await serving.plan(prompt, rate_options, unsupported, dry_run=True, scored=(scores, cache))
            shown = {
                "status": plan.status,
                "reason": plan.reason,
                "plan": plan.kind,
                "kept": runs(plan.sent_position_ids()),
                "chunk_size": config.chunk_for(len(prompt.token_ids), rate),
            }
            if plan.status != "compressed" and rate < 1:  # sent whole: what the rule would have dropped
                shown["selected"] = runs(select_tokens(prompt.token_ids, scores, rate, config, special, prompt.keep))
            return shown

        plans = {rate: await entry(rate) for rate in KEEP_RATES}
        shown_rate = options.keep_rate
        if options.auto is not None:  # the rate the scores choose, beside the grid's, and the page opens at it
            shown_rate = applied_keep_rate(options.auto, prompt.token_ids, scores, config, special, prompt.keep)
            plans[shown_rate] = await entry(shown_rate)
        protected = always_kept(prompt.token_ids, config, special, prompt.keep)
        return inspection(
            token_pieces(serving.tokenizer, prompt.token_ids),
            scores,
            protected,
            config.chunk_for(len(prompt.token_ids), shown_rate),
            shown_rate,
            plans,
            draft_ms=draft_ms,
            cache=cache,
            model=serving.model_name,
        )

    async def _scores(self, token_ids: list[int]) -> tuple[torch.Tensor, str]:
        """The prompt's scores for a caller that asked for them: a draft fault is a 503 that says so."""
        serving = self.serving
        if len(token_ids) > serving.draft.max_prompt_tokens:
            raise InvalidRequestError(
                f"the prompt has {len(token_ids)} tokens; the draft model scores at most "
                f"{serving.draft.max_prompt_tokens}",
                param="prompt",
                code="prompt_too_long",
            )
        try:
            return await asyncio.wait_for(serving.planner.scores.scores(token_ids), serving.settings.draft_timeout)
        except Exception as exc:
            raise OverloadedError(
                f"the draft model could not score this prompt ({type(exc).__name__}); try again later",
                code="draft_unavailable",
            ) from None

    def _dry_request(
        self, body: dict[str, Any], headers: Mapping[str, str]
    ) -> tuple[ChatCompletionRequest | CompletionRequest, RequestOptions, Prompt]:
        """A chat or completion body checked as for a real request (the model name may be left out)."""
        if not isinstance(body, dict):
            raise InvalidRequestError(
                "the body must be a JSON object: a chat body with messages, or a completion body with a prompt"
            )
        serving = self.serving
        body = {"model": serving.model_name, **body}
        request: ChatCompletionRequest | CompletionRequest = (
            parse_body(ChatCompletionRequest, body) if "messages" in body else parse_body(CompletionRequest, body)
        )
        options = request_options(headers, request.specprefill, serving.settings.default_keep_rate)
        prompt = serving.prompt(request)
        serving.check_limits(request, prompt.token_ids)
        return request, options, prompt


NAME = "dry_run"
router = APIRouter()


def build(serving: GatewayServing, built: dict[str, Any]) -> DryRunAPI:
    return DryRunAPI(serving)


@router.post("/v1/specprefill/compress", dependencies=AUTH)
async def compress(body: dict[str, Any], raw_request: Request, return_scores: bool = False) -> JSONResponse:
    """A dry run: what a chat or completion body would send to the backend (kept token IDs and their
    positions; ``return_scores``: every token's score too), without calling it."""
    dry_run = raw_request.app.state.surfaces[NAME]
    return WireJSONResponse(await dry_run.compress(body, raw_request.headers, return_scores))


@router.post("/v1/specprefill/inspect", dependencies=AUTH)
async def inspect_data(body: dict[str, Any], raw_request: Request) -> JSONResponse:
    """The inspector's data for a prompt: tokens, scores, and the kept tokens at each keep rate."""
    return WireJSONResponse(await raw_request.app.state.surfaces[NAME].inspect(body, raw_request.headers))


@router.get("/specprefill/inspect", dependencies=[Depends(require_key_in_browser)])
async def inspect_page() -> HTMLResponse:
    """The inspector: a page showing which tokens the target reads (``?prompt=TEXT&keep_rate=F``)."""
    return HTMLResponse(page(), headers={"cache-control": "no-store"})
