"""What the bench reads off an engine's /metrics: the queue time of the requests it served."""

from __future__ import annotations

import httpx

QUEUE_TIME = ("vllm:request_queue_time_seconds", "specprefill_engine_request_queue_time_seconds")


def queue_totals(metrics: str) -> tuple[float, int] | None:
    """(seconds, requests) of the engine's queue-time histogram, summed over its series; None if it has none."""
    seconds, count, found = 0.0, 0, False
    for line in metrics.splitlines():
        name = line.partition("{")[0].partition(" ")[0]
        for family in QUEUE_TIME:
            if name == family + "_sum":
                seconds += float(line.rsplit(" ", 1)[1])
                found = True
            elif name == family + "_count":
                count += round(float(line.rsplit(" ", 1)[1]))
    return (seconds, count) if found else None


class EngineQueue:
    """The engine's queue time request by request: each ``read`` gives the seconds and the number of requests
    that ended since the last one (a path's own request, and a warm's pieces if any ran meanwhile)."""

    def __init__(self, client: httpx.AsyncClient, engine_url: str | None) -> None:
        self.client = client
        self.engine_url = engine_url
        self._last: tuple[float, int] | None = None

    async def read(self) -> tuple[float | None, int | None]:
        if self.engine_url is None:
            return None, None
        try:
            response = await self.client.get(f"{self.engine_url}/metrics")
        except httpx.TransportError:  # gone (a replica the bench killed): nothing to read
            return None, None
        totals = queue_totals(response.text) if response.status_code == 200 else None
        last, self._last = self._last, totals
        if totals is None or last is None:
            return None, None
        return totals[0] - last[0], totals[1] - last[1]
