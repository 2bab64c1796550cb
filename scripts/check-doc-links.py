#!/usr/bin/env python3
"""Every relative link of the repository's Markdown files lands inside the repository (`make lint` runs it).

What our docs cite must live in the repository, in its own words: a reader of a clone, a release tarball or the
chart's README has nothing else. So for each Markdown file (build outputs, virtual environments and vendored copies
left out, see SKIPPED_DIRS and VENDORED) it checks each link `[text](target)`, image, reference definition
`[id]: target` and HTML href/src:

  - the target is a file or folder inside the repository (a link out of it, e.g. into ../shared/, is an error);
  - a `#anchor` into a Markdown file (or `#anchor` alone, into the file itself) names one of its headings, as GitHub
    makes their anchors, or an HTML id/name in it.

It also refuses a code span citing, by a path that climbs (`../shared/reference/facts.md`), a file the repository
does not hold: the same citation of what a reader does not have, only not written as a link. Links with a scheme (https:, mailto:)
are not fetched: the CI machines have no internet.

    .venv/bin/python scripts/check-doc-links.py [ROOT]     (ROOT: the repository; default: this script's)

Exit status 0 when every link resolves, else 1 with one line per broken link: file:line, the link, why, the fix.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

REPO = Path(__file__).resolve().parent.parent

# Folders that hold no docs of ours: tool caches, virtual environments and build outputs, wherever they are.
SKIPPED_DIRS = {".git", ".venv", "venv", "build", "dist", "node_modules", "vendor", "__pycache__", ".mutate", ".run",
                ".pytest_cache", ".mypy_cache", ".ruff_cache", ".hypothesis", ".import_linter_cache"}
# Markdown copied unchanged from another project, whose links point into that project's tree (not copied).
VENDORED = {
    "ci/tests/k3d-docs": "k3d v5.9.0's command reference, which ci/tests/test_local_cluster.py checks commands against",
}

FENCE = re.compile(r"^\s{0,3}(```|~~~)")
HEADING = re.compile(r"^\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$")
# [text](target) and ![alt](target); the target may be <in brackets> and be followed by a "title".
INLINE_LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(\s*(<[^>]*>|[^\s)]+)(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
REFERENCE_DEFINITION = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
HTML_LINK = re.compile(r"""<(?:a|img)\b[^>]*?\b(?:href|src)\s*=\s*["']([^"']+)["']""", re.IGNORECASE)
HTML_ANCHOR = re.compile(r"""<[a-z]+\b[^>]*?\b(?:id|name)\s*=\s*["']([^"']+)["']""", re.IGNORECASE)
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


@dataclass(frozen=True)
class BrokenLink:
    file: Path
    line: int
    target: str
    problem: str
    fix: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.target}: {self.problem}; {self.fix}"


def markdown_files(root: Path) -> Iterator[Path]:
    vendored = {root / path for path in VENDORED}
    for path in sorted(root.iterdir()):
        if path.is_dir():
            if path.name in SKIPPED_DIRS or path in vendored or path.is_symlink():
                continue
            yield from markdown_files_below(path, vendored)
        elif path.suffix.lower() == ".md":
            yield path


def markdown_files_below(folder: Path, vendored: set[Path]) -> Iterator[Path]:
    for path in sorted(folder.iterdir()):
        if path.is_dir():
            if path.name not in SKIPPED_DIRS and path not in vendored and not path.is_symlink():
                yield from markdown_files_below(path, vendored)
        elif path.suffix.lower() == ".md":
            yield path


def prose_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) of every line outside fenced code blocks, where a link is a link."""
    fence = None
    for number, line in enumerate(text.splitlines(), 1):
        opened = FENCE.match(line)
        if fence is None and opened:
            fence = opened.group(1)
        elif fence is not None and line.strip().startswith(fence):
            fence = None
        elif fence is None:
            yield number, line


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: its text as rendered, lower case, punctuation dropped, spaces as '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link shows its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors_of(markdown: Path) -> set[str]:
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    text = markdown.read_text(encoding="utf-8")
    for _, line in prose_lines(text):
        heading = HEADING.match(line)
        if heading:
            anchor = github_anchor(heading.group(1))
            # GitHub numbers a repeated heading's anchor: setup, setup-1, setup-2.
            count = seen.get(anchor, 0)
            seen[anchor] = count + 1
            anchors.add(anchor if count == 0 else f"{anchor}-{count}")
        anchors.update(HTML_ANCHOR.findall(line))
    return anchors


def links_of(line: str) -> Iterator[str]:
    outside_code = CODE_SPAN.sub(lambda m: " " * len(m.group(0)), line)
    for pattern in (INLINE_LINK, REFERENCE_DEFINITION, HTML_LINK):
        for match in pattern.finditer(outside_code):
            yield match.group(1).strip("<>")


def inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def check_link(markdown: Path, line: int, target: str, root: Path, shown: Path) -> BrokenLink | None:
    if SCHEME.match(target):
        return None  # external (https:, mailto:): not fetched, no internet here
    path_part, _, anchor = target.partition("#")
    path_part = unquote(path_part)
    if path_part.startswith("/"):
        resolved = (root / path_part.lstrip("/")).resolve()  # GitHub reads /x as the repository's root
    else:
        resolved = (markdown.parent / path_part).resolve() if path_part else markdown.resolve()
    if not inside(resolved, root.resolve()):
        return BrokenLink(shown, line, target, "points outside the repository",
                          "what the docs cite must be in the repository: link to a doc in it, or state the fact "
                          "here in our own words")
    if not resolved.exists():
        return BrokenLink(shown, line, target, f"no such file {resolved.relative_to(root.resolve())}",
                          "fix the path, or drop the link if the file is gone")
    if anchor and resolved.is_file() and resolved.suffix.lower() == ".md" and anchor not in anchors_of(resolved):
        return BrokenLink(shown, line, target, f"no heading with anchor #{anchor} in "
                          f"{resolved.relative_to(root.resolve())}",
                          "link to one of its headings (GitHub's anchor: lower case, punctuation dropped, spaces "
                          "as -) or rename the heading back")
    return None


def cited_paths_missing(markdown: Path, line: int, text: str, root: Path, shown: Path) -> Iterator[BrokenLink]:
    """A code span citing a file by a path that climbs (`../x.md`) must name a file of the repository: such a path
    is a citation of another file, and one outside the repository (or written from elsewhere, as `../shared/` from
    the repository's folder) is one a reader lacks."""
    for match in CODE_SPAN.finditer(text):
        cited = match.group(2).strip()
        if cited.startswith("../") and " " not in cited:
            resolved = (markdown.parent / cited.split("#")[0]).resolve()
            if not inside(resolved, root.resolve()) or not resolved.exists():
                yield BrokenLink(shown, line, f"`{cited}`", "cites a file that is not in the repository",
                                 "state what it says here in our own words, or cite a doc in the repository")


def broken_links(root: Path) -> list[BrokenLink]:
    broken = []
    for markdown in markdown_files(root):
        shown = markdown.relative_to(root)
        for number, line in prose_lines(markdown.read_text(encoding="utf-8")):
            for target in links_of(line):
                problem = check_link(markdown, number, target, root, shown)
                if problem:
                    broken.append(problem)
            broken.extend(cited_paths_missing(markdown, number, line, root, shown))
    return broken


def main(argv: list[str]) -> int:
    root = Path(argv[0]).resolve() if argv else REPO
    broken = broken_links(root)
    for link in broken:
        print(link)
    if broken:
        print(f"{len(broken)} broken link(s) in the Markdown files of {root}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
