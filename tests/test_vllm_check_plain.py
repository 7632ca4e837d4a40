"""scripts/vllm_check.py's --plain-from: a plain vLLM run reused only when it is the same run.

Runs in the default suite: the function under test needs no vLLM (the script imports vLLM only
inside its engine phases).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("vllm_check", REPO / "scripts" / "vllm_check.py")
vllm_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(vllm_check)

SETTINGS = {
    "target": "/t",
    "method": "eagle3",
    "draft": "/d",
    "k": 3,
    "prompts": "/p.jsonl",
    "split": "heldout",
    "num_prompts": 2,
    "max_new_tokens": 64,
    "dtype": "float32",
}
PROMPTS = [{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [4, 5]}]
PLAIN = {"phase": "plain", "tokens_per_second": 10.0, "per_prompt": []}


def _earlier(tmp_path: Path, **changes) -> Path:
    settings = {**SETTINGS, "method": "none", "draft": None, **changes.pop("settings", {})}
    data = {"settings": settings, "prompt_token_ids": [p["prompt_token_ids"] for p in PROMPTS]}
    data.update({"plain": PLAIN, **changes})
    path = tmp_path / "earlier.json"
    path.write_text(json.dumps(data))
    return path


def test_the_same_plain_run_is_reused_whatever_the_method(tmp_path):
    path = _earlier(tmp_path)
    plain = vllm_check.reused_plain(str(path), SETTINGS, PROMPTS)
    assert plain["tokens_per_second"] == 10.0 and plain["reused_from"] == str(path)


@pytest.mark.parametrize(
    ("setting", "value"),
    [("dtype", "bfloat16"), ("max_new_tokens", 32), ("num_prompts", 3), ("target", "/other")],
)
def test_another_plain_run_is_refused_naming_what_differs(tmp_path, setting, value):
    path = _earlier(tmp_path, settings={setting: value})
    with pytest.raises(ValueError, match=f"not the same plain run \\({setting} "):
        vllm_check.reused_plain(str(path), SETTINGS, PROMPTS)


def test_prompts_that_render_differently_are_refused(tmp_path):
    path = _earlier(tmp_path, prompt_token_ids=[[1, 2, 3], [4, 6]])
    with pytest.raises(ValueError, match="other token ids"):
        vllm_check.reused_plain(str(path), SETTINGS, PROMPTS)


def test_a_results_file_without_a_plain_run_is_refused(tmp_path):
    path = _earlier(tmp_path, plain=None)
    with pytest.raises(ValueError, match="no plain run"):
        vllm_check.reused_plain(str(path), SETTINGS, PROMPTS)


def test_the_flag_is_a_usage_error_for_a_missing_file(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        vllm_check.parse_args(["--plain-from", str(tmp_path / "none.json")])
    assert exc.value.code == 2
    assert "--plain-from: no file" in capsys.readouterr().err
