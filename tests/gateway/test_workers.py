"""``specprefill serve --workers N``: N gateway processes on one port in front of one engine, sharing the score
cache and the engine-cache model through Redis. Run as a user runs it (the real command, a real engine, real
Redis): requests spread over the workers, none lost or answered twice, ``/metrics`` summed, the engine-cache
predictions equal to the engine's reports across workers, a dead worker replaced, SIGTERM a clean stop."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx

from common.process import free_port, wait_healthy
from tests.helpers import LONG_DOC, engine_app, serve


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def _workers(pid: int) -> list[int]:
    """The supervisor's worker processes (multiprocessing's resource tracker left out)."""
    found = []
    for child in _children(pid):
        with contextlib.suppress(OSError):  # a child that has just ended
            command = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            if "spawn_main" in command:
                found.append(child)
    return found


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _total(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def _until(predicate, within: float = 120.0) -> bool:
    deadline = time.monotonic() + within
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _chat(url: str, turns: int) -> dict:
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": LONG_DOC + "\n\nWhat is the first number?"},
    ]
    for turn in range(1, turns):
        messages += [{"role": "assistant", "content": "12."}, {"role": "user", "content": f"And number {turn + 1}?"}]
    with httpx.Client(timeout=120) as client:  # a connection of its own: any worker may take it
        response = client.post(
            f"{url}/v1/chat/completions",
            json={"model": "tiny", "messages": messages, "max_tokens": 4, "temperature": 0},
        )
    assert response.status_code == 200, response.text
    return {
        "answer": response.json()["choices"][0]["message"]["content"],
        "cached": int(re.search(r'cached;desc="(\d+)"', response.headers["server-timing"]).group(1)),
        "engine_cached": response.json()["usage"]["prompt_tokens_details"]["cached_tokens"],
    }


def _complete(url: str, i: int) -> tuple[int, tuple[int, str, str], str]:
    """The status, what the target read (the prompt, the plan, the kept tokens) and the answer."""
    with httpx.Client(timeout=120) as client:
        response = client.post(
            f"{url}/v1/completions",
            json={"model": "tiny", "prompt": f"{i % 4} {LONG_DOC}", "max_tokens": 4, "temperature": 0},
        )
    if response.status_code != 200:
        return response.status_code, (i % 4, "", ""), response.text
    read = (i % 4, response.headers["x-specprefill-plan"], response.headers["x-specprefill-kept-tokens"])
    return 200, read, response.json()["choices"][0]["text"]


def test_workers_on_one_port_share_the_load_the_caches_and_the_metrics(model_pair, redis_url, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    with serve(engine_app(model_pair)) as engine, log.open("w") as output:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "specprefill",
                "serve",
                "--workers",
                "2",
                "--port",
                str(port),
                "--backend-url",
                engine,
                "--redis-url",
                redis_url,
                "--redis-key-prefix",
                f"workers-{uuid.uuid4().hex[:8]}:",
                "--target-model",
                str(model_pair / "target"),
                "--draft-model",
                str(model_pair / "draft"),
                "--served-model-name",
                "tiny",
                "--min-prompt-tokens",
                "64",
                "--planner",
                "cost",
                "--no-warming",
                "--no-calibrate",
                "--device",
                "cpu",
                "--log-level",
                "warning",
            ],
            stdout=subprocess.DEVNULL,
            stderr=output,
        )
        try:
            wait_healthy(url, process, 300)
            assert _until(lambda: len(_workers(process.pid)) == 2), "two workers"
            workers = _workers(process.pid)
            before = {pid: _cpu_seconds(pid) for pid in workers}

            # a multi-turn chat, each turn on a new connection: whichever worker takes a turn predicts what the
            # engine holds from the turns the other sent (the engine-cache model is in Redis)
            turns = [_chat(url, n) for n in (1, 2, 3, 4)]
            assert all(t["cached"] == t["engine_cached"] for t in turns), turns
            assert sum(t["cached"] for t in turns) > 0

            # 40 requests at once, each on its own connection: every one answered once, the same prompt read the
            # same way the same answer whichever worker took it, both workers busy, and /metrics counts them all
            counted = _total(url, "specprefill_requests_total")
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                answers = list(pool.map(lambda i: _complete(url, i), range(40)))
            assert [status for status, _, _ in answers] == [200] * 40, answers
            by_input: dict[tuple[int, str, str], set[str]] = {}
            for _, read, text in answers:
                by_input.setdefault(read, set()).add(text)
            assert all(len(texts) == 1 for texts in by_input.values()), by_input  # whichever worker took it
            spent = [_cpu_seconds(pid) - before[pid] for pid in workers]
            assert all(s > 0.05 for s in spent), spent
            assert _total(url, "specprefill_requests_total") - counted == 40

            # a worker that dies is replaced; the port keeps answering meanwhile
            os.kill(workers[0], signal.SIGKILL)
            assert [_complete(url, i)[0] for i in range(6)] == [200] * 6  # the other worker, meanwhile
            assert _until(lambda: "worker 0 serving again" in log.read_text()), log.read_text()
            assert len(set(_workers(process.pid)) - set(workers)) == 1
            assert [_complete(url, i)[0] for i in range(6)] == [200] * 6

            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=60) == 0, log.read_text()
            assert not [pid for pid in workers[1:] if Path(f"/proc/{pid}").exists()]
        finally:
            if process.poll() is None:  # its workers get SIGTERM when it ends (PR_SET_PDEATHSIG)
                process.kill()
                process.wait()
