"""Following an engine's KV cache events (vLLM's ``--kv-events-config``, or the reference engine's), so that the
model of its prefix cache is what the engine says, not what the gateway guessed.

A ZMQ SUB socket receives (topic, sequence number, batch); each batch goes into an ``EventEngineCache``. The
sequence numbers tell the rest:
  the first batch seen, or one after a gap: the batches before it are asked for on the replay socket (when the
  engine has one); without one, a gap leaves the model unsure of what was removed, so it starts empty again;
  a number at or below the last one: the publisher started over, so the engine restarted and its cache is empty;
  the publisher's connection dropping (a socket monitor): the engine may be restarting, so the model holds
  nothing until events come again, and the replay then fills in what the engine kept.
A fault here never reaches a request: the model then knows less, and the gateway predicts fewer cache hits.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from common.kv_events import END_SEQ, AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, decode_batch
from gateway.engines.cache import EventEngineCache
from gateway.metrics import GatewayMetrics

logger = logging.getLogger("specprefill.gateway")
MEDIA = (None, "GPU")  # the engine's own cache; an offloading tier ("CPU", "STORAGE") is not a prefix hit


class EventSubscriber:
    def __init__(
        self,
        model: EventEngineCache,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        metrics: GatewayMetrics | None = None,
        replay_timeout: float = 2.0,
    ) -> None:
        self.model = model
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.metrics = metrics
        self.replay_timeout = replay_timeout
        self.last: int | None = None  # the last sequence number applied
        self._context = zmq.asyncio.Context()
        self._task: asyncio.Task[Any] | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sub.connect(self.endpoint)
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        logger.info(
            "following the engine's KV cache events on %s (replay: %s)", self.endpoint, self.replay_endpoint or "none"
        )
        try:
            while True:
                ready = dict(await poller.poll())
                if monitor in ready:
                    parse_monitor_message(await monitor.recv_multipart())
                    self._disconnected()
                if sub in ready:
                    await self._safely(await sub.recv_multipart())
        except asyncio.CancelledError:
            pass
        finally:
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    def _disconnected(self) -> None:
        """The engine went away (a restart, a crash, the network): what it holds when it is back is unknown, and
        empty if it restarted. Until its events say otherwise (a replay from the first batch, when it has a
        replay socket), the model holds nothing."""
        logger.info("KV events: the engine's publisher disconnected; the cache model starts empty again")
        self._count("disconnected")
        self.model.clear()
        self.last = None

    async def _safely(self, frames: list[bytes]) -> None:
        try:
            await self._received(frames)
        except Exception as exc:  # a bad batch: what it said is lost, so the model starts over
            logger.warning("KV events: %s; the cache model starts empty again", exc)
            self._count("error")
            self.model.clear()
            self.last = None

    async def _received(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            raise ValueError(f"a message of {len(frames)} frames (expected topic, sequence number, batch)")
        _, seq_bytes, payload = frames
        seq = int.from_bytes(seq_bytes, "big")
        if self.last is not None and seq <= self.last:
            logger.info("KV events: the numbers started over (%d after %d): the engine restarted", seq, self.last)
            self._count("restart")
            self.model.clear()
            self.last = None
        expected = 0 if self.last is None else self.last + 1
        if seq > expected:
            if not await self._replay(expected, seq):
                if self.last is not None:
                    logger.warning(
                        "KV events: batches %d-%d missed and not replayed: the cache model starts empty again",
                        expected,
                        seq - 1,
                    )
                    self._count("gap")
                    self.model.clear()
        self.apply(decode_batch(payload))
        self.last = seq

    async def _replay(self, first: int, before: int) -> bool:
        """Batches ``first`` .. ``before - 1`` from the replay socket, applied; False if there is none or it
        did not answer in time."""
        if self.replay_endpoint is None:
            return False
        dealer = self._context.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        try:
            await dealer.send_multipart((b"", first.to_bytes(8, "big")))
            while True:
                if not await dealer.poll(self.replay_timeout * 1e3):
                    logger.warning("KV events: the replay socket did not answer within %.1f s", self.replay_timeout)
                    return False
                frames = await dealer.recv_multipart()
                if len(frames) != 4 or frames[2] == END_SEQ:
                    return True
                seq = int.from_bytes(frames[2], "big")
                if first <= seq < before:
                    self.apply(decode_batch(frames[3]))
                    self._count("replayed")
        finally:
            dealer.close(linger=0)

    def apply(self, batch: EventBatch) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored):
                if event.medium in MEDIA:
                    self.model.stored(
                        event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size, event.extra_keys
                    )
                    self._count("stored", len(event.block_hashes))
            elif isinstance(event, BlockRemoved):
                if event.medium in MEDIA:
                    self.model.removed(event.block_hashes)
                    self._count("removed", len(event.block_hashes))
            elif isinstance(event, AllBlocksCleared):
                self.model.clear()
                self._count("cleared")

    def _count(self, kind: str, n: int = 1) -> None:
        if self.metrics is not None:
            self.metrics.kv_events.labels(kind).inc(n)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._context.term()
