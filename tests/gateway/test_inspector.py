"""The token-importance inspector: its data is the gateway's own plan at every keep rate, its page renders it in a
real headless Chromium, and ``specprefill score --html`` writes the same view as one file."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import urllib.parse
from pathlib import Path

import httpx
import pytest
import torch

from common.models import load_tokenizer
from common.selection import select_tokens
from common.tokenize import token_pieces
from gateway.app import create_app
from gateway.entrypoints.inspector import page, runs
from tests.browser import Browser, find_chromium
from tests.helpers import LONG_DOC, gateway_settings, serve

ROOT = Path(__file__).resolve().parents[2]
SCREENSHOT = ROOT / "docs" / "inspector.png"  # the README's picture: rewritten with SPECPREFILL_UPDATE_SCREENSHOTS=1


def kept_positions(compress: dict) -> list[int]:
    return compress["position_ids"]


def compress(url: str, prompt: str, keep_rate: float, **extra) -> dict:
    response = httpx.post(
        f"{url}/v1/specprefill/compress",
        json={"prompt": prompt, **extra},
        headers={"x-keep-rate": str(keep_rate)},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    return response.json()


def test_token_pieces_read_as_the_prompt(tokenizer):
    text = "naïve café — 日本語のテキスト 🙂🙂 done.\n\n  two  spaces\tand a tab"
    ids = tokenizer(text).input_ids
    pieces = token_pieces(tokenizer, ids)
    assert len(pieces) == len(ids)
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    assert runs([0, 1, 2, 7, 8, 10]) == [[0, 3], [7, 9], [10, 11]] and runs([]) == []


def test_compress_returns_one_score_per_prompt_token(gateway_url):
    in_body = compress(gateway_url, LONG_DOC, 0.3, return_scores=True)
    assert len(in_body["scores"]) == in_body["original_tokens"] and in_body["status"] == "compressed"
    response = httpx.post(
        f"{gateway_url}/v1/specprefill/compress?return_scores=true",
        json={"prompt": LONG_DOC},
        headers={"x-keep-rate": "0.3"},
        timeout=60,
    )
    assert response.json()["scores"] == in_body["scores"]
    assert "scores" not in compress(gateway_url, LONG_DOC, 0.3)


def test_inspect_data_is_the_gateways_plan_at_every_keep_rate(gateway_url):
    response = httpx.post(
        f"{gateway_url}/v1/specprefill/inspect", json={"prompt": LONG_DOC}, headers={"x-keep-rate": "0.1"}, timeout=60
    )
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["keep_rate"] == 0.1 and len(data["tokens"]) == len(data["scores"]) == data["original_tokens"]
    grid = {entry["keep_rate"]: entry for entry in data["keep_rates"]}
    assert len(grid) == 100
    for rate in (0.1, 0.3, 0.55, 1.0):
        expected = compress(gateway_url, LONG_DOC, rate)
        assert [i for a, b in grid[rate]["kept"] for i in range(a, b)] == kept_positions(expected)
        assert grid[rate]["status"] == expected["status"]
    assert data["protected"][0][0] == 0 and data["protected"][-1][1] == data["original_tokens"]  # both ends


def test_a_short_prompt_shows_what_the_rule_would_drop(gateway_url):
    """The gateway sends it whole (short_prompt); the inspector still shows the selection, apart."""
    data = httpx.post(
        f"{gateway_url}/v1/specprefill/inspect", json={"prompt": "A short prompt. " * 4}, timeout=60
    ).json()
    entry = next(e for e in data["keep_rates"] if e["keep_rate"] == 0.1)
    assert entry["reason"] == "short_prompt" and entry["kept"] == [[0, data["original_tokens"]]]
    assert "selected" in entry


@pytest.mark.parametrize(
    ("body", "headers", "param", "words"),
    [
        (b"{not json", {}, None, "JSON"),
        (json.dumps({"prompt": ""}).encode(), {}, "prompt", "prompt"),
        (json.dumps({"prompt": LONG_DOC}).encode(), {"x-keep-rate": "5"}, "x-keep-rate", "(0, 1]"),
        (json.dumps({"messages": "hello"}).encode(), {}, "messages", "messages"),
    ],
)
def test_bad_input_is_a_400_that_says_what_to_change(gateway_url, body, headers, param, words):
    response = httpx.post(
        f"{gateway_url}/v1/specprefill/inspect",
        content=body,
        timeout=60,
        headers={"content-type": "application/json", **headers},
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_a_gateway_with_max_chunks_sends_and_shows_the_longer_chunks(model_pair, engine_backend):
    """``--max-chunks``: the gateway sends the one rule's selection in the chunks it chose, the inspector says which."""
    settings = gateway_settings(model_pair, backend_url=engine_backend[0], backend_kind="reference", max_chunks=2)
    config = settings.scoring_config()
    with serve(create_app(settings)) as url:
        sent = compress(url, LONG_DOC, 0.3, return_scores=True)
        data = httpx.post(
            f"{url}/v1/specprefill/inspect", json={"prompt": LONG_DOC}, headers={"x-keep-rate": "0.3"}, timeout=60
        ).json()
    n = sent["original_tokens"]
    grid = {entry["keep_rate"]: entry for entry in data["keep_rates"]}
    assert grid[0.3]["chunk_size"] == config.chunk_for(n, 0.3) > config.chunk_size  # LONG_DOC buys > 2 chunks
    assert grid[1.0]["chunk_size"] == config.chunk_size
    assert [i for a, b in grid[0.3]["kept"] for i in range(a, b)] == kept_positions(sent)
    ids = load_tokenizer(str(model_pair / "target"))(LONG_DOC).input_ids
    assert len(ids) == n
    rule = select_tokens(ids, torch.tensor(sent["scores"]), 0.3, config)
    assert rule == kept_positions(sent)


