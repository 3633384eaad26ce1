"""`tandem bench chaos --write-doc` rewrites the chaos figures and keeps the doc's own `## ` sections after them
(docs/reliability.md's planner measurements)."""

from __future__ import annotations

from tandem.common.bench.chaos import _sections_after


def test_the_docs_own_sections_survive_a_rewrite(tmp_path):
    doc = tmp_path / "reliability.md"
    assert _sections_after(str(doc)) == ""  # no doc yet
    doc.write_text("# Reliability\n\nold figures\n")
    assert _sections_after(str(doc)) == ""
    doc.write_text("# Reliability\n\nold figures\n\n## Planner\n\nnumbers\n")
    assert _sections_after(str(doc)) == "\n## Planner\n\nnumbers\n"
