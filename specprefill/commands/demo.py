"""``specprefill demo-models DIR``."""

from __future__ import annotations

from pathlib import Path

from pydantic_settings import BaseSettings, CliPositionalArg

from common.options import SETTINGS_CONFIG


class DemoModels(BaseSettings):
    """Write the demo draft/target pair into DIR (DIR/draft, DIR/target), made locally."""

    model_config = SETTINGS_CONFIG
    dir: CliPositionalArg[Path]
    seed: int = 0

    def cli_cmd(self) -> None:
        from specprefill.lab.demo_models import write_demo_models

        out = write_demo_models(self.dir, seed=self.seed)
        print(f"wrote {out / 'draft'} and {out / 'target'}")
