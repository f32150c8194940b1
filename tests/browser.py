"""A real headless Chromium for the page tests, driven through Selenium and Debian's chromedriver (same version
as the browser, so nothing is downloaded). ``make test`` installs both where it can; without them the browser
tests skip and say why."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
DRIVERS = ("chromedriver", "/usr/lib/chromium/chromedriver")


def find_chromium() -> tuple[str, str] | None:
    """(browser, driver) executables, or None."""
    browser = next((found for name in BROWSERS if (found := shutil.which(name))), None)
    driver = next((found for name in DRIVERS if (found := shutil.which(name))), None)
    return (browser, driver) if browser and driver else None


class Browser:
    """One headless browser window (1280×900) for one test."""

    def __init__(self) -> None:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        found = find_chromium()
        assert found is not None, "no Chromium with chromedriver installed"
        options = webdriver.ChromeOptions()
        options.binary_location = found[0]
        for flag in (
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--window-size=1280,900",
            "--force-device-scale-factor=1",
        ):
            options.add_argument(flag)
        self.driver = webdriver.Chrome(options=options, service=Service(executable_path=found[1]))

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc) -> None:
        self.driver.quit()

    def open(self, url: str) -> None:
        self.driver.get(url)

    def evaluate(self, expression: str):
        return self.driver.execute_script(f"return ({expression});")

    def wait_for(self, condition: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.evaluate(condition):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{condition!r} did not hold within {timeout:.0f} s; "
                    f"page state {self.evaluate('document.body.dataset.state')!r}"
                )
            time.sleep(0.05)

    def press(self, key: str) -> None:
        """A key press on the focused element (``ArrowRight``, ``Home``...), as a user's keyboard sends it."""
        from selenium.webdriver.common.action_chains import ActionChains
        from selenium.webdriver.common.keys import Keys

        ActionChains(self.driver).send_keys(
            getattr(Keys, {"ArrowRight": "ARROW_RIGHT", "ArrowLeft": "ARROW_LEFT"}.get(key, key.upper()))
        ).perform()

    def screenshot(self, path: Path) -> None:
        self.driver.save_screenshot(str(path))
