"""Medusa heads: identity start, loss alignment, training, trees, proposing, exports."""

from __future__ import annotations

import copy
import itertools
import json

import pytest
import torch

from draftsmith.heads.medusa import (
    ACCURACY_FILE,
    MedusaHeads,
    MedusaProposer,
    build_tree,
    check_choices,
    expected_acceptance_length,
    load_medusa,
    medusa_proposer,
)
from draftsmith.heads.sampling import SamplingParams
from draftsmith.train.decoding.speculative import generate
from draftsmith.train.export.medusa import (
    export_medusa_original,
    export_medusa_vllm,
    load_medusa_export,
)
from draftsmith.train.objectives.medusa import (
    Medusa1Objective,
    Medusa2Objective,
    accuracy_report,
    add_lora,
    head_label_positions,
    medusa_head_losses,
    rank_counts,
    warmup_cosine,
)
from tests.conftest import tiny_llama

V, H = 64, 32


def perturbed(heads: MedusaHeads, seed: int = 0, scale: float = 0.05) -> MedusaHeads:
    """Heads with random residual weights (a stand-in for trained ones)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return heads


def final_hidden(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, output_hidden_states=True).hidden_states[-1]


# --------------------------------------------------------------------------------------------
# Heads
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("share", [False, True])
def test_heads_start_as_the_targets_lm_head(target, share):
    heads = MedusaHeads.from_target(target, num_heads=3, num_layers=2, share_lm_head=share)
    h = torch.randn(5, 7, H)
    want = target.get_output_embeddings()(h)
    logits = heads(h)
    assert logits.shape == (3, 5, 7, V)
    for k in range(3):
        assert torch.equal(logits[k], want), k  # exactly: W = 0, b = 0 and SiLU(0) = 0
    # A trained head is no longer the identity (the test above can fail).
    assert not torch.equal(perturbed(heads).head_logits(0, h), want)


def test_parameter_names_follow_vllm(target):
    heads = MedusaHeads.from_target(target, num_heads=2, num_layers=2)
    names = set(heads.state_dict())
    assert names == {
        *(
            f"blocks.{h}.layers.{i}.{w}"
            for h in range(2)
            for i in range(2)
            for w in ("weight", "bias")
        ),
        "lm_heads.0.weight",
        "lm_heads.1.weight",
    }
    shared = MedusaHeads.from_target(target, num_heads=2, num_layers=1, share_lm_head=True)
    assert "lm_head.weight" in shared.state_dict()
    assert not shared.lm_head.weight.requires_grad  # the target's projection stays frozen
    # Each residual layer is its own module (not one module repeated, as in the reference).
    assert heads.blocks[0].layers[0] is not heads.blocks[0].layers[1]


def test_save_and_load_roundtrip(target, tmp_path):
    heads = perturbed(MedusaHeads.from_target(target, num_heads=3, num_layers=2))
    heads.save(tmp_path / "h", extra={"stage": "medusa1"})
    loaded = load_medusa(tmp_path / "h")
    h = torch.randn(4, H)
    assert torch.equal(loaded(h), heads(h))
    assert json.loads((tmp_path / "h" / "config.json").read_text())["stage"] == "medusa1"


# --------------------------------------------------------------------------------------------
# Losses
# --------------------------------------------------------------------------------------------


def test_label_positions_are_t_plus_k_plus_2():
    loss_mask = torch.tensor([[0, 0, 0, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1, 1]])
    b, t = head_label_positions(loss_mask, 0)
    # Head 0 at position t is supervised where the token at t+2 is.
    assert list(zip(b.tolist(), t.tolist(), strict=True)) == [
        (0, 1),
        (0, 2),
        (0, 3),
        (1, 0),
        (1, 1),
        (1, 2),
        (1, 3),
        (1, 4),
    ]
    b, t = head_label_positions(loss_mask, 2)  # token t+4
    assert list(zip(b.tolist(), t.tolist(), strict=True)) == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
        (1, 2),
    ]


def one_hot_heads(num_heads: int, vocab: int, scale: float = 50.0) -> MedusaHeads:
    """Heads that read the token id straight off a one-hot hidden state (H = V)."""
    heads = MedusaHeads(num_heads, 1, vocab, vocab)
    with torch.no_grad():
        for proj in heads.projections():
            proj.weight.copy_(scale * torch.eye(vocab))
    return heads


def test_loss_alignment_on_a_hand_built_example():
    vocab = 12
    ids = torch.tensor([[3, 7, 1, 9, 4, 4, 11, 2, 5, 0]])
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1, 1]])
    heads = one_hot_heads(3, vocab)
    T = ids.shape[1]
    for k in range(3):
        # Hidden state at t encodes the token at t+k+2: only head k can be right everywhere.
        hidden = torch.zeros(1, T, vocab)
        for t in range(T - k - 2):
            hidden[0, t, ids[0, t + k + 2]] = 1.0
        out = medusa_head_losses(heads, hidden, ids, mask, labels="data", decay=0.8)
        counts = [int(mask[0, j + 2 :].sum()) for j in range(3)]
        assert out["count"].tolist() == counts
        assert out["correct1"][k] == counts[k] and out["head_loss"][k] < 1e-6
        others = [j for j in range(3) if j != k]
        assert all(out["correct1"][j] < counts[j] for j in others)
        want = sum(0.8**j * out["head_loss"][j] for j in range(3))
        torch.testing.assert_close(out["loss"].detach(), want)


def test_target_labels_are_the_targets_next_token_at_t_plus_k_plus_1():
    """A teacher reading token t+1 off h_t makes target labels equal the data labels."""
    vocab = 10
    ids = torch.tensor([[2, 5, 7, 1, 8, 3, 3, 9, 0, 4]])
    mask = torch.ones_like(ids)
    T = ids.shape[1]
    hidden = torch.zeros(1, T, vocab)
    for t in range(T - 1):
        hidden[0, t, ids[0, t + 1]] = 1.0  # the "target" predicts the data's next token
    heads = perturbed(one_hot_heads(3, vocab, scale=1.0), scale=0.3)

    def teacher(h):
        return 50.0 * h  # lm_head: argmax = the one-hot index

    data = medusa_head_losses(heads, hidden, ids, mask, labels="data")
    tgt = medusa_head_losses(heads, hidden, ids, mask, labels="target", teacher=teacher)
    for key in ("loss", "head_loss", "correct1", "correct5", "count"):
        torch.testing.assert_close(tgt[key].detach(), data[key].detach())
    # A teacher that is off by one position gives different labels (the alignment matters).
    shifted = hidden.roll(1, dims=1)
    off = medusa_head_losses(heads, shifted, ids, mask, labels="target", teacher=teacher)
    assert not torch.allclose(off["loss"], data["loss"])
    soft = medusa_head_losses(heads, hidden, ids, mask, labels="target_soft", teacher=teacher)
    torch.testing.assert_close(soft["loss"], data["loss"], atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="needs the target's lm_head"):
        medusa_head_losses(heads, hidden, ids, mask, labels="target")


def test_head_losses_decrease_on_a_fixed_batch(target):
    torch.manual_seed(0)
    ids = torch.randint(0, V, (2, 24))
    mask = torch.zeros_like(ids)
    mask[:, 6:] = 1
    hidden = final_hidden(target, ids)
    lm_head = target.get_output_embeddings()
    heads = MedusaHeads.from_target(target, num_heads=3, num_layers=1)
    objective = Medusa1Objective(heads, labels="data")
    opt = torch.optim.AdamW([p for p in heads.parameters() if p.requires_grad], lr=1e-2)
    first = None
    for _ in range(30):
        out = objective(hidden, ids, mask, teacher=lm_head)
        if first is None:
            first = out["head_loss"].clone()
        opt.zero_grad()
        out["loss"].backward()
        opt.step()
    last = objective(hidden, ids, mask)["head_loss"]
    assert (last < 0.5 * first).all(), (first, last)


def test_medusa2_trains_only_lora_and_heads(target):
    torch.manual_seed(0)
    model = copy.deepcopy(target)
    base_before = {k: v.clone() for k, v in model.state_dict().items()}
    peft_model = add_lora(model, r=4, alpha=8, dropout=0.0)
    heads = MedusaHeads.from_target(target, num_heads=2, num_layers=1)
    heads_before = {k: v.clone() for k, v in heads.state_dict().items()}
    objective = Medusa2Objective(peft_model, heads, target_loss="kl", head_weight=0.5)
    trainable = {n for n, p in objective.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or n.startswith("heads.") for n in trainable)
    params = [p for p in objective.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    ids = torch.randint(0, V, (2, 16))
    attn = torch.ones_like(ids)
    mask = torch.ones_like(ids)
    lora = {n: p for n, p in objective.named_parameters() if "lora_" in n}
    for step in range(4):
        warm = step == 0
        before = {n: p.detach().clone() for n, p in lora.items()}
        out = objective(ids, attn, mask, heads_only=warm)
        if step == 1:  # adapters start at B = 0: the adapted target equals the original
            assert float(out["target_loss"]) < 1e-8
        opt.zero_grad()
        out["loss"].backward()
        opt.step()
        if warm:  # heads-only warm-up: the adapters get no gradient and do not move
            assert all(p.grad is None for p in lora.values())
            assert all(torch.equal(before[n], p) for n, p in lora.items())
    assert any(not torch.equal(before[n], p) for n, p in lora.items())
    # The base weights are bit-identical; only adapters and heads changed.
    base_after = {
        k.replace("base_model.model.", "").replace(".base_layer", ""): v
        for k, v in peft_model.state_dict().items()
        if "lora_" not in k
    }
    assert base_after.keys() == base_before.keys()
    assert all(torch.equal(base_after[k], base_before[k]) for k in base_before)
    assert any(not torch.equal(heads_before[k], v) for k, v in heads.state_dict().items())


def test_warmup_cosine_schedule():
    f = warmup_cosine(4, 20)
    assert 0 < f(0) < f(1) < f(3) < 1 and f(4) == pytest.approx(1.0)
    assert f(19) < f(10) < f(4) and f(20) == pytest.approx(0.0)
    delayed = warmup_cosine(2, 20, start=5)
    assert delayed(0) == delayed(4) == 0.0 and delayed(5) > 0


# --------------------------------------------------------------------------------------------
# Trees
# --------------------------------------------------------------------------------------------


def all_nodes(depth: int, ranks: int):
    for d in range(1, depth + 1):
        yield from itertools.product(range(ranks), repeat=d)


def value(node, acc):
    p = 1.0
    for d, r in enumerate(node):
        p *= acc[d][r]
    return p


@pytest.mark.parametrize("budget", [1, 5, 13, 40])
def test_auto_tree_respects_budget_closure_and_is_optimal(budget):
    g = torch.Generator().manual_seed(budget)
    acc = (torch.rand(3, 4, generator=g) * 0.5).tolist()  # distinct values: no ties
    tree = build_tree(acc, budget)
    assert len(tree) == min(budget, 4 + 16 + 64)
    assert check_choices(tree) == tree  # parents first, every ancestor present
    # Best possible: the `budget` most valuable nodes of the full tree (they are ancestor-closed
    # because a node is never worth more than its parent).
    best = sorted(all_nodes(3, 4), key=lambda n: -value(n, acc))[:budget]
    assert set(tree) == set(best)
    tau = expected_acceptance_length(tree, acc)
    assert tau == pytest.approx(1 + sum(value(n, acc) for n in best))
    assert expected_acceptance_length(build_tree(acc, budget + 3), acc) > tau
    assert all(len(n) <= 2 for n in build_tree(acc, budget, max_depth=2))


def test_check_choices_names_the_bad_node():
    assert check_choices([(0, 1), (0,), (1,)]) == [(0,), (1,), (0, 1)]
    with pytest.raises(ValueError, match=r"\(1, 0\) lacks its parent \(1,\)"):
        check_choices([(0,), (1, 0)])
    with pytest.raises(ValueError, match="appears twice"):
        check_choices([(0,), (0,)])
    with pytest.raises(ValueError, match="3 deep but there are 2 heads"):
        check_choices([(0,), (0, 0), (0, 0, 0)], num_heads=2)


def test_rank_counts_and_report(target):
    ids = torch.randint(0, V, (2, 20), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    hidden = final_hidden(target, ids)
    lm_head = target.get_output_embeddings()
    heads = MedusaHeads.from_target(target, num_heads=2, num_layers=1)
    counts, totals = rank_counts(heads, hidden, mask, lm_head, max_rank=V)
    assert totals.tolist() == [2 * 18, 2 * 17]
    assert counts.sum(-1).tolist() == totals.tolist()  # every position has some rank < V
    # Alignment: hidden states one-hot on a period-2 sequence, heads and teacher reading the
    # id off them. Head k at t is judged against the teacher at t+k+1, so head 1 is always
    # right (t+2 has t's token) and head 0 never.
    vocab = 6
    seq = torch.tensor([[3, 5] * 8])
    onehot = torch.nn.functional.one_hot(seq, vocab).float()
    c, t = rank_counts(one_hot_heads(2, vocab), onehot, torch.ones_like(seq), lambda x: 50 * x, 4)
    assert c[1, 0] == t[1] == 16 - 3 and c[0, 0] == 0 and t[0] == 16 - 2
    report = accuracy_report(counts, totals, tree_nodes=6)
    assert report["tree"]["nodes"] == 6 and len(report["rank_accuracy"]) == 2
    assert report["top1"][0] == pytest.approx(float(counts[0, 0] / totals[0]))


# --------------------------------------------------------------------------------------------
# Proposing: the target's greedy output, chain and tree
# --------------------------------------------------------------------------------------------

TREE = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 0, 0, 0)]


@pytest.mark.parametrize("choices", [None, TREE], ids=["chain", "tree"])
def test_greedy_output_is_the_targets(target, choices):
    heads = perturbed(MedusaHeads.from_target(target, num_heads=4, num_layers=1), scale=0.02)
    proposer = MedusaProposer(heads, target.config.num_hidden_layers, choices)
    assert proposer.feature_layers == (4,)
    accepted = 0
    for seed in range(3):
        prompt = torch.randint(0, V, (1, 6), generator=torch.Generator().manual_seed(seed))
        plain = generate(target, prompt, None, max_new_tokens=40)
        spec = generate(target, prompt, proposer, k=4, max_new_tokens=40)
        assert spec.tokens == plain.tokens
        assert spec.target_forwards < plain.target_forwards  # some drafts were accepted
        accepted += spec.accepted
    assert accepted > 0


def test_tree_proposal_shape_at_every_temperature(target):
    heads = MedusaHeads.from_target(target, num_heads=3, num_layers=1)
    proposer = MedusaProposer(heads, 4, [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
    prompt = torch.randint(0, V, (1, 5))
    with torch.no_grad():
        out = target(input_ids=prompt, output_hidden_states=True)
    proposer.start(prompt, {4: out.hidden_states[4]})
    h = out.hidden_states[4][0, -1]
    ranks = [heads.head_logits(d, h).topk(2).indices for d in range(3)]
    p = proposer.propose(prompt, 3, SamplingParams(), None)
    assert p.parents.tolist() == [-1, -1, 0, 0, 1, 2]
    want = [ranks[0][0], ranks[0][1], ranks[1][0], ranks[1][1], ranks[1][0], ranks[2][0]]
    assert p.tokens.tolist() == [int(t) for t in want]
    assert len(proposer.propose(prompt, 2, SamplingParams(), None)) == 5  # depth <= k
    # Sampling: the same tree of top-k candidates (q one-hot, no probs); the loop verifies it by
    # multi-candidate speculative sampling (tests/test_tree_sampling.py).
    s = proposer.propose(prompt, 3, SamplingParams(temperature=0.8), torch.Generator())
    assert s.parents.tolist() == p.parents.tolist() and s.tokens.tolist() == p.tokens.tolist()
    assert s.probs is None


def test_sampled_tree_runs_in_the_loop(target):
    heads = MedusaHeads.from_target(target, num_heads=3, num_layers=1)
    proposer = MedusaProposer(heads, 4, TREE[:6])
    gen = torch.Generator().manual_seed(0)
    out = generate(
        target,
        torch.tensor([[1, 2, 3]]),
        proposer,
        k=3,
        max_new_tokens=20,
        sampling=SamplingParams(temperature=1.0),
        generator=gen,
    )
    assert len(out.tokens) == 20


def test_medusa_proposer_from_a_run_directory(target, tmp_path):
    heads = perturbed(MedusaHeads.from_target(target, num_heads=3, num_layers=1))
    heads.save(tmp_path)
    acc = [[0.6, 0.2, 0.1], [0.4, 0.2, 0.1], [0.3, 0.1, 0.1]]
    report = {"rank_accuracy": acc, "tree": {"nodes": 7}}
    (tmp_path / ACCURACY_FILE).write_text(json.dumps(report))
    chain = medusa_proposer(tmp_path, target)
    assert chain.mode == "chain"
    auto = medusa_proposer(tmp_path, target, tree=True)
    assert auto.choices == build_tree(acc, 7)
    assert len(medusa_proposer(tmp_path, target, tree=True, total_tokens=3).choices) == 3
    given = medusa_proposer(tmp_path, target, tree=True, medusa_choices=[[0], [0, 0]])
    assert given.choices == [(0,), (0, 0)]
    other = tiny_llama(vocab_size=V, hidden_size=16)
    with pytest.raises(ValueError, match="trained for another target"):
        medusa_proposer(tmp_path, other)


# --------------------------------------------------------------------------------------------
# Exports
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("share", [False, True])
def test_vllm_export_roundtrip(target, tmp_path, share):
    heads = perturbed(MedusaHeads.from_target(target, 3, 2, share_lm_head=share))
    heads.save(tmp_path / "run", extra={"target_name_or_path": "tiny"})
    out = export_medusa_vllm(tmp_path / "run", tmp_path / "vllm")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "medusa" and cfg["architectures"] == ["MedusaModel"]
    assert (cfg["num_heads"], cfg["num_hidden_layers"]) == (3, 2)
    assert (cfg["hidden_size"], cfg["vocab_size"], cfg["truncated_vocab_size"]) == (H, V, V)
    assert cfg["medusa_fc_bias"] is True and cfg["original_lm_head"] is share
    assert cfg["base_model_name_or_path"] == "tiny"
    from safetensors.torch import load_file

    keys = set(load_file(str(out / "model.safetensors")))
    blocks = {
        f"blocks.{h}.layers.{i}.{w}" for h in range(3) for i in range(2) for w in ("weight", "bias")
    }
    lm = {"lm_heads.0.weight"} if share else {f"lm_heads.{h}.weight" for h in range(3)}
    assert keys == blocks | lm
    back = load_medusa_export(out)
    h = torch.randn(6, H)
    assert torch.equal(back(h), heads(h))
    assert (out / "README.md").is_file()


@pytest.mark.parametrize("share", [False, True])
def test_original_export_roundtrip(target, tmp_path, share):
    heads = perturbed(MedusaHeads.from_target(target, 2, 1, share_lm_head=share))
    heads.save(tmp_path / "run")
    out = export_medusa_original(tmp_path / "run", tmp_path / "orig", base_model_name_or_path="x")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["medusa_num_heads"] == 2 and cfg["medusa_num_layers"] == 1
    assert cfg["base_model_name_or_path"] == "x"
    from safetensors.torch import load_file

    keys = set(load_file(str(out / "medusa_lm_head.safetensors")))
    assert keys == {
        f"{h}.{n}" for h in range(2) for n in ("0.linear.weight", "0.linear.bias", "1.weight")
    }
    back = load_medusa_export(out)
    h = torch.randn(6, H)
    assert torch.equal(back(h), heads(h))


def test_original_export_refuses_distinct_layers(target, tmp_path):
    MedusaHeads.from_target(target, 2, 2).save(tmp_path / "run")
    with pytest.raises(ValueError, match=r"repeats ONE ResBlock"):
        export_medusa_original(tmp_path / "run", tmp_path / "orig", base_model_name_or_path="x")
    assert not (tmp_path / "orig").exists()


def test_exports_replace_atomically(target, tmp_path):
    first = perturbed(MedusaHeads.from_target(target, 2, 1), seed=1)
    second = perturbed(MedusaHeads.from_target(target, 2, 1), seed=2)
    first.save(tmp_path / "a")
    second.save(tmp_path / "b")
    export_medusa_vllm(tmp_path / "a", tmp_path / "out")
    (tmp_path / "out" / "stale.txt").write_text("from the old export")
    export_medusa_vllm(tmp_path / "b", tmp_path / "out")
    assert not (tmp_path / "out" / "stale.txt").exists()
    h = torch.randn(3, H)
    assert torch.equal(load_medusa_export(tmp_path / "out")(h), second(h))
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert leftovers == []
    with pytest.raises(ValueError, match="holds no Medusa heads"):
        load_medusa_export(tmp_path)
