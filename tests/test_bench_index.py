"""bench/ is named for what it measures and every result in it is indexed in its folder's README."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import bench_index  # noqa: E402


def _tracked(prefix: str) -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", prefix], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    return [p for p in out if (REPO / p).exists()]


def test_no_issue_numbers_in_bench_names():
    """A folder or file is named for what it measures, not for the issue that asked for it."""
    bad = [p for p in _tracked("bench") if re.search(r"(^|/)issue\d+", p)]
    assert not bad, bad[:5]


def test_no_raw_logs_uncompressed():
    bad = [p for p in _tracked("bench") if p.endswith(".log")]
    assert not bad, f"compress these (gzip -9 -n): {bad[:5]}"


def test_every_result_is_indexed_in_its_folders_readme():
    """Every result JSON under bench/FOLDER/ has its row in bench/FOLDER/README.md, below the
    generated-index marker, and every file the index links exists."""
    problems = []
    for folder in sorted(p for p in bench_index.BENCH.iterdir() if p.is_dir()):
        readme = folder / "README.md"
        if not readme.is_file():
            problems.append(f"{folder.name}: no README.md")
            continue
        text = readme.read_text()
        if bench_index.MARKER not in text:
            problems.append(f"{folder.name}/README.md: no generated index")
            continue
        head, index = text.split(bench_index.MARKER, 1)
        if not head.strip():
            problems.append(f"{folder.name}/README.md: no hand-written part")
        linked = set(re.findall(r"\]\(([^)]+)\)", index))
        for path in bench_index.results(folder):
            rel = path.relative_to(folder).as_posix()
            if rel not in linked:
                problems.append(f"{folder.name}/README.md: {rel} not indexed")
        for rel in linked:
            if not (folder / rel).is_file():
                problems.append(f"{folder.name}/README.md: links {rel}, which does not exist")
    assert not problems, "\n".join(problems[:20]) + "\n(run python scripts/bench_index.py)"


def test_index_rows_say_what_is_missing_and_hide_machine_paths(tmp_path, monkeypatch):
    """A row gives the command with the run's machine paths as the scripts' variables, the
    machine's CPU kind (or "not recorded"), the commit with its dirty flag, the date."""
    import json

    folder = tmp_path / "bench" / "x"
    (folder / "avx2").mkdir(parents=True)
    full = {
        "command": "/root/.pyenv/versions/3.11.7/bin/draftsmith evaluate --prompts "
        "../shared/data/alpaca_2k.jsonl --out /work/runs/e.json",
        "git_commit": "abc1234",
        "git_dirty": True,
        "date": "2026-12-06T10:00:00+00:00",
        "machine": {
            "cpu_model": "AMD EPYC",
            "cpu_flags": ["avx2", "avx512f", "avx512_bf16"],
            "cpu_count": 2,
        },
    }
    (folder / "full.json").write_text(json.dumps(full))
    (folder / "avx2" / "old.json").write_text(json.dumps({"machine": {"cpu_count": 2}}))
    (folder / "list.json").write_text("[1, 2]")
    monkeypatch.setattr(bench_index, "BENCH", tmp_path / "bench")
    monkeypatch.setattr(bench_index, "first_seen", lambda path: None)
    rows = {p.name: bench_index.row(p, folder) for p in bench_index.results(folder)}
    assert set(rows) == {"full.json", "old.json"}
    assert "`draftsmith evaluate --prompts $ALPACA --out $RUNS/e.json`" in rows["full.json"]
    assert "AMD EPYC, avx512_bf16, 2 cores" in rows["full.json"]
    assert "`abc1234` (dirty)" in rows["full.json"] and "2026-12-06" in rows["full.json"]
    assert "flags not recorded (folder: AVX2 only)" in rows["old.json"]
    assert rows["old.json"].count("not recorded") == 4  # command, flags, commit, date


# Issue 51 (2026-12-06) made every result file record its commit; nothing written since may
# lack one.
RECORDS_COMMIT_SINCE = "2026-12-06"


def test_results_written_since_commits_were_recorded_name_their_commit():
    import json

    missing = []
    for path in bench_index.results(bench_index.BENCH):
        data = json.loads(path.read_text())
        date = str(data.get("date") or "")[:10]
        if date >= RECORDS_COMMIT_SINCE and not data.get("git_commit"):
            missing.append(str(path.relative_to(REPO)))
    assert not missing, missing[:10]


def test_the_default_cost_profile_of_an_installed_checkout_exists(tmp_path, monkeypatch):
    """Outside a checkout (another working directory), bench falls back to the verify-cost
    profile of the checkout draftsmith is installed from: that file must be where it looks."""
    from draftsmith.train.report import recommend

    monkeypatch.chdir(tmp_path)
    assert recommend.DEFAULT_COST_PROFILES[1].is_file(), recommend.DEFAULT_COST_PROFILES[1]
    assert recommend.default_cost_profile() == recommend.DEFAULT_COST_PROFILES[1]
