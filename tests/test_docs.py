"""The docs' links hold: every relative link in README.md, tutorial.md, the guides of docs/ and the
reports of experiments/ and benchmarks/ names a file that exists and, for a markdown file, a heading
in it (GitHub's anchors)."""
import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def anchor(heading):
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def broken_links(md_files):
    bad = []
    for md in md_files:
        with open(md) as f:
            text = f.read()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, name = target.partition("#")
            full = os.path.normpath(os.path.join(os.path.dirname(md), path)) if path else md
            if not os.path.exists(full):
                bad.append(f"{os.path.relpath(md, ROOT)}: {target} (no such file)")
            elif name and full.endswith(".md"):
                with open(full) as f:
                    headings = {anchor(h) for h in re.findall(r"^#+ (.+)$", f.read(), re.M)}
                if name not in headings:
                    bad.append(f"{os.path.relpath(md, ROOT)}: {target} (no such heading)")
    return bad


def test_every_relative_link_in_the_docs_resolves():
    files = [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "tutorial.md")]
    for folder in ("docs", "experiments", "benchmarks"):
        files += sorted(glob.glob(os.path.join(ROOT, folder, "*.md")))
    assert len(files) > 12
    assert broken_links(files) == []


def test_a_broken_link_is_found(tmp_path):
    (tmp_path / "b.md").write_text("# Results: held (level 2)\n")
    (tmp_path / "a.md").write_text("[ok](b.md#results-held-level-2) [gone](c.md) [moved](b.md#results) "
                                   "[web](https://example.com/x.md)\n")
    assert [b.split(": ", 1)[1] for b in broken_links([str(tmp_path / "a.md")])] == [
        "c.md (no such file)", "b.md#results (no such heading)"]
