"""The ``specprefill`` command: every option is a flag and an environment variable ``SPECPREFILL_<NAME>``.

The product's commands are here; other installed distributions add theirs through the entry points of the
group ``specprefill.commands`` (name: the command, value: its settings class), as the lab (``lab/``) adds
``bench``, ``eval`` and ``demo-models``."""

from __future__ import annotations

import sys
from importlib.metadata import entry_points

from pydantic import ValidationError
from pydantic_settings import BaseSettings, CliApp, CliSubCommand, SettingsError

from specprefill.commands.real_model import RealModel
from specprefill.commands.score import Score
from specprefill.commands.servers import DraftWorker, Engine, Serve

GROUP = "specprefill.commands"


class Product(BaseSettings, cli_prog_name="specprefill", cli_kebab_case=True, cli_implicit_flags=True):
    """SpecPrefill gateway: lower time-to-first-token for long prompts."""

    serve: CliSubCommand[Serve]
    engine: CliSubCommand[Engine]
    draft_worker: CliSubCommand[DraftWorker]
    score: CliSubCommand[Score]
    real_model: CliSubCommand[RealModel]

    def cli_cmd(self) -> None:
        CliApp.run_subcommand(self)


def command_line() -> type[BaseSettings]:
    """The product's commands, then those the installed distributions add (``GROUP``), in their name order."""
    added = {
        point.name.replace("-", "_"): CliSubCommand[point.load()]
        for point in sorted(entry_points(group=GROUP), key=lambda p: p.name)
        if point.name.replace("-", "_") not in Product.model_fields
    }
    if not added:
        return Product
    namespace = {"__annotations__": added, "__doc__": Product.__doc__, "__module__": __name__}
    return type("Main", (Product,), namespace)


Main = command_line()


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
