"""MkDocs hook (mkdocs.yml `hooks:`): links from a docs page to a file of the repository outside docs/
(benchmarks/README.md, a package's README, deploy/...) are not pages of the site, so MkDocs cannot check or
rewrite them. This hook checks that each such file exists (a missing one fails the build) and turns the link
into a plain HTML link that reaches the file in the checkout when the site is built into site/ at the
repository root (the default: `mkdocs build`), e.g. browsed with `python -m http.server` from the root.
Links between docs pages are left to MkDocs, whose `--strict` build fails on a broken one."""

from __future__ import annotations

import html
import os
import posixpath
import re
from pathlib import Path

from mkdocs.exceptions import PluginError

ROOT = Path(__file__).resolve().parents[1]
# [text](target) outside code spans and fenced blocks; text without brackets, target without spaces
LINK = re.compile(r"(?<!!)\[([^\[\]]+)\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


def outside_target(src_uri: str, target: str) -> str | None:
    """The repository path a relative link leaves docs/ for, else None."""
    if re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith(("#", "/")):
        return None
    path = target.split("#", 1)[0]
    repo_path = posixpath.normpath(posixpath.join("docs", posixpath.dirname(src_uri), path))
    return None if repo_path == "docs" or repo_path.startswith("docs/") else repo_path


def on_page_markdown(markdown, page, config, files):
    site_dir = Path(config["site_dir"]).resolve()
    page_dir = (site_dir / page.file.dest_uri).parent
    out, fenced = [], False
    for line in markdown.split("\n"):
        if FENCE.match(line.lstrip()):
            fenced = not fenced
        if not fenced:
            line = _rewrite(line, page.file.src_uri, page_dir)
        out.append(line)
    return "\n".join(out)


def _rewrite(line: str, src_uri: str, page_dir: Path) -> str:
    spans = [m.span() for m in re.finditer(r"`[^`]*`", line)]

    def fix(m):
        if any(start <= m.start() < end for start, end in spans):  # inside a code span: not a link
            return m.group(0)
        text, target = m.group(1), m.group(2)
        repo_path = outside_target(src_uri, target)
        if repo_path is None:
            return m.group(0)
        if repo_path.startswith("..") or not (ROOT / repo_path).exists():
            raise PluginError(f"{src_uri}: link {target!r}: {repo_path} does not exist in the repository")
        anchor = "#" + target.split("#", 1)[1] if "#" in target else ""
        href = Path(os.path.relpath(ROOT / repo_path, page_dir)).as_posix() + anchor
        return f'<a href="{html.escape(href)}">{text}</a>'

    return LINK.sub(fix, line)
