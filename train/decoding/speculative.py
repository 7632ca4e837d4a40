"""The speculative verification loop: draft, verify in one target forward, accept, repeat.

One loop serves every drafter (see :mod:`draftsmith.heads.base` for the contract). Batch size 1,
optimised for it: the target's KV cache persists across steps and is cropped on rejection (no
re-prefill), only the rows of logits that are needed are computed, and hidden states are requested
from the target only when the drafter declared layers it needs.

Acceptance rules:

* greedy (temperature 0): accept draft tokens while they equal the target's argmax; then emit the
  target's own token (the correction at the first mismatch, or the bonus token after k accepts).
  The output is the target's greedy output token for token.
* sampling: accept draft token x with probability min(1, p(x) / q(x)); on rejection emit a token
  drawn from norm(max(0, p - q)); after k accepts draw the bonus token from p (Leviathan et al.
  2023, Alg. 1 / Thm. 1; Chen et al. 2023, Alg. 2). p and q are the processed distributions
  (temperature, top-k, top-p), so the output follows the target's own sampling distribution.

Tree drafts (``Proposal.parents`` set) are verified in one forward with a 4D ancestor attention
mask and depth-based position ids (SpecInfer §4; Medusa §2.1.2; EAGLE-2 §4); the KV cache then
keeps only the accepted path. Which path:

* greedy: the longest path that matches the target's greedy choices.
* sampling: multi-candidate speculative sampling over each node's children (SpecInfer, Miao et
  al. 2024, §4.2 / Alg. 2, recursive rejection sampling). From the root, with the target's
  processed distribution r = p at the current node, the children are tried in order: child x
  with draft row q (``Proposal.probs``: the distribution x was drawn from given its path and its
  earlier siblings; one-hot on x when the proposal has no probs) is accepted with probability
  min(1, r(x) / q(x)); on rejection r <- norm(max(0, r - q)) (one-hot q: r with x zeroed,
  renormalised -- EAGLE-2's rule for its top-k candidates). On acceptance the walk moves to x
  (r = p there); when every child is rejected, or at a leaf, the target's token is drawn from r.
  Each trial is one speculative-sampling step against the current residual, so the emitted
  token follows p at every node (SpecInfer Thm. 4.2) whatever the siblings' q rows are, as long
  as each row is the distribution its candidate was really drawn from.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
from transformers import DynamicCache, PreTrainedModel

from ...heads.base import Drafter, Features, GenerationOutput, Proposal
from ...heads.sampling import (
    SamplingParams,
    choose,
    eos_set,
    greedy_ids,
    logits_to_probs,
    sample,
)
from ..device import DeviceTimer, IntervalTimer
from ..target_model.kernels import grouped_kv_attention
from .draft_length import AdaptiveDraftLength


def _as_prompt(prompt_ids: torch.Tensor | list[int], device: torch.device) -> torch.Tensor:
    ids = torch.as_tensor(prompt_ids, dtype=torch.long, device=device)
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2:
        raise ValueError(f"prompt_ids must be [T] or [1, T], got shape {tuple(ids.shape)}")
    if ids.shape[0] != 1:
        raise ValueError(
            f"batch size {ids.shape[0]} is not supported: the verification loop runs one sequence "
            "at a time (batch size 1); loop over prompts instead"
        )
    if ids.shape[1] == 0:
        raise ValueError("prompt_ids is empty: the loop needs at least one prompt token")
    return ids


def _features(out, layers: tuple[int, ...], index: torch.Tensor | slice) -> Features | None:
    """Pick the requested layers' hidden states at the given positions ([1, n, H] each)."""
    if not layers:
        return None
    return {layer: out.hidden_states[layer][:, index] for layer in layers}


def _keep_cache(cache: DynamicCache, keep: int, extra: torch.Tensor | None = None) -> None:
    """Roll the KV cache back to its first ``keep`` positions, plus ``extra`` absolute positions.

    ``extra`` (sorted, all >= keep) is used for tree paths, whose kept nodes are not contiguous.
    """
    for layer in cache.layers:
        if not getattr(layer, "is_initialized", True) or layer.keys is None:
            continue
        if extra is None or extra.numel() == 0:
            layer.keys = layer.keys[..., :keep, :]
            layer.values = layer.values[..., :keep, :]
        else:
            # Move the m kept rows down to keep..keep+m-1 and cut the rest: copies m rows per
            # layer, not the whole cache (an index_select of every row cost ~3 % of a bf16 tree
            # round of SmolLM2 at 300 tokens). Safe in place: extra[i] >= keep + i, and the rows
            # are gathered before they are written.
            m = extra.numel()
            for name in ("keys", "values"):
                t = getattr(layer, name)
                t[..., keep : keep + m, :] = t.index_select(-2, extra)
                setattr(layer, name, t[..., : keep + m, :])


