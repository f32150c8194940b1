"""``specprefill bench chaos``: faults under load (Redis, the engine, a draft worker, a stalled engine, refused
swaps, several at once, then a SIGTERM), or a soak, all on loopback."""

from __future__ import annotations

import asyncio
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings

from common.options import SETTINGS_CONFIG


class Chaos(BaseSettings):
    """Faults under load, each part broken in turn and together, then a SIGTERM (chaos.json); or a soak."""

    model_config = SETTINGS_CONFIG
    out: str = Field("bench_results", description="folder for chaos.json")
    pair: str | None = Field(None, description="a folder with draft/ and target/ (default: the demo pair)")
    fault_s: float = Field(8.0, description="seconds each part stays broken")
    calm_s: float = Field(10.0, description="seconds of steady load first and after each recovery")
    rate: float = Field(2.0, description="requests per second")
    soak_s: float = Field(
        0.0,
        description="a soak of this many seconds instead (no faults; the "
        "gateway's resident memory and open file descriptors sampled every 10 s)",
    )

    def cli_cmd(self) -> None:
        raise SystemExit(self.run())

    def run(self) -> int:
        from specprefill_lab.chaos import FAULTS, format_chaos, run_chaos
        from specprefill_lab.demo_models import ensure_demo_models

        out = Path(self.out)
        out.mkdir(parents=True, exist_ok=True)
        root = Path(self.pair) if self.pair else ensure_demo_models()
        soak = self.soak_s > 0
        report = asyncio.run(
            run_chaos(
                root,
                out,
                fault_s=self.fault_s,
                rate=self.rate,
                calm_s=self.soak_s if soak else self.calm_s,
                faults=() if soak else FAULTS,
            )
        )
        summary = report.summary()
        print(format_chaos(summary))
        if soak:  # flat after the first 5 minutes (a twelfth of a shorter soak)
            print(f"soak: {report.growth(min(300.0, self.soak_s / 12))}")
        print(f"wrote {out / 'chaos.json'}")
        return 0 if summary["lost"] == 0 and not summary["wrong_answers"] and not summary["unshaped_errors"] else 1
