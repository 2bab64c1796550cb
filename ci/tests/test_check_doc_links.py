"""scripts/check-doc-links.py, run by `make lint`: every relative link of the repository's Markdown files resolves to
a file (and a `#anchor` to a heading) inside the repository, and no doc cites a file the repository lacks. Each case
builds a small repository in a temporary folder, so the rules are checked apart from today's docs; the last test runs
the check on this repository itself."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "check-doc-links.py"


def _load():
    spec = importlib.util.spec_from_file_location("check_doc_links", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


check = _load()


def repository(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "repo"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def problems(root: Path) -> list[str]:
    return [str(link) for link in check.broken_links(root)]


def test_links_to_files_folders_and_headings_in_the_repository_pass(tmp_path):
    root = repository(tmp_path, {
        "README.md": "# Title\n\n## Set up `make run`, fast!\n\nSee [e2e](e2e/README.md#the-suite), [charts](charts),"
                     " [above](#set-up-make-run-fast), ![img](docs/a.png \"title\"), [web](https://example.com/x)"
                     " and <a href=\"e2e/README.md\">e2e</a>.\n\n[ref]: e2e/README.md\n",
        "e2e/README.md": "# E2E\n\n## The suite\n\nBack to [the top](../README.md#title).\n",
        "charts/x.yaml": "", "docs/a.png": "",
    })
    assert problems(root) == []


def test_pages_under_docs_are_checked_with_links_relative_to_their_own_folder(tmp_path):
    # The README's long sections live in docs/: a link there climbs with ../ to reach the repository's files, and one
    # written as from the README's folder is broken.
    root = repository(tmp_path, {
        "README.md": "# T\n\nSee [health](docs/gpu-health.md#recovery).\n",
        "docs/gpu-health.md": "# GPU health\n\n## Recovery\n\n[schema](../agent/s.json), [top](../README.md#t),"
                              " [moved](agent/s.json)\n",
        "agent/s.json": "{}",
    })
    assert problems(root) == ["docs/gpu-health.md:5: agent/s.json: no such file docs/agent/s.json; fix the path, or "
                              "drop the link if the file is gone"]


def test_a_link_to_a_missing_file_is_named_with_its_file_and_line(tmp_path):
    root = repository(tmp_path, {"README.md": "# T\n\ntext\nsee [gone](docs/gone.md)\n"})
    assert problems(root) == ["README.md:4: docs/gone.md: no such file docs/gone.md; fix the path, or drop the link "
                              "if the file is gone"]


def test_a_link_out_of_the_repository_fails_even_when_the_file_exists(tmp_path):
    (tmp_path / "shared" / "reference").mkdir(parents=True)
    (tmp_path / "shared" / "reference" / "facts.md").write_text("# Facts\n")
    root = repository(tmp_path, {"README.md": "[facts](../shared/reference/facts.md)\n"})
    [problem] = problems(root)
    assert problem.startswith("README.md:1: ../shared/reference/facts.md: points outside the repository")


def test_a_code_span_citing_a_file_the_repository_lacks_fails(tmp_path):
    root = repository(tmp_path, {"e2e/README.md": "# E2E\n\nUpstream: `../shared/reference/facts.md` §2.\n",
                                 "docs/ok.md": "cites `../e2e/README.md`, which is here\n"})
    [problem] = problems(root)
    assert problem.startswith("e2e/README.md:3: `../shared/reference/facts.md`: cites a file that is not in the "
                              "repository")


def test_an_anchor_that_names_no_heading_fails(tmp_path):
    root = repository(tmp_path, {"README.md": "# Title\n\n## Setup\n## Setup\n\n[a](#setup-1) [b](#setup-2)\n"
                                              "[c](other.md#nowhere)\n", "other.md": "# Other\n"})
    assert [p.split(";")[0] for p in problems(root)] == [
        "README.md:6: #setup-2: no heading with anchor #setup-2 in README.md",
        "README.md:7: other.md#nowhere: no heading with anchor #nowhere in other.md"]


def test_code_blocks_build_outputs_and_vendored_copies_are_not_read(tmp_path):
    root = repository(tmp_path, {
        "README.md": "```\n[not a link](nowhere.md)\n```\n\nInline `[not a link](nowhere.md)` too.\n",
        ".venv/lib/README.md": "[x](nowhere.md)\n", "build/README.md": "[x](nowhere.md)\n",
        "ci/tests/k3d-docs/k3d.md": "[x](k3d_cluster.md)\n",
    })
    assert problems(root) == []


def test_this_repositorys_docs_have_no_broken_link():
    out = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