def _accept_chain(
    logits: torch.Tensor,
    proposal: Proposal,
    sampling: SamplingParams,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """Decide how many chain tokens to accept and which token the target emits after them.

    Everything stays on the logits' device: the caller reads the decision once per step (one
    host sync), together with the draft tokens.

    Args:
        logits: ``[n + 1, V]`` target logits at the last accepted token and at each draft token.
        proposal: the n draft tokens (and q), on the logits' device.
        sampling: sampling parameters.
        generator: randomness, on the logits' device.

    Returns:
        ``[2]`` long tensor ``(num_accepted, next_token)``.
    """
    draft = proposal.tokens
    n = draft.shape[0]
    if sampling.greedy:
        choice = greedy_ids(logits)  # [n + 1]
        # Leading run of matches: cumprod turns the first mismatch and all after it into 0.
        accepted = (choice[:n] == draft).to(torch.long).cumprod(0).sum()
        return torch.stack([accepted, choice[accepted]])

    p = logits_to_probs(logits, sampling)  # [n + 1, V]
    q = proposal.probs
    if not n:
        return torch.stack(
            [torch.zeros((), dtype=torch.long, device=p.device), sample(p[0], generator)]
        )
    u = torch.rand(n, generator=generator, device=p.device)
    rows = torch.arange(n, device=p.device)
    p_x = p[rows, draft]
    q_x = q[rows, draft] if q is not None else torch.ones_like(p_x)
    # Accept when u < p(x)/q(x), written as u * q(x) < p(x) to avoid dividing.
    accepted = (u * q_x < p_x).to(torch.long).cumprod(0).sum()
    # Exactly one draw either way, from the residual at the first rejection or from p after n
    # accepts (the bonus token); chosen on the device, so no host sync decides it.
    i = accepted.clamp(max=n - 1)
    p_i = p.index_select(0, i[None])[0]
    if q is not None:
        residual = (p_i - q.index_select(0, i[None])[0]).clamp_min(0.0)
    else:
        residual = p_i.index_fill(0, draft.index_select(0, i[None]), 0.0)
    # An all-zero residual is only possible when p == q up to rounding, where rejection has
    # probability 0: draw from p then.
    residual = torch.where(residual.sum() > 0, residual, p_i)
    dist = torch.where(accepted < n, residual, p[n])
    return torch.stack([accepted, sample(dist, generator)])


def _tree_inputs(
    par: list[int], past: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ancestor mask and position ids for verifying a tree in one forward.

    Row/column 0 is the root (the last accepted token); node j of the proposal is row j + 1.

    Args:
        par: the proposal's parent indices (host list; -1 = the root).
        past: positions already in the target's KV cache.
        device: where the target runs.

    Returns:
        ``(mask [1, 1, n + 1, past + n + 1] bool, position_ids [1, n + 1], depth [n + 1])``.
    """
    n = len(par)
    anc = torch.eye(n + 1, dtype=torch.bool)
    depth = [0] * (n + 1)
    for j, parent in enumerate(par):
        if not -1 <= parent < j:
            raise ValueError(
                f"tree proposal: node {j} has parent {parent}; parents must precede children "
                "(-1 = the root)"
            )
        anc[j + 1] |= anc[parent + 1]
        depth[j + 1] = depth[parent + 1] + 1
    mask = torch.cat([torch.ones(n + 1, past, dtype=torch.bool), anc], dim=1)
    depth_t = torch.tensor(depth, dtype=torch.long)
    return mask[None, None].to(device), (depth_t + past)[None].to(device), depth_t


def _accept_tree_greedy(
    choice: list[int], toks: list[int], par: list[int]
) -> tuple[list[int], int]:
    """Longest root-to-node path whose tokens equal the target's argmax at each parent.

    Args:
        choice: the target's argmax at the root and at each node (``n + 1`` host ints).
        toks: the n node tokens; par: their parents (-1 = the root).

    Returns:
        ``(path, next_token)`` where path lists accepted node rows (1-based, root excluded).
    """
    children: dict[int, list[int]] = {}
    for j, parent in enumerate(par):
        children.setdefault(parent + 1, []).append(j + 1)
    path: list[int] = []
    row = 0
    while True:
        want = choice[row]
        nxt = next((c for c in children.get(row, ()) if toks[c - 1] == want), None)
        if nxt is None:
            return path, want
        path.append(nxt)
        row = nxt


def _tree_children(par: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's children, and the rows that have any.

    Rows as in :func:`_tree_inputs` (0 = the root, node j = row j + 1).

    Returns:
        ``(kids [n + 1, R] long, inner [m] long)``: ``kids[row, i]`` is the row of ``row``'s
        i-th child in proposal order (0 = none; R = most children of a row); ``inner`` lists
        the m rows with at least one child, ascending.
    """
    kids: list[list[int]] = [[] for _ in range(len(par) + 1)]
    for j, parent in enumerate(par):
        kids[parent + 1].append(j + 1)
    width = max(len(c) for c in kids)
    inner = [row for row, c in enumerate(kids) if c]
    return (
        torch.tensor([c + [0] * (width - len(c)) for c in kids], device=device),
        torch.tensor(inner, dtype=torch.long, device=device),
    )


def _accept_tree_sampled(
    logits: torch.Tensor,
    proposal: Proposal,
    kids: torch.Tensor,
    inner: torch.Tensor,
    depth: int,
    sampling: SamplingParams,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """Multi-candidate speculative sampling over a tree (SpecInfer §4.2, Alg. 2), on the device.

    The walk visits each row at most once and a row's decision needs only its own children, so
    every decision is made up front, batched over the rows that have children and done by
    sibling rank: per row, which child is accepted first when they are tried in order against
    the row's running residual r. The walk -- follow the accepted children from the root --
    runs on the device too, and one token is drawn from the residual of the row where it stops
    (every child rejected, or a leaf). Every node has its own uniform, so the tests along the
    walked path are independent, as the sequential rule needs.

    Cost: target probabilities are computed only for the rows with children and for the
    walk's last row, and the draw is one row, not one per tree row (an 8-node tree at a
    49k vocabulary: 13 ms per step before, on one CPU thread).

    With deterministic candidates (``proposal.probs`` None: q one-hot on each candidate, as
    EAGLE-2 and Medusa trees draft top-k tokens) the residual after rejecting candidates
    x_1..x_{i-1} is p with those tokens zeroed, renormalised, so the test of x_i needs only
    ``p(x_i) / (1 - sum of the distinct earlier p(x_j))`` (0 for a repeat of a rejected token),
    gathered at the candidates: no full-vocabulary row per sibling.

    Args:
        logits: ``[n + 1, V]`` target logits at the root and at each node.
        proposal: the n nodes (tokens, and probs or None), on the logits' device.
        kids, inner: :func:`_tree_children` of the proposal's parents.
        depth: at least the tree's depth (the walk's most steps; extra steps stay at its end).
        sampling: sampling parameters (not greedy).
        generator: randomness, on the logits' device.

    Returns:
        ``[n + 2]`` long: per row its first accepted child's row (0 = none; 0 for rows without
        children), then the token the target emits after the accepted path.
    """
    dev = logits.device
    rows = logits.shape[0]
    u = torch.rand(rows, generator=generator, device=dev)  # u[c]: node row c's test
    tokens = torch.cat([torch.zeros(1, dtype=torch.long, device=dev), proposal.tokens])
    cand = kids.index_select(0, inner)  # [m, R] candidate rows of each inner row
    has = cand > 0
    x = tokens.index_select(0, cand.flatten()).view(cand.shape)  # [m, R] their tokens
    p_in = logits_to_probs(logits.index_select(0, inner), sampling)  # [m, V]
    u_c = u.index_select(0, cand.flatten()).view(cand.shape)
    q = None
    if proposal.probs is None:
        width = cand.shape[1]
        before = torch.ones(width, width, dtype=torch.bool, device=dev).tril(-1)  # [i, j]: j < i
        repeat = ((x[:, :, None] == x[:, None, :]) & has[:, None, :] & before).any(-1)
        p_x = p_in.gather(1, x) * has
        fresh = torch.where(repeat, 0.0, p_x)
        left = 1.0 - (fresh.cumsum(1) - fresh)  # mass not yet rejected before candidate i
        # left <= 0 only by rounding when every earlier candidate held all the mass; r(x) is
        # then p(x) as the loop's residual rule keeps r unchanged.
        r_x = torch.where(repeat, 0.0, p_x / torch.where(left > 0, left, 1.0))
        accept = has & (u_c < r_x)  # u < r(x) / q(x) with q(x) = 1
        r_in = None
    else:
        q = torch.cat([torch.zeros_like(proposal.probs[:1]), proposal.probs]).to(dev, p_in.dtype)
        accept = torch.zeros_like(has)
        r_in = p_in
        for i in range(cand.shape[1]):
            c = cand[:, i]
            q_c = q.index_select(0, c)  # [m, V]
            r_x = r_in.gather(1, x[:, i : i + 1])[:, 0]
            q_x = q_c.gather(1, x[:, i : i + 1])[:, 0]
            # Accept when u < r(x)/q(x), written as u * q(x) < r(x).
            accept[:, i] = has[:, i] & (u_c[:, i] * q_x < r_x)
            residual = (r_in - q_c).clamp_min(0.0)
            # An all-zero residual is only possible when r == q up to rounding, where rejection
            # has probability 0: keep r then.
            total = residual.sum(-1, keepdim=True)
            update = has[:, i : i + 1] & (total > 0)
            r_in = torch.where(update, residual / torch.where(total > 0, total, 1.0), r_in)
    # A row keeps its first acceptance (argmax returns the first maximal index).
    pick = accept.to(torch.uint8).argmax(1, keepdim=True)
    first_in = torch.where(accept.any(1), cand.gather(1, pick)[:, 0], 0)
    first = torch.zeros(rows, dtype=torch.long, device=dev).index_copy(0, inner, first_in)

    # The walk: each accepted child leads on, a row with none is where it stops.
    step = torch.where(first > 0, first, torch.arange(rows, device=dev))
    last = torch.zeros(1, dtype=torch.long, device=dev)
    for _ in range(depth):
        last = step.index_select(0, last)
    p_last = logits_to_probs(logits.index_select(0, last), sampling)  # [1, V]
    if q is None:
        # Every child of the last row was rejected: zero their tokens (none for a leaf).
        last_kids = kids.index_select(0, last)[0]  # [R]
        hit = torch.zeros_like(p_last[0]).scatter_add(
            0, tokens.index_select(0, last_kids), (last_kids > 0).to(p_last.dtype)
        )
        residual = p_last[0] * (hit == 0)
    else:
        # The inner rows' residuals after all their children; a leaf's is p.
        slot = torch.full((rows,), -1, dtype=torch.long, device=dev).index_copy(
            0, inner, torch.arange(inner.shape[0], device=dev)
        )
        at = slot.index_select(0, last)
        residual = torch.where(at >= 0, r_in.index_select(0, at.clamp_min(0))[0], p_last[0])
    # All-zero only by rounding (see above): draw from p then.
    residual = torch.where(residual.sum() > 0, residual, p_last[0])
    return torch.cat([first, sample(residual, generator)[None]])


def _count_pruned(sums: list[int], priority: torch.Tensor, path: list[int], n: int) -> None:
    """Add one tree step to ``sums[m - 1]``: what the tree's best m nodes would have accepted.

    A tree pruned to its best m nodes (``Proposal.priority`` below m) keeps a prefix of the
    accepted path: ranks grow along a path (a parent outranks its children) and a pruned tree
    keeps a prefix of each node's children in the order the sibling tests take them, so every
    test up to the first pruned path node decides as it did. Sizes past this step's n nodes
    accepted the whole path. ``sums`` grows to the largest tree seen; the steps before had at
    most its old length in nodes, so a new size's sum starts at the last one's.

    Args:
        sums: the run's ``GenerationOutput.accepted_by_tree_size``, updated in place.
        priority: ``[n]`` the proposal's ``Proposal.priority``, a host tensor (reading it does
            not wait for the device).
        path: the accepted path's rows in the verify input (node j is row j + 1), root to leaf.
        n: the step's tree size.
    """
    ranks = priority.tolist()
    path_ranks = [ranks[row - 1] for row in path]
    if len(sums) < n:
        sums.extend([sums[-1] if sums else 0] * (n - len(sums)))
    for m in range(1, len(sums) + 1):
        sums[m - 1] += sum(1 for r in path_ranks if r < m)


def _tree_path(first: list[int]) -> list[int]:
    """Follow the accepted children from the root (host list from :func:`_accept_tree_sampled`).

    Returns:
        The accepted node rows (1-based, root excluded), root to leaf.
    """
    path: list[int] = []
    row = 0
    while first[row]:
        row = first[row]
        path.append(row)
    return path


@torch.inference_mode()
def generate(
    target: PreTrainedModel,
    prompt_ids: torch.Tensor | list[int],
    drafter: Drafter | None = None,
    *,
    k: int = 5,
    max_new_tokens: int = 128,
    sampling: SamplingParams | None = None,
    eos_token_id: int | Collection[int] | None = None,
    generator: torch.Generator | None = None,
    draft_length: AdaptiveDraftLength | None = None,
) -> GenerationOutput:
    """Generate with speculative decoding (or plain decoding when ``drafter`` is None).

    Args:
        target: HF causal LM (eval mode); its distribution defines the output.
        prompt_ids: ``[T]`` or ``[1, T]`` prompt tokens. Batch > 1 is rejected.
        drafter: proposes tokens; None runs plain decoding through the same code path.
        k: most draft tokens per step (chain length / tree depth), >= 1.
        max_new_tokens: generation budget, >= 1; stops exactly where plain decoding would.
        sampling: greedy by default.
        eos_token_id: token(s) that end generation (kept in the output, as HF does).
        generator: randomness for sampling (seed it for reproducible runs).
        draft_length: if given, picks each step's draft length (<= k) from measured acceptance
            and costs (see :mod:`draftsmith.train.decoding.draft_length`); None drafts k every step.

    Returns:
        The generated tokens and counters.
    """
    sampling = sampling or SamplingParams()
    if k < 1:
        raise ValueError(f"k must be >= 1 (draft tokens per step), got {k}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    device = next(target.parameters()).device
    prompt = _as_prompt(prompt_ids, device)
    eos = eos_set(eos_token_id)
    layers = tuple(drafter.feature_layers) if drafter is not None else ()
    want_hidden = bool(layers)
    # The wall clock is read (after the device has finished: a GPU runs ahead of the host) at
    # the prompt's start and end only; the draft and prefill intervals are device events summed
    # once at the end (IntervalTimer): no synchronize inside a step that plain decoding, timed
    # by the same function, would not pay. An adaptive draft length needs each step's times on
    # the host as it goes, so with one those reads synchronize (the policy's own cost).
    clock = DeviceTimer(device).now
    drafting = IntervalTimer(device)
    prefill = IntervalTimer(device)

    # Batch-1 decoding on a CPU: SDPA reads the grouped K/V heads directly (no repeat_kv copy
    # of the cache before each verify forward; train/target_model/kernels.py).
    with grouped_kv_attention(device):
        t_start = clock()
        prefill_mark = prefill.start()
        result = GenerationOutput(tokens=[], accepted_per_position=[0] * k)

        # Prefill: the prompt's logits at its last position give the first token, exactly as plain
        # decoding; the drafter gets the prompt's hidden states from this same forward.
        cache = DynamicCache(config=target.config)
        out = target(
            input_ids=prompt,
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
            output_hidden_states=want_hidden,
        )
        result.target_forwards = 1
        first, _ = choose(out.logits[0, -1], sampling, generator)
        emitted = [int(first)]  # sync: the first token decides whether generation goes on
        if drafter is not None:
            mark = drafting.start()
            drafter.start(prompt, _features(out, layers, slice(None)))
            drafting.stop(mark)
        prefill.stop(prefill_mark)

        # ids holds prompt + emitted tokens in a preallocated buffer (no re-allocation per step).
        buf = torch.empty(1, prompt.shape[1] + max_new_tokens, dtype=torch.long, device=device)
        buf[:, : prompt.shape[1]] = prompt
        length = prompt.shape[1]
        new_tokens = result.tokens
        empty = Proposal(tokens=torch.empty(0, dtype=torch.long, device=device))

        # One step = draft, one target forward, one host read of its outcome (how many tokens were
        # accepted decides the next step on the host; every other value stays on the device).
        while True:
            # Stop checks on what was just emitted: truncate after the first EOS and at the budget,
            # so the output ends exactly where plain decoding's would.
            budget = max_new_tokens - len(new_tokens)
            emitted = emitted[:budget]
            for i, tok in enumerate(emitted):
                if tok in eos:
                    emitted = emitted[: i + 1]
                    result.stop_reason = "eos"
                    break
            new_tokens.extend(emitted)
            buf[0, length : length + len(emitted)] = torch.tensor(emitted, device=device)
            length += len(emitted)
            if result.stop_reason == "eos" or len(new_tokens) >= max_new_tokens:
                break
            ids = buf[:, :length]
            past = length - 1  # the target has seen every token but the last

            # Draft. Never propose more than the budget can use: a step emits accepted + 1 tokens.
            k_step = min(k, max_new_tokens - len(new_tokens) - 1)
            if draft_length is not None and drafter is not None:
                k_step = draft_length.choose(k_step)
            step_draft_time = 0.0
            if drafter is not None and k_step > 0:
                if draft_length is not None:  # the policy reads this step's time (a sync)
                    t0 = clock()
                mark = drafting.start()
                proposal = drafter.propose(ids, k_step, sampling, generator)
                drafting.stop(mark)
                if draft_length is not None:
                    step_draft_time = clock() - t0
                if proposal.parents is None and len(proposal) > k_step:
                    proposal = Proposal(  # a chain drafter that ignored k: keep what fits
                        proposal.tokens[:k_step],
                        None if proposal.probs is None else proposal.probs[:k_step],
                    )
            else:
                proposal = empty
            n = len(proposal)
            tree = proposal.parents is not None and n > 0
            t_verify = clock() if draft_length is not None else 0.0
            draft = proposal.tokens.to(device)

            # Verify all proposed tokens in one target forward.
            inputs = torch.cat([ids[:, -1], draft])[None]
            if tree:
                par = proposal.parents.tolist()  # sync: the tree's shape builds the mask
                mask, pos, _ = _tree_inputs(par, past, device)
                kids = None if sampling.greedy else _tree_children(par, device)
                out = target(
                    input_ids=inputs,
                    cache=cache,
                    use_cache=True,
                    attention_mask=mask,
                    position_ids=pos,
                    output_hidden_states=want_hidden,
                )
            else:
                out = target(
                    input_ids=inputs, cache=cache, use_cache=True, output_hidden_states=want_hidden
                )
            result.target_forwards += 1
            logits = out.logits[0]

            if tree:
                if kids is None:
                    decision = greedy_ids(logits)  # [n + 1]
                else:  # [n + 2]
                    tree_proposal = Proposal(draft, proposal.probs, proposal.parents)
                    # n bounds the depth: the walk stays put once it stops, so extra steps are free.
                    decision = _accept_tree_sampled(
                        logits, tree_proposal, *kids, n, sampling, generator
                    )
                read = torch.cat([decision, draft]).tolist()  # sync: the step's outcome
                toks = read[-n:]
                if kids is None:
                    path, nxt = _accept_tree_greedy(read[: n + 1], toks, par)
                else:
                    path, nxt = _tree_path(read[: n + 1]), read[n + 1]
                accepted = len(path)
                if proposal.priority is not None:
                    _count_pruned(result.accepted_by_tree_size, proposal.priority, path, n)
                emitted = [toks[row - 1] for row in path] + [nxt]
                kept_rows = torch.tensor([0, *path], device=device)
                _keep_cache(cache, past + 1, past + kept_rows[1:])
                kept: torch.Tensor | slice = kept_rows
            else:
                proposal = Proposal(draft, proposal.probs)
                decision = _accept_chain(logits, proposal, sampling, generator)
                read = torch.cat([decision, draft]).tolist()  # sync: the step's outcome, read once
                accepted, nxt = read[0], read[1]
                emitted = [*read[2 : 2 + accepted], nxt]
                if accepted < n:
                    cache.crop(accepted - n)
                kept = slice(0, accepted + 1)

            if draft_length is not None and drafter is not None and not tree:
                draft_length.update(n, accepted, clock() - t_verify, step_draft_time)
            if n:
                result.draft_steps += 1
                result.proposed += n
                result.accepted += accepted
                for i in range(min(accepted, k)):
                    result.accepted_per_position[i] += 1
            if drafter is not None:
                mark = drafting.start()
                drafter.accept(accepted, _features(out, layers, kept))
                drafting.stop(mark)

        result.wall_time = clock() - t_start
        result.draft_time = drafting.total()  # synchronized once, by the read above
        result.prefill_time = prefill.total()
        return result
