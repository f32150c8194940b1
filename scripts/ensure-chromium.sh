#!/usr/bin/env bash
# Makes sure headless Chromium and its chromedriver are installed for the inspector's browser tests; installs
# Debian's packages if not. Never fails the build: without them those tests skip and say why.
set -uo pipefail
have() { command -v "$1" >/dev/null || [ -x "$1" ]; }
if { have chromium || have chromium-browser || have google-chrome; } \
    && { have chromedriver || have /usr/lib/chromium/chromedriver; }; then
    echo "chromium: installed"; exit 0
fi
echo "chromium: not installed; installing Debian's chromium and chromium-driver (for the inspector's browser tests)"
if [ "$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq chromium chromium-driver >/dev/null
else sudo -n apt-get update -qq && sudo -n apt-get install -y -qq chromium chromium-driver >/dev/null; fi \
    || echo "chromium: could not install it; the browser tests will be skipped" >&2
exit 0
