"""The docs cannot drift or break: the generated reference pages (docs/reference/flags.md, metrics.md) equal
what docs/gen_reference.py writes from the code now; the MkDocs site builds with --strict (a broken link
between pages, or to a missing heading, fails it); every relative link in README.md and docs/ reaches an
existing file, and a heading that exists there (by its anchor as GitHub and MkDocs both write it)."""

from __future__ import annotations

import re
import subprocess
import sys
import unicodedata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GENERATOR = "docs/gen_reference.py"
REGENERATE = f".venv/bin/python {GENERATOR}"

LINK = re.compile(r"(?<!!)\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def prose_lines(text: str):
    """(line number, line) outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(text.split("\n"), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def links(text: str):
    """(line number, target) of each Markdown link outside code blocks and code spans."""
    for number, line in prose_lines(text):
        spans = [m.span() for m in re.finditer(r"`[^`]*`", line)]
        for m in LINK.finditer(line):
            if not any(start <= m.start() < end for start, end in spans):
                yield number, m.group(1)


def github_anchor(heading: str) -> str:
    text = re.sub(r"`([^`]*)`", r"\1", heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def mkdocs_anchor(heading: str) -> str:
    """Python-Markdown's toc slugify (what MkDocs writes)."""
    text = re.sub(r"`([^`]*)`", r"\1", heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(path: Path, slug) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose_lines(path.read_text(encoding="utf-8")):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}" if slug is github_anchor else f"{base}_{n}")
    return out


def broken_links() -> list[str]:
    docs = (ROOT / "docs").resolve()
    broken = []
    for source in markdown_files():
        for number, target in links(source.read_text(encoding="utf-8")):
            if re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target):  # http:, mailto: ...
                continue
            where = f"{source.relative_to(ROOT)}:{number}: {target}"
            path, _, anchor = target.partition("#")
            dest = (source.parent / path).resolve() if path else source
            if target.startswith("/") or not dest.is_relative_to(ROOT):
                broken.append(f"{where} (leaves the repository or is absolute)")
                continue
            if not dest.exists():
                broken.append(f"{where} (no such file)")
                continue
            if not anchor or dest.suffix != ".md":
                continue
            # Pages of the site are read through both GitHub's anchors and MkDocs'; other files through GitHub's.
            in_site = dest.is_relative_to(docs)
            if anchor not in anchors(dest, github_anchor) or (in_site and anchor not in anchors(dest, mkdocs_anchor)):
                broken.append(f"{where} (no heading with this anchor" + (" in GitHub's and MkDocs' spelling)"
                                                                         if in_site else ")"))
    return broken


def test_every_relative_link_reaches_a_file_and_a_heading():
    assert broken_links() == []


def test_the_generated_reference_is_up_to_date(tmp_path):
    subprocess.run([sys.executable, str(ROOT / GENERATOR), "--out", str(tmp_path)], cwd=ROOT, check=True,
                   capture_output=True, text=True)
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.md"))
    assert [str(p) for p in generated] == ["reference/flags.md", "reference/metrics.md"]
    stale = [str(p) for p in generated
             if (ROOT / "docs" / p).read_text(encoding="utf-8") != (tmp_path / p).read_text(encoding="utf-8")]
    assert stale == [], f"docs/{', docs/'.join(stale)} differ from the code: run `{REGENERATE}` and commit the result"


def test_the_site_builds_strictly(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}{done.stderr}"
    assert (tmp_path / "site/reference/flags/index.html").exists()
