"""MkDocs hook: the reference pages' ``<!-- reference: NAME -->`` markers become tables generated from the code
(``specprefill.reference``), at every build, so the pages cannot drift from the code."""

from __future__ import annotations

import re

MARKER = re.compile(r"<!-- reference: (\w+) -->")


def on_page_markdown(markdown: str, page, config, files) -> str:
    from specprefill.reference import markdown as generated

    return MARKER.sub(lambda match: generated(match.group(1)), markdown)
