"""The benchmarks that write docs replace only their own block and say where figures come from."""
from __future__ import annotations

import re

from loadtest.docgen import commit, machine, write_block


def test_a_generated_block_is_replaced_and_the_prose_around_it_kept(tmp_path):
    doc = tmp_path / "bench.md"
    doc.write_text("# Title\n\nHand-written analysis.\n\n<!-- b:start -->\nold figures\n"
                   "<!-- b:end -->\n\nMore prose.\n")
    write_block(doc, "b", ["new figures", "| a | b |"])
    assert doc.read_text() == ("# Title\n\nHand-written analysis.\n\n<!-- b:start -->\n"
                               "new figures\n| a | b |\n<!-- b:end -->\n\nMore prose.\n")


def test_a_doc_without_the_block_gets_it_appended(tmp_path):
    doc = tmp_path / "bench.md"
    doc.write_text("# Title\n\nProse.")
    write_block(doc, "b", ["figures"])
    assert doc.read_text() == "# Title\n\nProse.\n<!-- b:start -->\nfigures\n<!-- b:end -->\n"


def test_provenance_names_a_commit_and_a_cpu_model():
    assert re.fullmatch(r"[0-9a-f]{7,}(\+changes)?", commit())
    cpu = machine("cpu")
    assert re.search(r", \d+ cores$", cpu) and not cpu.startswith("unknown"), cpu
