"""``specprefill bench``: one subcommand for each thing it measures, each with only its own options.

- ``sweep`` (the default): TTFT through the gateway and directly, per prompt length and keep rate.
- ``load``: Poisson arrivals at offered rates, and the highest rate meeting a p99 TTFT objective.
- ``workloads``: repeated contexts as they arrive (back to back, after a think time, Poisson sessions).
- ``agents``: coding agents' sessions, turn after turn.
- ``trace FILE``: a production trace replayed at its times; at several clocks, the max-QPS ratio.
- ``chaos``: faults under load, or a soak.
- ``merge FILE...``: several sweeps as one table.

``stack`` holds what they share: the servers launched (or the URLs given) and the launched gateway's flags.
"""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, CliApp, CliSubCommand, get_subcommand

from common.options import SETTINGS_CONFIG
from specprefill_lab.commands.bench.agents import Agents
from specprefill_lab.commands.bench.chaos import Chaos
from specprefill_lab.commands.bench.merge import Merge
from specprefill_lab.commands.bench.sweep import Load, Sweep
from specprefill_lab.commands.bench.trace import Trace
from specprefill_lab.commands.bench.workloads import Workloads


class Bench(BaseSettings):
    """The gateway measured against the engine it fronts; launches the demo when no URL is given (without a
    subcommand: the sweep, with its defaults)."""

    model_config = SETTINGS_CONFIG
    sweep: CliSubCommand[Sweep] = Field(description="TTFT per prompt length and keep rate (the default)")
    load: CliSubCommand[Load] = Field(description="Poisson arrivals: the highest rate meeting a p99 TTFT objective")
    workloads: CliSubCommand[Workloads] = Field(description="repeated contexts, as they arrive")
    agents: CliSubCommand[Agents] = Field(description="coding agents' sessions (Claude Code, Codex CLI)")
    trace: CliSubCommand[Trace] = Field(description="a production trace replayed at its times")
    chaos: CliSubCommand[Chaos] = Field(description="faults under load, or a soak")
    merge: CliSubCommand[Merge] = Field(description="several sweeps' bench.json as one table")

    def cli_cmd(self) -> None:
        from common.process import sigterm_unwinds

        with sigterm_unwinds():  # the servers it launched stopped on a SIGTERM too
            if get_subcommand(self, is_required=False) is None:
                raise SystemExit(Sweep().run())
            CliApp.run_subcommand(self)


__all__ = ["Agents", "Bench", "Chaos", "Load", "Merge", "Sweep", "Trace", "Workloads"]
