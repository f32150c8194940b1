"""The ``specprefill`` command: every option is a flag and an environment variable ``SPECPREFILL_<NAME>``."""

from __future__ import annotations

import sys

from pydantic import ValidationError
from pydantic_settings import BaseSettings, CliApp, CliSubCommand, SettingsError

from specprefill.commands.bench import Bench
from specprefill.commands.demo import DemoModels, RealModel
from specprefill.commands.eval import Eval
from specprefill.commands.score import Score
from specprefill.commands.servers import DraftWorker, Engine, Serve


class Main(BaseSettings, cli_prog_name="specprefill", cli_kebab_case=True, cli_implicit_flags=True):
    """SpecPrefill gateway: lower time-to-first-token for long prompts."""

    serve: CliSubCommand[Serve]
    engine: CliSubCommand[Engine]
    draft_worker: CliSubCommand[DraftWorker]
    score: CliSubCommand[Score]
    demo_models: CliSubCommand[DemoModels]
    real_model: CliSubCommand[RealModel]
    bench: CliSubCommand[Bench]
    eval: CliSubCommand[Eval]

    def cli_cmd(self) -> None:
        CliApp.run_subcommand(self)


def main(argv: list[str] | None = None) -> None:
    try:
        CliApp.run(Main, cli_args=sys.argv[1:] if argv is None else argv)
    except (ValidationError, SettingsError) as exc:  # a bad option: say which and why, without a traceback
        print(f"specprefill: error: {_describe(exc)}", file=sys.stderr)
        raise SystemExit(2) from None


def _describe(exc: ValidationError | SettingsError) -> str:
    if not isinstance(exc, ValidationError):
        return str(exc)
    messages = []
    for error in exc.errors():
        option = "--" + "-".join(str(p) for p in error["loc"][1:]).replace("_", "-") if len(error["loc"]) > 1 else ""
        message = error["msg"].removeprefix("Value error, ")
        messages.append(f"{option}: {message}" if option else message)
    return "; ".join(messages)
