"""MkDocs hook: generated reference tables (``adaptivespec.reference.expand_markers``).

``<!-- reference: ... -->`` markers in a page are replaced by tables built from the code (the attrs
config classes, every registered strategy's ``Params``, the CLI's argument parser), so the site
cannot drift from what the code accepts. An unknown marker, or a registered policy, verifier or
source without its section on the strategies page, is logged as a warning, which
``mkdocs build --strict`` turns into a failure.
"""

from __future__ import annotations

import logging

from adaptivespec.reference import expand_markers

log = logging.getLogger("mkdocs.hooks.adaptivespec")


def on_page_markdown(markdown: str, page, config, files) -> str:
    markdown, problems = expand_markers(markdown, page.file.src_uri)
    for problem in problems:
        log.warning(problem)
    return markdown
