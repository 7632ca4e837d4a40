"""Every figure README.md and docs/ tie to a result file matches that file (issue 51: figures a
user can trust and rerun). The markers and their rules: ``scripts/check_figures.py``."""

from __future__ import annotations

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import check_figures  # noqa: E402

sys.path.pop(0)

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def test_every_marked_figure_matches_its_result_file():
    count, problems = check_figures.check_docs(DOCS)
    assert not problems, "\n".join(problems)
    readme, _ = check_figures.figures((REPO / "README.md").read_text(), "README.md")
    assert len(readme) >= 12  # the README's results table is marked, figure by figure
    assert count >= len(readme)


def test_a_figure_changed_by_hand_or_a_missing_file_fails():
    text = (REPO / "README.md").read_text()
    found, _ = check_figures.figures(text, "README.md")
    first = found[0]
    assert check_figures.check(first) is None
    # The figure one unit off in its last shown decimal.
    shown = first.shown
    last = int(shown[-1])
    changed = shown[:-1] + str((last + 1) % 10)
    lines = text.splitlines()
    line = lines[first.line - 1]
    mark = line.index("<!-- fig")
    at = line.rindex(shown, 0, mark)
    lines[first.line - 1] = line[:at] + changed + line[at + len(shown) :]
    edited, _ = check_figures.figures("\n".join(lines), "README.md")
    problem = check_figures.check(edited[0])
    assert problem is not None and f"shows {changed} but {first.file}:{first.path}" in problem
    # A file that is not there, a field that is not in it, a marker with no figure before it.
    gone = check_figures.Figure("doc.md", 3, "1.30", "bench/no_such.json", "a.b", ())
    assert check_figures.check(gone) == "doc.md:3: bench/no_such.json does not exist"
    wrong = check_figures.Figure("doc.md", 4, "1.30", first.file, "no_such_field", ())
    assert "no key 'no_such_field'" in check_figures.check(wrong)
    _, problems = check_figures.figures("no number <!-- fig x.json:a -->", "doc.md")
    assert problems == ["doc.md:1: no figure before the marker 'x.json:a'"]


def test_paths_select_by_key_index_and_match():
    data = {"methods": [{"method": "eagle3-chain[x]", "v": 1.5}, {"method": "tree", "v": [2, 3]}]}
    assert check_figures.resolve(data, "methods[method^=eagle3-chain].v") == 1.5
    assert check_figures.resolve(data, "methods[method=tree].v[1]") == 3
    assert check_figures.resolve(data, "methods[0].v") == 1.5
    text = "<!-- figfile Q = r.json -->\nτ 1.42 and **1.30×**<!-- fig Q:methods[0].v --> or 12 %"
    found, problems = check_figures.figures(text, "d.md")
    assert not problems and [(f.shown, f.file) for f in found] == [("1.30", "r.json")]
    assert re.fullmatch(r"\d[\d,]*", check_figures.NUMBER.findall("1,234 steps")[0])
    example = "write `τ 1.40<!-- fig N:a.b -->` after a figure"  # inline code: an example
    assert check_figures.figures(example, "d.md") == ([], [])


def test_a_key_with_brackets_is_read_as_written():
    data = {"results": {"vllm[auto]": {"tok_s": 75.8}, "vllm": {"tok_s": 1.0}}}
    assert check_figures.resolve(data, 'results["vllm[auto]"].tok_s') == 75.8
    try:
        check_figures.resolve(data, 'results["vllm[0-1]"].tok_s')
    except KeyError as exc:
        assert "vllm[0-1]" in str(exc)
    else:
        raise AssertionError("a missing quoted key resolved")


def test_untied_lists_unmarked_results_but_not_settings_code_or_marked_ones():
    text = "\n".join(
        [
            "τ 1.42<!-- fig Q:a --> and 1.30× plain, 12 % more",  # 1.30 and 12 are unmarked
            "a timeout of 600 s <!-- not measured -->",  # a setting, said once for the line
            "`--budget 30 min` in code, and the 2 cores",  # code; a count with no unit
            "```",
            "1.99× inside a fenced block",
            "```",
        ]
    )
    rows = check_figures.untied(text, "d.md")
    assert [r.split(" | ")[0] for r in rows] == ["d.md:1: 1.30", "d.md:1: 12"]


def test_the_readme_has_no_unmarked_result():
    rows = check_figures.untied((REPO / "README.md").read_text(), "README.md")
    assert not rows, "tie these figures or mark their lines <!-- not measured -->:\n" + "\n".join(
        rows
    )


def test_a_range_reads_two_figures_and_a_minus_sign_stays_one():
    assert check_figures.NUMBER.findall("1.033-1.062× and −8.8 % or -3") == [
        "1.033",
        "1.062",
        "−8.8",
        "-3",
    ]
    found, _ = check_figures.figures("τ 1.03-1.06<!-- fig r.json:a -->", "d.md")
    assert [f.shown for f in found] == ["1.06"]