def test_page_and_data_are_behind_the_api_key(model_pair, engine_backend):
    settings = gateway_settings(model_pair, backend_url=engine_backend[0], backend_kind="reference", api_key="k3y")
    with serve(create_app(settings)) as url:
        denied = httpx.get(f"{url}/specprefill/inspect")
        assert denied.status_code == 401 and denied.headers["www-authenticate"].startswith("Basic")
        assert denied.json()["error"]["code"] == "invalid_api_key"
        basic = "Basic " + base64.b64encode(b"me:k3y").decode()
        wrong = "Basic " + base64.b64encode(b"me:nope").decode()
        assert httpx.get(f"{url}/specprefill/inspect", headers={"authorization": wrong}).status_code == 401
        shown = httpx.get(f"{url}/specprefill/inspect", headers={"authorization": basic})
        assert shown.status_code == 200 and "SpecPrefill inspector" in shown.text
        data = {"prompt": LONG_DOC}
        assert httpx.post(f"{url}/v1/specprefill/inspect", json=data, timeout=60).status_code == 401
        for auth in (basic, "Bearer k3y"):
            assert (
                httpx.post(
                    f"{url}/v1/specprefill/inspect", json=data, headers={"authorization": auth}, timeout=60
                ).status_code
                == 200
            )


def test_page_works_offline():
    """No external script, style sheet, font or image: the page loads nothing but its own data."""
    html = page()
    assert "http://" not in html and "https://" not in html and "@import" not in html and "<link" not in html


# --- in a real browser ---

needs_browser = pytest.mark.skipif(
    find_chromium() is None, reason="no Chromium here (make test installs Debian's chromium package where it can)"
)

DOM_KEPT = "[...document.querySelectorAll('#prompt [data-kept=\"true\"]')].map(e => +e.dataset.position)"


@needs_browser
def test_the_page_shows_the_gateways_kept_tokens_at_two_keep_rates(gateway_url, tmp_path):
    query = urllib.parse.urlencode({"prompt": LONG_DOC, "keep_rate": "0.1"})
    with Browser() as browser:
        browser.open(f"{gateway_url}/specprefill/inspect?{query}")
        browser.wait_for("document.body.dataset.state === 'ready'")
        n = browser.evaluate("document.querySelectorAll('#prompt [data-position]').length")
        assert n == compress(gateway_url, LONG_DOC, 0.1)["original_tokens"]
        assert browser.evaluate(DOM_KEPT) == kept_positions(compress(gateway_url, LONG_DOC, 0.1))
        # the slider by keyboard: 20 steps of 0.01 to the right
        browser.evaluate("document.getElementById('rate').focus()")
        for _ in range(20):
            browser.press("ArrowRight")
        assert browser.evaluate("document.body.dataset.keepRate") == "0.30"
        assert browser.evaluate(DOM_KEPT) == kept_positions(compress(gateway_url, LONG_DOC, 0.3))
        title = browser.evaluate("document.querySelector('#prompt [data-position=\"5\"]').title")
        assert title.startswith("position 5 · score ")
        shot = SCREENSHOT if os.environ.get("SPECPREFILL_UPDATE_SCREENSHOTS") == "1" else tmp_path / "inspector.png"
        browser.screenshot(shot)
    assert shot.stat().st_size > 10_000


@needs_browser
@pytest.mark.parametrize(
    ("query", "shown"),
    [
        ({"chat": "{not json"}, "JSON"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": LONG_DOC, "keep_rate": "7"}, "x-keep-rate"),
    ],
)
def test_bad_input_shows_the_gateways_message_in_the_page(gateway_url, query, shown):
    with Browser() as browser:
        browser.open(f"{gateway_url}/specprefill/inspect?{urllib.parse.urlencode(query)}")
        browser.wait_for("document.body.dataset.state === 'error'")
        message = browser.evaluate("document.getElementById('error').textContent")
        assert browser.evaluate("document.getElementById('error').hidden") is False
        assert shown in message and message.startswith("The gateway could not inspect this input: ")


@needs_browser
def test_score_html_opens_with_the_same_kept_tokens(model_pair, tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(LONG_DOC)
    out = tmp_path / "view.html"
    command = [
        sys.executable,
        "-m",
        "specprefill",
        "score",
        "--model",
        str(model_pair / "draft"),
        "--keep-rate",
        "0.1",
        str(prompt),
    ]
    scored = subprocess.run(
        [*command, "--json", "--html", str(out)],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    expected = json.loads(scored.stdout)
    html = out.read_text()
    assert "http://" not in html and "https://" not in html  # self-contained
    with Browser() as browser:
        browser.open(out.as_uri())
        browser.wait_for("document.body.dataset.state === 'ready'")
        assert browser.evaluate(DOM_KEPT) == expected["kept_indices"]
        assert browser.evaluate("document.getElementById('form').hidden") is True
        scores = browser.evaluate(
            "[...document.querySelectorAll('#prompt [data-position]')].map(e => +e.dataset.score)"
        )
        assert scores == pytest.approx(expected["scores"], rel=1e-5)
    tokenizer = load_tokenizer(model_pair / "draft")
    assert len(scores) == len(tokenizer(LONG_DOC).input_ids)
