"""Draft trees: EAGLE-2 dynamic trees (and chains, the top-1 special case) built from a `DraftModel`.

EAGLE-2 (arXiv:2406.16858) grows the tree by expected acceptance: at every depth the drafter runs once for all
frontier nodes; each proposes its `top_k` children, and the `top_k` children with the highest cumulative draft
log-probability become the next frontier. Every proposed child is a candidate; the final tree keeps the
`total_tokens` best candidates. A child's cumulative log-prob never exceeds its parent's, so taking candidates
best-first from the root returns that top set and keeps it closed under ancestors even when scores tie.

A chain of K tokens is the tree with `top_k=1, depth=K, total_tokens=K`. With `TreeSpec.min_prob`, candidates whose
cumulative draft probability is below it are neither expanded nor kept, so the tree may have no draft node at all.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import torch

from eagle3_zoo.modeling import DraftStepOutput
from eagle3_zoo.speculative.draft import DraftModel
from eagle3_zoo.values.draft_shapes import TreeSpec


@dataclass
class DraftTree:
    """A draft tree flattened so that every parent precedes its children; node 0 is the root.

    Attributes:
        tokens: `[n+1]` target ids; `tokens[0]` is the root (the last emitted token, not yet seen by the target).
        parents: `[n+1]` parent node index; -1 for the root.
        depths: `[n+1]` depth below the root (root 0).
        children: Per node, its children ordered by descending draft score.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    children: list[list[int]]

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def ancestor_mask(self) -> torch.Tensor:
        """`[n+1, n+1]` bool: True where node i may attend node j (j is i or one of its ancestors)."""
        return _ancestor_mask(self.parents.tolist(), self.tokens.device)


def _ancestor_mask(parents: list[int], device: torch.device | None = None) -> torch.Tensor:
    n = len(parents)
    mask = torch.eye(n, dtype=torch.bool, device=device)
    for i, p in enumerate(parents):
        if p >= 0:  # parents precede children, so the parent's row is complete
            mask[i] |= mask[p]
    return mask


@torch.no_grad()
def build_tree(draft: DraftModel, root_token: int, root_out: DraftStepOutput, spec: TreeSpec) -> DraftTree:
    """Draft a tree below `root_token`.

    Args:
        draft: The drafter, with its context extended up to (and including) `root_token`.
        root_token: The last emitted token (target id).
        root_out: `DraftStepOutput` of the last context row (logits `[1, 1, Vd]`, hidden `[1, 1, H]`).
        spec: Tree shape.

    Returns:
        The reranked `DraftTree` with at most `spec.total_tokens` draft nodes (none above the root when no
        candidate reaches `spec.min_prob`).
    """
    floor = math.log(spec.min_prob) if spec.min_prob > 0 else -math.inf
    logp = torch.log_softmax(root_out.logits[0, -1].float(), dim=-1)
    k = min(spec.top_k, logp.shape[-1])
    scores, ids = logp.topk(k)
    cand_ids, cand_scores = [ids], [scores]
    cand_parents = [torch.full((k,), -1, dtype=torch.long)]
    cand_depths = [1] * k
    frontier = [c for c, score in enumerate(scores.tolist()) if score >= floor]  # candidates to expand next
    frontier_hidden = root_out.hidden[:, -1:].expand(1, len(frontier), -1)
    slot = {}  # candidate index -> position among the drafter's cached tree entries
    parents_of_slots: list[int] = []  # parent slot of every cached entry (-1: hangs below the context)
    n_cand = k
    for depth in range(2, spec.depth + 1):
        if not frontier:  # nothing left above min_prob: the children would score lower still
            break
        all_ids = torch.cat(cand_ids)
        all_scores = torch.cat(cand_scores)
        all_parents = torch.cat(cand_parents).tolist()
        n_old = len(parents_of_slots)
        for c in frontier:
            slot[c] = len(parents_of_slots)
            parents_of_slots.append(slot[all_parents[c]] if all_parents[c] >= 0 else -1)
        visible = _ancestor_mask(parents_of_slots)[n_old:]
        front = torch.tensor(frontier)
        out = draft.expand(draft.to_target(all_ids[front]), frontier_hidden,
                           torch.full((len(frontier),), depth - 1, dtype=torch.long), visible)
        child_logp = torch.log_softmax(out.logits[0].float(), dim=-1)
        top_logp, top_ids = child_logp.topk(k, dim=-1)  # [q, k]
        cum = (all_scores[front].unsqueeze(1) + top_logp.to(all_scores.device)).reshape(-1)
        cand_ids.append(top_ids.reshape(-1).to(all_ids.device))
        cand_scores.append(cum)
        cand_parents.append(front.repeat_interleave(k))
        cand_depths += [depth] * cum.numel()
        best = cum.topk(min(k, cum.numel())).indices
        best = best[cum[best] >= floor]
        frontier = (n_cand + best).tolist()
        frontier_hidden = out.hidden[:, (best // k).to(out.hidden.device)]
        n_cand += cum.numel()
    all_ids = torch.cat(cand_ids)
    selected = _best_first(torch.cat(cand_scores).tolist(), torch.cat(cand_parents).tolist(), spec.total_tokens, floor)
    return _flatten(selected, draft.to_target(all_ids).tolist(), torch.cat(cand_parents).tolist(),
                    cand_depths, root_token)


def _best_first(scores: list[float], parents: list[int], total: int, floor: float = -math.inf) -> list[int]:
    """Candidates in the order a best-first walk from the root takes them, `total` at most, none scoring below
    `floor` (the walk pops the best remaining score, and no child outscores its parent)."""
    children: dict[int, list[int]] = {}
    for c, p in enumerate(parents):
        children.setdefault(p, []).append(c)
    heap = [(-scores[c], c) for c in children.get(-1, [])]
    heapq.heapify(heap)
    order: list[int] = []
    while heap and len(order) < total:
        _, c = heapq.heappop(heap)
        if scores[c] < floor:
            break
        order.append(c)
        for child in children.get(c, []):
            heapq.heappush(heap, (-scores[child], child))
    return order


def _flatten(selected: list[int], tokens: list[int], parents: list[int], depths: list[int], root: int) -> DraftTree:
    # stable sort by depth keeps the best-first (descending score) order among siblings and parents before children
    order = sorted(selected, key=lambda c: depths[c])
    index = {c: i + 1 for i, c in enumerate(order)}
    node_parents = [-1] + [index[parents[c]] if parents[c] >= 0 else 0 for c in order]
    children: list[list[int]] = [[] for _ in range(len(order) + 1)]
    for i, p in enumerate(node_parents[1:], start=1):
        children[p].append(i)
    return DraftTree(
        tokens=torch.tensor([root] + [tokens[c] for c in order], dtype=torch.long),
        parents=torch.tensor(node_parents, dtype=torch.long),
        depths=torch.tensor([0] + [depths[c] for c in order], dtype=torch.long),
        children=children,
    )
