"""``specprefill bench merge FILE...``: several sweeps' bench.json (one per length, say) as one table and plot."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, CliPositionalArg

from common.options import SETTINGS_CONFIG


class Merge(BaseSettings):
    """Several sweeps' bench.json files as one table and plot in --out; runs nothing."""

    model_config = SETTINGS_CONFIG
    sources: CliPositionalArg[list[str]] = Field(description="the sweeps' bench.json files")
    out: str = Field("bench_results", description="folder for the merged bench.json and its plots")

    def cli_cmd(self) -> None:
        raise SystemExit(self.run())

    def run(self) -> int:
        from specprefill_lab.bench import Row, format_table
        from specprefill_lab.report import merge_outputs

        written = merge_outputs(Path(self.out), [Path(source) for source in self.sources])
        rows = [Row(**r) for r in json.loads(written[0].read_text())["rows"]]
        print(format_table(rows) + "\nwrote " + ", ".join(str(p) for p in written))
        return 0
