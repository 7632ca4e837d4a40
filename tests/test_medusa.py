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
from draftsmith.train.data.vocab import draft_vocab
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


def test_lk_head_losses_are_one_minus_the_acceptance_and_raise_it(target):
    """head_loss tv is 1 − Σ min(p, q) per head; training on it raises every head's acceptance."""
    torch.manual_seed(0)
    ids = torch.randint(0, V, (2, 24))
    mask = torch.zeros_like(ids)
    mask[:, 6:] = 1
    hidden = final_hidden(target, ids)
    lm_head = target.get_output_embeddings()
    heads = MedusaHeads.from_target(target, num_heads=2, num_layers=1)

    def acceptance(k: int) -> float:
        b, t = head_label_positions(mask, k)
        with torch.no_grad():
            q = heads.head_logits(k, hidden[b, t]).float().softmax(-1)
            p = lm_head(hidden[b, t + k + 1]).float().softmax(-1)
        return torch.minimum(p, q).sum(-1).mean().item()

    tv = medusa_head_losses(
        heads, hidden, ids, mask, labels="target_soft", teacher=lm_head, head_loss="tv"
    )
    for k in range(2):
        assert tv["head_loss"][k].item() == pytest.approx(1 - acceptance(k), abs=1e-5)
    before = [acceptance(k) for k in range(2)]
    objective = Medusa1Objective(heads, labels="target_soft", head_loss="lk_hybrid")
    opt = torch.optim.AdamW([p for p in heads.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(20):
        out = objective(hidden, ids, mask, teacher=lm_head)
        opt.zero_grad()
        out["loss"].backward()
        opt.step()
    after = [acceptance(k) for k in range(2)]
    assert all(a > b + 0.05 for a, b in zip(after, before, strict=True)), (before, after)
    # Hard labels carry no distribution to accept against: refused, naming what it needs.
    with pytest.raises(ValueError, match="labels='target_soft'"):
        medusa_head_losses(heads, hidden, ids, mask, labels="data", head_loss="tv")


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
    """A sampled Medusa tree is verified as a tree (several nodes a step), its counters add up
    (each target forward emits one token plus the drafts it accepted), and the generator alone
    decides the output: the same seed gives the same tokens, another seed others."""
    heads = MedusaHeads.from_target(target, num_heads=3, num_layers=1)
    proposer = MedusaProposer(heads, 4, TREE[:6])

    def run(seed: int):
        return generate(
            target,
            torch.tensor([[1, 2, 3]]),
            proposer,
            k=3,
            max_new_tokens=20,
            sampling=SamplingParams(temperature=1.0),
            generator=torch.Generator().manual_seed(seed),
        )

    out = run(0)
    assert len(out.tokens) == 20 and all(0 <= t < V for t in out.tokens)
    assert out.draft_steps > 0 and out.draft_steps < out.proposed <= 6 * out.draft_steps
    assert len(out.tokens) == out.target_forwards + out.accepted
    assert sum(out.accepted_per_position) == out.accepted
    assert run(0).tokens == out.tokens
    assert run(1).tokens != out.tokens


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


# --------------------------------------------------------------------------------------------
# Draft vocabulary (FR-Spec / EAGLE-3's d2t): heads over the N most frequent tokens
# --------------------------------------------------------------------------------------------

N = 16


def greedy_vocab(target, n: int = N, prompts: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft vocabulary of the target's own greedy outputs (what self-distilled data holds)."""
    counts = torch.zeros(V, dtype=torch.long)
    for seed in range(prompts):
        prompt = torch.randint(0, V, (1, 6), generator=torch.Generator().manual_seed(100 + seed))
        counts += torch.bincount(
            torch.tensor(generate(target, prompt, None, max_new_tokens=40).tokens), minlength=V
        )
    return draft_vocab(counts, n)


def reduced_heads(target, share: bool = False, seed: int = 0, **kw) -> MedusaHeads:
    d2t, t2d = greedy_vocab(target)
    heads = MedusaHeads.from_target(target, share_lm_head=share, d2t=d2t, t2d=t2d, **kw)
    return perturbed(heads, seed=seed, scale=0.02)


@pytest.mark.parametrize("share", [False, True])
def test_draft_vocab_heads_start_as_the_targets_rows_and_reload(target, tmp_path, share):
    d2t, t2d = greedy_vocab(target)
    heads = MedusaHeads.from_target(target, 3, 1, share_lm_head=share, d2t=d2t, t2d=t2d)
    ids = torch.arange(N) + d2t
    assert heads.reduced and torch.equal(heads.vocab_ids(), ids)
    assert torch.equal(torch.nonzero(t2d).flatten(), ids)
    h = torch.randn(5, H)
    want = target.get_output_embeddings()(h)[:, ids]
    assert heads(h).shape == (3, 5, N)
    assert all(torch.equal(heads.head_logits(k, h), want) for k in range(3))
    assert all(p.weight.shape == (N, H) for p in heads.projections())  # N rows, not V
    assert torch.equal(heads.target_ids(torch.arange(N)), ids)
    spread = heads.target_logits(heads.head_logits(0, h))
    assert torch.equal(spread[:, ids], want) and bool((spread[:, ~t2d] == -torch.inf).all())
    # The maps are buffers: saved with the weights, restored by load_medusa.
    heads = perturbed(heads)
    heads.save(tmp_path / "h")
    assert json.loads((tmp_path / "h" / "config.json").read_text())["draft_vocab_size"] == N
    back = load_medusa(tmp_path / "h")
    assert back.draft_vocab_size == N and torch.equal(back.d2t, d2t) and torch.equal(back.t2d, t2d)
    assert torch.equal(back(h), heads(h))
    # Inconsistent maps are refused, naming the file.
    from safetensors.torch import load_file, save_file

    state = load_file(str(tmp_path / "h" / "model.safetensors"))
    state["d2t"] = state["d2t"].flip(0)
    save_file(state, str(tmp_path / "h" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.safetensors: d2t and t2d disagree"):
        load_medusa(tmp_path / "h")
    # Full-vocabulary heads keep their old state dict (no maps): old checkpoints still load.
    assert "d2t" not in MedusaHeads.from_target(target, 2, 1).state_dict()


@pytest.mark.parametrize("choices", [None, TREE], ids=["chain", "tree"])
def test_draft_vocab_greedy_output_is_the_targets(target, choices):
    heads = reduced_heads(target, num_heads=4, num_layers=1)
    proposer = MedusaProposer(heads, target.config.num_hidden_layers, choices)
    proposed: list[int] = []
    propose = proposer.propose

    def spy(*args):
        p = propose(*args)
        proposed.extend(p.tokens.tolist())
        return p

    proposer.propose = spy
    accepted = 0
    for seed in range(3):
        prompt = torch.randint(0, V, (1, 6), generator=torch.Generator().manual_seed(seed))
        plain = generate(target, prompt, None, max_new_tokens=40)
        spec = generate(target, prompt, proposer, k=4, max_new_tokens=40)
        assert spec.tokens == plain.tokens
        accepted += spec.accepted
    assert accepted > 0
    assert proposed and all(heads.t2d[t] for t in proposed)  # only draft-vocabulary tokens


def test_draft_vocab_tree_leaves_out_ranks_beyond_n(target):
    heads = reduced_heads(target, num_heads=2, num_layers=1)
    deep = [(0,), (N - 1,), (N,), (0, 0), (N, 0), (0, N + 1)]
    proposer = MedusaProposer(heads, 4, deep)
    assert proposer.choices == [(0,), (N - 1,), (0, 0)]


def test_draft_vocab_sampled_chain_q_is_zero_outside(target):
    heads = reduced_heads(target, num_heads=3, num_layers=1)
    proposer = MedusaProposer(heads, 4)
    prompt = torch.randint(0, V, (1, 5))
    with torch.no_grad():
        out = target(input_ids=prompt, output_hidden_states=True)
    proposer.start(prompt, {4: out.hidden_states[4]})
    p = proposer.propose(prompt, 3, SamplingParams(temperature=1.0), torch.Generator())
    assert p.probs.shape == (3, V)
    assert bool((p.probs[:, ~heads.t2d] == 0).all())
    torch.testing.assert_close(p.probs.sum(-1), torch.ones(3))
    assert all(heads.t2d[t] for t in p.tokens.tolist())


def reduced_one_hot_heads(num_heads: int, vocab: int, keep: list[int], scale: float = 50.0):
    """one_hot_heads over the draft vocabulary ``keep`` (target ids, ascending)."""
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[keep] = True
    d2t = torch.tensor(keep) - torch.arange(len(keep))
    heads = MedusaHeads(num_heads, 1, vocab, vocab, draft_vocab_size=len(keep))
    heads.set_vocab(d2t, t2d)
    with torch.no_grad():
        for proj in heads.projections():
            proj.weight.copy_(scale * torch.eye(vocab)[keep])
    return heads


def test_draft_vocab_loss_restricts_labels_like_eagle3():
    """data/target labels outside the draft vocabulary leave the CE (and count as misses);
    target_soft is the target's distribution restricted to the draft vocabulary, renormalised
    (EAGLE-3's label)."""
    vocab, keep = 10, [0, 2, 3, 5, 7, 8]
    ids = torch.tensor([[2, 5, 7, 1, 8, 3, 3, 9, 0, 4, 5, 2]])
    mask = torch.ones_like(ids)
    T = ids.shape[1]
    hidden = torch.zeros(1, T, vocab)
    for t in range(T - 1):
        hidden[0, t, ids[0, t + 1]] = 1.0  # the teacher predicts the data's next token
    heads = perturbed(reduced_one_hot_heads(2, vocab, keep, scale=1.0), scale=0.3)

    def teacher(h):
        return 3.0 * h + 0.1 * torch.arange(vocab, dtype=h.dtype)

    out = medusa_head_losses(heads, hidden, ids, mask, labels="data")
    soft = medusa_head_losses(heads, hidden, ids, mask, labels="target_soft", teacher=teacher)
    hard = medusa_head_losses(heads, hidden, ids, mask, labels="target", teacher=teacher)
    index = torch.full((vocab,), -1)
    index[keep] = torch.arange(len(keep))
    for k in range(2):
        b, t = head_label_positions(mask, k)
        logits = heads.head_logits(k, hidden[b, t]).float()
        labels = ids[b, t + k + 2]
        inside = index[labels] >= 0
        assert 0 < int(inside.sum()) < len(labels)  # some labels are outside the vocabulary
        want = torch.nn.functional.cross_entropy(logits[inside], index[labels[inside]])
        torch.testing.assert_close(out["head_loss"][k], want.detach())
        assert out["count"][k] == len(labels)  # every position counts in the accuracies
        top1 = heads.target_ids(logits.argmax(-1))
        assert out["correct1"][k] == int((top1 == labels).sum())
        # target_soft: softmax of the teacher's logits over the draft tokens only.
        p = teacher(hidden[b, t + k + 1])[:, keep].softmax(-1)
        want = -(p * logits.log_softmax(-1)).sum(-1).mean()
        torch.testing.assert_close(soft["head_loss"][k], want.detach())
        # target (hard) = data here: the teacher's argmax is the data's token.
        torch.testing.assert_close(hard["head_loss"][k], out["head_loss"][k])
    # Every label outside the vocabulary: a zero loss that keeps the graph, not NaN.
    outside = torch.tensor([[1, 4, 6, 9, 1, 4, 6, 9]])
    none = medusa_head_losses(heads, hidden[:, :8], outside, torch.ones_like(outside))
    assert float(none["loss"].detach()) == 0.0 and none["loss"].requires_grad
    assert none["correct1"].sum() == 0 and none["count"].sum() > 0


def test_draft_vocab_rank_counts_skip_tokens_outside():
    vocab, keep = 6, [0, 3, 5]
    seq = torch.tensor([[3, 5, 1, 3, 5, 1, 3, 5, 1, 3]])
    onehot = torch.nn.functional.one_hot(seq, vocab).float()
    heads = reduced_one_hot_heads(1, vocab, keep)
    # Head 0 at t is judged against the teacher at t+1, i.e. the token at t+1, and scores 50 on
    # token t (when a draft token): rank 1 when both are draft tokens, rank 0 after token 1
    # (every logit 0); a reference token outside the vocab (1) has no rank.
    c, t = rank_counts(heads, onehot, torch.ones_like(seq), lambda x: 50 * x, 3)
    positions = seq.shape[1] - 2
    pairs = [(int(seq[0, j]), int(seq[0, j + 1])) for j in range(positions)]
    assert t[0] == positions
    assert c[0, 0] == sum(a == 1 for a, _ in pairs)
    assert c[0, 1] == sum(a != 1 and b != 1 for a, b in pairs)
    assert c[0].sum() == sum(b != 1 for _, b in pairs)


def test_draft_vocab_training_reduces_the_loss(target):
    torch.manual_seed(0)
    ids = torch.randint(0, V, (2, 24))
    mask = torch.zeros_like(ids)
    mask[:, 6:] = 1
    counts = torch.bincount(ids[mask.bool()], minlength=V)
    d2t, t2d = draft_vocab(counts, 24)
    heads = MedusaHeads.from_target(target, num_heads=2, num_layers=1, d2t=d2t, t2d=t2d)
    objective = Medusa1Objective(heads, labels="data")
    opt = torch.optim.AdamW([p for p in heads.parameters() if p.requires_grad], lr=1e-2)
    hidden = final_hidden(target, ids)
    first = None
    for _ in range(30):
        out = objective(hidden, ids, mask)
        first = out["head_loss"].clone() if first is None else first
        opt.zero_grad()
        out["loss"].backward()
        opt.step()
    assert (objective(hidden, ids, mask)["head_loss"] < 0.5 * first).all()
    assert torch.equal(heads.t2d, t2d)  # the maps are buffers, not trained


@pytest.mark.parametrize("share", [False, True])
def test_draft_vocab_exports_the_full_vocabulary_equivalent(target, tmp_path, share):
    """Both formats write V-row projections (rows outside the draft vocabulary = the mean of its
    rows): reloaded, logits on the draft vocabulary are ours, no other token outscores the best
    draft token, and the drafted tokens (chain, top-1 per head) are ours token for token."""
    from safetensors.torch import load_file

    heads = reduced_heads(target, share, num_heads=3, num_layers=1)
    heads.save(tmp_path / "run", extra={"target_name_or_path": "tiny"})
    ids = heads.vocab_ids()
    vllm = export_medusa_vllm(tmp_path / "run", tmp_path / "vllm")
    cfg = json.loads((vllm / "config.json").read_text())
    assert (cfg["vocab_size"], cfg["truncated_vocab_size"]) == (V, V)  # no token_map
    tensors = load_file(str(vllm / "model.safetensors"))
    assert "token_map" not in tensors and "d2t" not in tensors and "t2d" not in tensors
    assert tensors["lm_heads.0.weight"].shape == (V, H)
    info = json.loads((vllm / "draftsmith_export.json").read_text())
    assert info["draft_vocab"]["draft_vocab_size"] == N
    assert "draft vocabulary" in (vllm / "README.md").read_text()
    orig = export_medusa_original(tmp_path / "run", tmp_path / "orig", base_model_name_or_path="x")
    prompt = torch.randint(0, V, (1, 30), generator=torch.Generator().manual_seed(5))
    h = torch.cat([final_hidden(target, prompt)[0], torch.randn(200, H)])
    ours = heads(h)  # [K, n, N]
    for out in (vllm, orig):
        back = load_medusa_export(out)
        full = back(h)  # [K, n, V]
        assert not back.reduced and full.shape[-1] == V
        torch.testing.assert_close(full[..., ids], ours, rtol=0, atol=1e-6)
        outside = full[..., ~heads.t2d]
        assert bool((outside.amax(-1) < ours.amax(-1)).all())
        assert torch.equal(full.argmax(-1), heads.target_ids(ours.argmax(-1)))
        # The chain a full-vocabulary server drafts from these files is ours.
        a = MedusaProposer(heads, 4)
        b = MedusaProposer(back, 4)
        for proposer in (a, b):
            with torch.no_grad():
                out_ = target(input_ids=prompt, output_hidden_states=True)
            proposer.start(prompt, {4: out_.hidden_states[4]})
        pa = a.propose(prompt, 3, SamplingParams(), None)
        pb = b.propose(prompt, 3, SamplingParams(), None)
        assert pa.tokens.tolist() == pb.tokens.tolist()


# --------------------------------------------------------------------------------------------
# The chunked head + loss (train/objectives/chunked_loss.py): the same values and gradients as
# the dense losses, and no [n, V] tensor kept for the backward
# --------------------------------------------------------------------------------------------


def _dense_medusa_losses(heads, hidden, input_ids, loss_mask, labels, teacher, head_loss):
    """medusa_head_losses' loss and metrics as they were (full logits per head), copied."""
    from draftsmith.train.data.vocab import t2d_index
    from tests.test_chunked_loss import old_draft_loss

    total = hidden.new_zeros((), dtype=torch.float32)
    per_head = []
    to_draft = t2d_index(heads.t2d) if heads.reduced else None
    vocab_ids = heads.vocab_ids() if heads.reduced else None
    for k, w in enumerate([0.8**k for k in range(heads.num_heads)]):
        b, t = head_label_positions(loss_mask, k)
        logits = heads.head_logits(k, hidden[b, t]).float()
        if labels == "data":
            target_ids, soft = input_ids[b, t + k + 2], None
        else:
            with torch.no_grad():
                teacher_logits = teacher(hidden[b, t + k + 1].detach()).float()
            target_ids, soft = teacher_logits.argmax(-1), None
            if labels == "target_soft":
                if vocab_ids is not None:
                    teacher_logits = teacher_logits.index_select(-1, vocab_ids)
                soft = teacher_logits.softmax(-1)
        if soft is not None and head_loss != "kl":
            every = torch.ones(1, soft.shape[0], dtype=torch.bool)
            loss_k = old_draft_loss(head_loss, logits[None], soft[None], every)[0]
        elif soft is not None:
            loss_k = -(soft * logits.log_softmax(-1)).sum(-1).mean()
        elif to_draft is None:
            loss_k = torch.nn.functional.cross_entropy(logits, target_ids)
        else:
            draft_ids = to_draft[target_ids]
            loss_k = torch.nn.functional.cross_entropy(
                logits, draft_ids, ignore_index=-1, reduction="sum"
            ) / (draft_ids >= 0).sum().clamp_min(1)
        total = total + w * loss_k
        top = heads.target_ids(logits.topk(min(5, logits.shape[-1]), dim=-1).indices)
        hit = top == target_ids[:, None]
        per_head.append((loss_k.detach(), hit[:, 0].sum(), hit.any(-1).sum()))
    return total, per_head


_COMBINATIONS = [("data", "kl"), ("target", "kl")] + [
    ("target_soft", kind) for kind in ("kl", "tv", "nla", "lk_hybrid")
]


@pytest.mark.parametrize(("labels", "head_loss"), _COMBINATIONS)
@pytest.mark.parametrize(("share", "draft_vocab"), [(False, None), (True, None), (False, 24)])
def test_head_losses_equal_the_dense_losses(target, labels, head_loss, share, draft_vocab):
    """Every head_labels x head_loss combination the recipe allows, shared head or not, full or
    draft vocabulary: the loss, each head's loss, top-1/top-5 hits and the gradients."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (2, 20), generator=g)
    mask = torch.zeros_like(ids)
    mask[:, 5:] = 1
    mask[1, 15:] = 0
    hidden = final_hidden(target, ids)
    maps = {}
    if draft_vocab:
        d2t, t2d = draft_vocab_maps(draft_vocab)
        maps = {"d2t": d2t, "t2d": t2d}
    heads = MedusaHeads.from_target(target, num_heads=3, num_layers=1, share_lm_head=share, **maps)
    heads = perturbed(heads, scale=0.2)
    teacher = target.get_output_embeddings()
    out = medusa_head_losses(
        heads, hidden, ids, mask, labels=labels, teacher=teacher, head_loss=head_loss
    )
    want, per_head = _dense_medusa_losses(heads, hidden, ids, mask, labels, teacher, head_loss)
    torch.testing.assert_close(out["loss"], want)
    for k, (loss_k, c1, c5) in enumerate(per_head):
        torch.testing.assert_close(out["head_loss"][k], loss_k)
        assert out["correct1"][k] == c1 and out["correct5"][k] == c5
    params = [p for p in heads.parameters() if p.requires_grad]
    got = torch.autograd.grad(out["loss"], params, retain_graph=True)
    ref = torch.autograd.grad(want, params)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def draft_vocab_maps(n: int):
    counts = torch.randint(0, 100, (V,), generator=torch.Generator().manual_seed(1))
    return draft_vocab(counts, n)


@pytest.mark.parametrize("target_loss", ["lm", "kl"])
def test_medusa2_target_loss_equals_the_dense_loss(target, target_loss):
    """Medusa-2's next-token CE / KL(original ‖ adapted) on the adapted target's lm_head."""
    model = add_lora(copy.deepcopy(target), r=4, alpha=8, dropout=0.0)
    with torch.no_grad():  # adapters away from B = 0, so the two targets differ
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2, generator=torch.Generator().manual_seed(len(n)))
    heads = MedusaHeads.from_target(target, num_heads=2, num_layers=1)
    objective = Medusa2Objective(model, heads, target_loss=target_loss, head_weight=0.5)
    ids = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(2))
    attn, mask = torch.ones_like(ids), torch.ones_like(ids)
    mask[0, :6] = 0
    out = objective(ids, attn, mask)
    # The reference: the former lines on the full logits.
    lm_head = model.get_output_embeddings()
    hidden = objective._hidden(ids, attn)
    b, t = mask[:, 1:].bool().nonzero(as_tuple=True)
    logits = lm_head(hidden[b, t]).float()
    if target_loss == "lm":
        want = torch.nn.functional.cross_entropy(logits, ids[b, t + 1])
    else:
        with torch.no_grad(), model.disable_adapter():
            ref = lm_head(objective._hidden(ids, attn)[b, t]).float()
        want = torch.nn.functional.kl_div(
            logits.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="batchmean"
        )
    assert float(want.detach()) > 1e-4
    torch.testing.assert_close(out["target_loss"], want.detach())
    lora = [p for n, p in objective.named_parameters() if "lora_" in n]
    heads_part = medusa_head_losses(heads, hidden, ids, mask, labels="data")["loss"]
    got = torch.autograd.grad(out["loss"], lora, retain_graph=True)
    ref = torch.autograd.grad(want + 0.5 * heads_part, lora)
    for a, b_ in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b_, rtol=1e-4, atol=1e-6)


def test_a_medusa_loss_keeps_no_t_by_v_tensor():
    """The tensors autograd keeps: nothing of n x V (logits, log-probabilities, soft labels)."""
    from tests.test_chunked_loss import WIDE_H, WIDE_T, WIDE_V, _big, saved_tensors

    wide = tiny_llama(vocab_size=WIDE_V, hidden_size=WIDE_H, layers=2, seed=3)
    ids = torch.randint(0, WIDE_V, (1, WIDE_T), generator=torch.Generator().manual_seed(0))
    hidden = final_hidden(wide, ids)
    heads = MedusaHeads.from_target(wide, num_heads=2, num_layers=1)
    for labels in ("data", "target_soft"):
        with saved_tensors() as saved:
            out = medusa_head_losses(
                heads, hidden, ids, torch.ones_like(ids), labels=labels, teacher=wide.lm_head
            )
        assert saved and _big(saved, WIDE_T - 3, WIDE_V) == [], labels
        out["loss"].backward()
