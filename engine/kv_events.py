"""The reference engine's KV cache events, published as vLLM publishes its own (``--kv-events-config``, the same
JSON): a ZMQ PUB socket sends each batch as (topic, sequence number, msgpack batch), and an optional ROUTER
socket replays the last ``buffer_steps`` batches from a sequence number, then an end marker. A gateway that
subscribes knows what this engine's prefix cache holds, exactly, and notices a restart (the numbers start over).
"""

from __future__ import annotations

import collections
import json
import logging
import queue
import threading
import time
from dataclasses import dataclass, fields
from typing import Any

import zmq

from common.kv_events import END_SEQ, Event, EventBatch, encode_batch

logger = logging.getLogger("specprefill.engine")


@dataclass(slots=True)
class KVEventsConfig:
    """vLLM's ``KVEventsConfig`` fields (others in the JSON are ignored)."""

    enable_kv_cache_events: bool = False
    publisher: str = "zmq"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    topic: str = ""

    @classmethod
    def parse(cls, text: str) -> KVEventsConfig:
        try:
            values = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--kv-events-config is not JSON: {exc}") from exc
        if not isinstance(values, dict):
            raise ValueError("--kv-events-config must be a JSON object, as vLLM's")
        known = {f.name for f in fields(cls)}
        config = cls(**{k: v for k, v in values.items() if k in known})
        if config.enable_kv_cache_events and config.publisher not in ("zmq", "null"):
            raise ValueError(f"--kv-events-config: publisher {config.publisher!r} is not one of 'zmq', 'null'")
        return config


class EventPublisher:
    """Batches from the engine thread go out on a thread of their own (ZMQ sockets stay in one thread)."""

    def __init__(self, config: KVEventsConfig) -> None:
        self.topic = config.topic.encode()
        self._queue: queue.Queue[EventBatch | None] = queue.Queue()
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=config.buffer_steps)
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self.endpoint = _bind(self._pub, config.endpoint)
        self._replay: zmq.Socket[bytes] | None = None
        self.replay_endpoint = None
        if config.replay_endpoint:
            self._replay = self._context.socket(zmq.ROUTER)
            self.replay_endpoint = _bind(self._replay, config.replay_endpoint)
        self._seq = 0
        self._queued = 0
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        logger.info("KV cache events on %s (replay: %s)", self.endpoint, self.replay_endpoint or "none")

    def source(self) -> dict[str, Any]:
        """This publisher as vLLM's ``/kv_event_sources`` describes one (its ``KVEventsConfig``, bound)."""
        return {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": self.endpoint,
            "replay_endpoint": self.replay_endpoint,
            "topic": self.topic.decode(),
        }

    @property
    def published(self) -> int:
        """Batches sent so far (the next one's sequence number)."""
        return self._seq

    @property
    def queued(self) -> int:
        """Batches handed to the publisher so far (sent, or about to be)."""
        return self._queued

    def publish(self, events: list[Event]) -> None:
        if events:
            self._queued += 1
            self._queue.put(EventBatch(time.time(), events))

    def _run(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                batch = self._queue.get(timeout=0.02)
            except queue.Empty:
                continue
            if batch is None:
                break
            payload = encode_batch(batch)
            self._pub.send_multipart((self.topic, self._seq.to_bytes(8, "big"), payload))
            self._buffer.append((self._seq, payload))
            self._seq += 1
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._context.term()

    def _serve_replay(self) -> None:
        replay = self._replay
        assert replay is not None  # polled only where there is one
        frames = replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("KV events: a replay request of %d frames ignored", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                replay.send_multipart((client, b"", self.topic, seq.to_bytes(8, "big"), payload))
        replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=2.0)


def _bind(socket: zmq.Socket[bytes], endpoint: str) -> str:
    """Binds ``endpoint``; the address actually bound (a port of 0 is the OS's choice)."""
    socket.bind(endpoint)
    return socket.getsockopt_string(zmq.LAST_ENDPOINT)
