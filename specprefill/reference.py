"""The documentation's reference pages, generated from the code so that they never drift from it.

``markdown(name)`` is what ``mkdocs_hooks.py`` puts in place of ``<!-- reference: NAME -->`` in a page:
  cli       every ``specprefill`` subcommand's flags, read from the command line's own parser
  settings  every gateway setting: flag, environment variable, default, description (the settings model)
  metrics   every Prometheus metric the gateway and the reference engine export (their registries)
  http      the gateway's endpoints (its OpenAPI schema)
"""

from __future__ import annotations

import argparse
import json

from pydantic.fields import FieldInfo

DEFAULT = " (default: "  # argparse's help ends with it; a description may hold one of its own before


def markdown(name: str) -> str:
    return {"cli": cli, "settings": settings, "metrics": metrics, "http": http}[name]()


def cli_commands() -> dict[str, tuple[type, list[argparse.Action]]]:
    """Each subcommand (``bench sweep`` for a subcommand's own), its settings class and its arguments, as
    ``specprefill SUBCOMMAND --help`` lists them; a command made only of subcommands is left out."""
    from pydantic_settings import CliSettingsSource

    from specprefill.cli import Main

    parser = CliSettingsSource(
        Main, cli_prog_name="specprefill", cli_kebab_case=True, cli_implicit_flags=True
    ).root_parser
    out: dict[str, tuple[type, list[argparse.Action]]] = {}

    def walk(parser: argparse.ArgumentParser, settings: type, prefix: str) -> None:
        commands = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        if commands is None:
            out[prefix] = (settings, [a for a in parser._actions if a.dest != "help"])
            return
        for name, sub in commands.choices.items():
            field = settings.model_fields[name.replace("-", "_")]  # type: ignore[attr-defined]
            command = field.annotation.__args__[0] if hasattr(field.annotation, "__args__") else field.annotation
            walk(sub, command, f"{prefix} {name}".strip())

    walk(parser, Main, "")
    return out


def cli_options() -> dict[str, list[argparse.Action]]:
    """Each subcommand's options (``bench sweep`` for a subcommand's own)."""
    return {name: [a for a in actions if a.option_strings] for name, (_, actions) in cli_commands().items()}


def cli() -> str:
    lines = []
    for name, (command, arguments) in cli_commands().items():
        actions = [a for a in arguments if a.option_strings] + [a for a in arguments if not a.option_strings]
        lines += [
            f"## `specprefill {name}`",
            "",
            _first_line(command.__doc__),
            "",
            "| flag | default | description |",
            "| --- | --- | --- |",
        ]
        for action in actions:
            help_text, default = _split_default(action.help or "")
            flags = ", ".join(f"`{flag}`" for flag in action.option_strings) or f"`{action.metavar or action.dest}`"
            lines.append(f"| {flags} | {_code(default)} | {_cell(help_text)} |")
        lines.append("")
    return "\n".join(lines)


def settings() -> str:
    """Every `specprefill serve` setting: the gateway's, and the command's own (which real pair it makes)."""
    from specprefill.commands.servers import Serve

    prefix = Serve.model_config.get("env_prefix", "")
    lines = ["| flag | environment variable | default | description |", "| --- | --- | --- | --- |"]
    for name, field in Serve.model_fields.items():
        flag = "--" + name.replace("_", "-")
        lines.append(
            f"| `{flag}` | `{prefix}{name.upper()}` | {_code(_field_default(field))} | "
            f"{_cell(field.description or '')} |"
        )
    return "\n".join(lines) + "\n"


def metric_families() -> list[tuple[str, str, str, list[str], str]]:
    """(exposed name, type, help, labels, where) of every metric family, gateway first, then the engine's."""
    from engine.metrics import EngineMetrics
    from gateway.metrics import GatewayMetrics

    gateway = GatewayMetrics()
    gateway.expose_replicas([])
    gateway.expose_costs({})
    families = []
    for where, registry in (("gateway", gateway.registry), ("reference engine", EngineMetrics().registry)):
        declared = _declared_labels(registry)
        for family in registry.collect():
            name = family.name + ("_total" if family.type == "counter" else "")
            labels = {label for sample in family.samples for label in sample.labels} - {"le"}
            families.append(
                (name, family.type, family.documentation, sorted(labels | set(declared.get(family.name, ()))), where)
            )
    return families


def metrics() -> str:
    lines = ["| metric | type | labels | exported by | description |", "| --- | --- | --- | --- | --- |"]
    for name, kind, documentation, labels, where in metric_families():
        lines.append(
            f"| `{name}` | {kind} | {', '.join(f'`{x}`' for x in labels)} | {where} | {_cell(documentation)} |"
        )
    return "\n".join(lines) + "\n"


def http() -> str:
    from gateway.app import create_app
    from gateway.settings import GatewaySettings

    schema = create_app(GatewaySettings()).openapi()
    lines = ["| method | path | what it does |", "| --- | --- | --- |"]
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            what = _first_line(operation.get("description") or "") or operation.get("summary", "")
            lines.append(f"| {method.upper()} | `{path}` | {_cell(what)} |")
    return "\n".join(lines) + "\n"


def _declared_labels(registry) -> dict[str, tuple[str, ...]]:
    """Each metric's label names as declared: a labelled metric no request has touched has no samples yet."""
    return {
        name: tuple(getattr(collector, "_labelnames", ()))
        for collector, names in registry._collector_to_names.items()
        for name in names
    }


def _field_default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        return json.dumps(field.default_factory())
    default = field.default
    if hasattr(default, "get_secret_value"):
        return "(secret)"
    return "null" if default is None else json.dumps(default) if not isinstance(default, str) else default


def _split_default(help_text: str) -> tuple[str, str]:
    at = help_text.rfind(DEFAULT)
    if at < 0 or not help_text.endswith(")"):
        return help_text, ""
    return help_text[:at], help_text[at + len(DEFAULT) : -1]


def _first_line(text: str | None) -> str:
    return (text or "").strip().split("\n\n")[0].replace("\n", " ")


def _code(value: str) -> str:
    return f"`{value}`" if value not in ("", None) else ""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")
