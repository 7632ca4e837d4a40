"""Drafting with an EAGLE drafter: :class:`EagleProposer`, a chain or an EAGLE-2 dynamic tree.

It implements the drafter contract of :mod:`draftsmith.heads.base` (``feature_layers``,
``start``, ``propose``, ``accept``) around an :class:`~draftsmith.heads.eagle_model.EagleDrafter`
(built, saved and loaded by :mod:`draftsmith.heads.eagle`).
"""

from __future__ import annotations

import torch

from .base import Features, Proposal, unwrap_model
from .eagle_model import EagleCache, EagleDrafter
from .sampling import SamplingParams, choose, confidence, logits_to_probs

__all__ = ["EagleProposer"]


class EagleProposer:
    """Speculative-decoding drafter around an :class:`EagleDrafter` (chain or EAGLE-2 tree).

    State between steps: the drafter's KV cache holds only positions whose feature came from
    the target (verified); draft-step entries are appended during :meth:`propose` and cropped
    away at :meth:`accept`, whose true features of the kept positions are queued and run at the
    next :meth:`propose` (EAGLE §3: target features replace the drafter's own). Running them
    lazily is what lets one code path serve chains and trees: the loop only reports how many
    tokens were accepted, and the kept tokens themselves appear at the end of ``ids`` next time.

    Args:
        drafter: a trained (or fresh) drafter (no dropout: train/eval mode does not matter).
        tree: draft an EAGLE-2 dynamic tree (Li et al. 2024b, §4) instead of a chain, at every
            temperature. With sampling the tree is built over the processed draft distribution
            (temperature, top-k, top-p) and its nodes are top-k candidates, a function of the
            accepted prefix: the proposal has no probs (q one-hot) and the loop verifies each
            node's children with the residual rule (SpecInfer §4.2 / Alg. 2; EAGLE-2's code).
        topk: tree branching: children per expanded node and nodes expanded per depth
            (EAGLE-2 uses 10 on GPU; 4 suits CPU).
        total_tokens: most tree nodes returned, the best by cumulative draft log-probability
            (EAGLE-2 uses 60; default 24).
        parallel: P-EAGLE: draft all k positions in the forward that runs the queued target
            features (placeholders after the first position; one drafter forward per step).
            Needs a drafter with a ``mask_token_id``; a chain.
    """

    def __init__(
        self,
        drafter: EagleDrafter,
        *,
        tree: bool = False,
        topk: int = 4,
        total_tokens: int = 24,
        parallel: bool = False,
    ) -> None:
        if topk < 1 or total_tokens < 1:
            raise ValueError(f"topk and total_tokens must be >= 1, got {topk}, {total_tokens}")
        self.drafter = unwrap_model(drafter)
        if parallel and (tree or not self.drafter.config.parallel):
            raise ValueError(
                "parallel drafting needs a P-EAGLE drafter (mask_token_id) and a chain"
            )
        self.parallel = parallel
        self.tree = tree
        self.topk = topk
        self.total_tokens = total_tokens
        self.feature_layers: tuple[int, ...] = self.drafter.config.feature_layers
        self._cache = EagleCache()
        self._pending: list[torch.Tensor] = []  # target features not yet run, [1, n, F] each
        self._real = 0  # cache entries (= positions) that came from target features
        #: Tree mode: cumulative draft log-probabilities of the last returned tree's nodes.
        self.last_scores: torch.Tensor | None = None

    def start(self, prompt_ids: torch.Tensor, features: Features | None) -> None:
        """Queue the prompt's features (run at the first propose, when x_T is known)."""
        if features is None:
            raise ValueError("EagleProposer needs target features (feature_layers)")
        self._cache = EagleCache()
        self._real = 0
        self._pending = [self.drafter.feature_tensor(features)]

    def accept(self, num_accepted: int, features: Features | None) -> None:
        """Drop the draft entries from the cache and queue the kept positions' features."""
        if features is None:
            raise ValueError("EagleProposer needs target features (feature_layers)")
        self._cache.crop(self._real)
        self._pending.append(self.drafter.feature_tensor(features))

    @torch.inference_mode()
    def _catch_up(self, ids: torch.Tensor, placeholders: int = 0) -> torch.Tensor:
        """Run the queued target features; return the output hidden from the last position on.

        Args:
            ids: ``[1, L]`` the accepted sequence.
            placeholders: P-EAGLE: run this many placeholder positions (L-1, L, ...) after the
                queued ones in the same forward; their cache entries are cropped at accept.

        Returns:
            ``[1, 1 + placeholders, H]``: the drafter's guess of the feature at position L-1,
            whose logits give the first draft token (position L), then the placeholders'
            outputs, whose logits give draft tokens 2, 3, ...
        """
        self._cache.crop(self._real)
        if not self._pending:
            raise RuntimeError("EagleProposer.propose called twice without accept()")
        feats = torch.cat(self._pending, dim=1)  # [1, P, F]
        p = feats.shape[1]
        start = self._real
        if start + p + 1 != ids.shape[1]:
            raise RuntimeError(
                f"EagleProposer out of step: {start} cached + {p} queued positions + 1 "
                f"!= {ids.shape[1]} tokens"
            )
        d = self.drafter
        tokens = ids[:, start + 1 :].to(d.device)  # x_{t+1} for each queued position t
        emb = d.embed(tokens)
        if placeholders:
            mask_emb, mask_feats = d.placeholders(1, placeholders)
            emb = torch.cat([emb, mask_emb], dim=1)
            feats = torch.cat([feats.to(mask_feats.dtype), mask_feats], dim=1)
        pos = torch.arange(start, start + p + placeholders, device=d.device)[None]
        hidden, _ = d(emb, feats, pos, cache=self._cache)
        self._real += p
        self._pending = []
        return hidden[:, p - 1 :]

    @torch.inference_mode()
    def propose(
        self,
        ids: torch.Tensor,
        k: int,
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> Proposal:
        """Draft k tokens (chain) or a tree of depth <= k after ``ids``."""
        if self.parallel:
            return self._propose_parallel(ids, k, sampling, generator)
        last = self._catch_up(ids)
        if self.tree:
            return self._propose_tree(last, k, sampling)
        return self._propose_chain(last, k, sampling, generator)

    def _propose_parallel(
        self,
        ids: torch.Tensor,
        k: int,
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> Proposal:
        """P-EAGLE: the k draft tokens from one forward (queued features + k-1 placeholders).

        Each position's token is drawn from that position's own distribution, which does not
        depend on the tokens drawn before it (placeholders stand in for them), so row i of
        ``probs`` is exactly the distribution ``tokens[i]`` was drawn from and the loop's chain
        acceptance stays lossless.
        """
        d = self.drafter
        hidden = self._catch_up(ids, placeholders=max(k - 1, 0))  # [1, k, H]
        logits = d.target_logits(d.logits(hidden)[0].float())  # [k, V]
        tokens, probs = choose(logits, sampling, generator)
        return Proposal(
            tokens=tokens,
            probs=None if sampling.greedy else probs,
            confidence=confidence(logits, probs),
        )

    def _propose_chain(
        self,
        hidden: torch.Tensor,
        k: int,
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> Proposal:
        d = self.drafter
        pos = self._real - 1  # position of the output `hidden` came from (L-2)
        tokens, probs, conf = [], [], []
        for i in range(k):
            logits = d.target_logits(d.logits(hidden)[0, -1].float())  # [V]
            tok, q = choose(logits, sampling, generator)
            tokens.append(tok)
            probs.append(q)
            conf.append(confidence(logits, q))
            if i + 1 < k:
                # Next input: (own predicted feature, embedding of the token just drafted).
                step_pos = torch.tensor([[pos + 1 + i]], device=d.device)
                hidden, _ = d(d.embed(tok.view(1, 1)), hidden, step_pos, cache=self._cache)
        return Proposal(
            tokens=torch.stack(tokens),
            probs=None if sampling.greedy else torch.stack(probs),
            confidence=torch.stack(conf),
        )

    def _propose_tree(self, hidden: torch.Tensor, depth: int, sampling: SamplingParams) -> Proposal:
        """EAGLE-2 dynamic tree (Li et al. 2024b, §4.1 expansion, §4.2 reranking).

        Expansion: at each depth, the ``topk`` nodes of the newest layer with the highest
        cumulative log-probability (the "frontier") are run through the drafter together, under
        a tree mask over the drafter's cache, and each gets ``topk`` children. Reranking: the
        ``total_tokens`` nodes with the best cumulative log-prob are kept. Log-probs are <= 0,
        so a child never outscores its parent; ties are broken by creation order (parents are
        created first), hence the kept set always contains every kept node's ancestors.

        Log-probabilities are the draft's raw ones when greedy and, when sampling, those of its
        processed distribution (temperature, top-k, top-p), whose zeros are not added as
        children. The nodes are top-k candidates, not samples, so the proposal carries no probs
        (q one-hot on each node; the loop's multi-candidate rule, SpecInfer §4.2 / Alg. 2).
        """
        d = self.drafter
        dev = d.device
        topk = self.topk
        # Node arrays, in creation order (parents before children).
        tok_list: list[int] = []
        parent_list: list[int] = []
        score_list: list[float] = []
        cond_list: list[float] = []  # each node's own log-prob given its parent

        def children(
            h: torch.Tensor, parents: list[int], base: list[float]
        ) -> list[tuple[int, int]]:
            """Add the topk children of each row of h; return ``(new node, its row of h)``.

            One head call for all rows: the draft head's weights (8k x H in fp32) are read
            once per level, not once per parent -- at batch 1 on a CPU the head is memory-bound
            (2.2 ms per call for SmolLM2's drafter on one thread).
            """
            logits = d.logits(h)[0].float()  # [m, V_draft]
            if sampling.greedy:
                logp = torch.log_softmax(logits, dim=-1)
            else:
                logp = logits_to_probs(logits, sampling).log()
            val, idx = logp.topk(min(topk, logp.shape[-1]), dim=-1)
            vals, tids = val.tolist(), d.target_ids(idx).tolist()  # one device sync
            new = []
            for r, parent in enumerate(parents):
                for c in range(len(vals[r])):
                    if vals[r][c] == float("-inf"):  # outside the processed distribution
                        continue
                    new.append((len(tok_list), r))
                    tok_list.append(tids[r][c])
                    parent_list.append(parent)
                    score_list.append(base[r] + vals[r][c])
                    cond_list.append(vals[r][c])
            return new

        layer = [n for n, _ in children(hidden, [-1], [0.0])]
        node_hidden = {n: 0 for n in layer}  # node -> row in `feat` of its parent's output
        feat = hidden  # [1, m, H] outputs whose rows feed the next level
        slot: dict[int, int] = {}  # node -> index of its entry in the drafter cache
        base_pos = self._real - 1  # position of the root's output (L-2)
        for level in range(1, depth):
            frontier = sorted(layer, key=lambda n: (-score_list[n], n))[:topk]
            m = len(frontier)
            past = len(self._cache)
            mask = torch.zeros(m, past + m, dtype=torch.bool)
            mask[:, : self._real] = True
            for r, n in enumerate(frontier):
                a = parent_list[n]
                while a != -1:  # ancestors fed at earlier levels
                    mask[r, slot[a]] = True
                    a = parent_list[a]
                mask[r, past + r] = True
            for r, n in enumerate(frontier):
                slot[n] = past + r
            emb = d.embed(torch.tensor([[tok_list[n] for n in frontier]], device=dev))
            inp = feat[:, [node_hidden[n] for n in frontier]]
            pos = torch.full((1, m), base_pos + level, device=dev)
            # The verified context (the first `_real` entries) is visible to every node: only
            # the tree's own entries go through the mask, which then never grows with context.
            tail = mask[:, self._real :][None, None].to(dev)
            out, _ = d(
                emb, inp, pos, attention_mask=tail, cache=self._cache, mask_offset=self._real
            )
            born = children(out, frontier, [score_list[n] for n in frontier])
            layer = [kid for kid, _ in born]
            node_hidden.update(born)
            feat = out
        ranked = sorted(range(len(tok_list)), key=lambda n: (-score_list[n], n))
        rank = {n: r for r, n in enumerate(ranked)}
        keep = sorted(ranked[: self.total_tokens])
        new_index = {n: i for i, n in enumerate(keep)}
        parents = [new_index[parent_list[n]] if parent_list[n] != -1 else -1 for n in keep]
        self.last_scores = torch.tensor([score_list[n] for n in keep])
        return Proposal(
            tokens=torch.tensor([tok_list[n] for n in keep], dtype=torch.long, device=dev),
            parents=torch.tensor(parents, dtype=torch.long, device=dev),
            # The reranking order: its best m nodes are the tree this proposer keeps at
            # total_tokens = m (the loop counts what each would accept). A host tensor: the
            # loop reads it on the host with the tree's parents.
            priority=torch.tensor([rank[n] for n in keep], dtype=torch.long),
            # Each node's probability given its parent, a host tensor (read with the parents).
            confidence=torch.tensor([cond_list[n] for n in keep]).exp(),
        )
