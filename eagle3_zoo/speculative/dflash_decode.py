"""Lossless greedy speculative decoding with a DFlash block drafter, batch size 1.

One request:
  1. prefill: the target reads the prompt `[n]`, capturing the drafter's feature layers (`DFlashConfig.aux_layer_ids`
     = `target_layer_ids + 1`: the residual stream entering layer id+1 is the output of layer id), and picks the first
     token x_n greedily; the drafter's context cache takes the features of positions 0..n-1.
  2. cycle: the drafter drafts one block in ONE forward: the anchor is the last emitted token (the target's bonus,
     whose features the target has not computed yet) at position P = cached context length, the B-1 masked slots
     propose the tokens at P+1..P+B-1. The target verifies the chain `[anchor, d_1 .. d_{B-1}]` in ONE forward at
     positions P..P+B-1; the longest prefix d_1..d_a equal to the target's greedy tokens is accepted, plus the
     target's own token after it (the bonus). The target's KV cache keeps P + 1 + a entries (the anchor and the
     accepted drafts); the features of those a + 1 positions, computed by the same verification forward, are
     appended to the drafter's context cache (each position projected once per draft layer, as vLLM 0.32's DFlash
     proposer does), and the bonus is the next anchor.
  3. stop exactly where `generate` would: at the first EOS/stop token (kept) or at `max_new_tokens`, even inside an
     accepted block.

Every emitted token is the target's greedy choice given the tokens before it, so the output equals plain greedy
decoding whatever the drafter proposes. The per-cycle record (`GenerationOutput.accept_lengths`, `attempted_next`)
is the EAGLE-3 generator's, so `BenchStats` pools tau (accepted + 1 per cycle), acceptance per position and
tokens/s the same way for both drafter kinds (`measure`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from eagle3_zoo.adapters import TargetAdapter, adapter_for
from eagle3_zoo.drafters.base import BlockProposer
from eagle3_zoo.drafters.dflash.decoding import DFlashProposer
from eagle3_zoo.drafters.dflash.model import DFlashDrafter
from eagle3_zoo.speculative.acceptance import SamplingParams, accept
from eagle3_zoo.speculative.generate import GenerationOutput, _emit, eos_ids, plain_generate
from eagle3_zoo.speculative.metrics import BenchStats
from eagle3_zoo.speculative.target import TargetRunner
from eagle3_zoo.speculative.tree import DraftTree

__all__ = ["BlockProposer", "DFlashGenerator", "DFlashProposer", "chain_tree", "measure"]

_GREEDY = SamplingParams()


def chain_tree(tokens: Sequence[int]) -> DraftTree:
    """The chain `tokens[0] -> tokens[1] -> ...` as a `DraftTree` (root = the anchor)."""
    n = len(tokens)
    return DraftTree(tokens=torch.tensor(list(tokens), dtype=torch.long),
                     parents=torch.arange(-1, n - 1, dtype=torch.long),
                     depths=torch.arange(n, dtype=torch.long),
                     children=[[i + 1] for i in range(n - 1)] + [[]])


def _check_fits(drafter: DFlashDrafter, target: nn.Module, adapter: TargetAdapter) -> None:
    c, tc = drafter.config, target.config
    problems = []
    layers = len(adapter.decoder_layers(target))
    if c.num_target_layers != layers:
        problems.append(f"num_target_layers={c.num_target_layers} but the target has {layers} decoder layers")
    if c.target_hidden_size != tc.hidden_size:
        problems.append(f"target_hidden_size={c.target_hidden_size} but the target's hidden_size is {tc.hidden_size}")
    if c.vocab_size != tc.vocab_size:
        problems.append(f"vocab_size={c.vocab_size} but the target's is {tc.vocab_size}")
    bad = [i for i in c.aux_layer_ids if i >= layers]
    if bad:
        problems.append(f"target_layer_ids={list(c.target_layer_ids)} read the output of layer id (captured entering "
                        f"layer id+1 = {bad}); the last one whose output enters a layer is {layers - 2}")
    if problems:
        raise ValueError("DFlash drafter does not fit the target: " + "; ".join(problems))


class DFlashGenerator:
    """Greedy speculative decoding of a Hugging Face causal LM with a DFlash drafter (or any `BlockProposer`).

    Args:
        target: The target ``*ForCausalLM`` (frozen, eval mode, sdpa or eager attention).
        drafter: A `DFlashDrafter` (wrapped with the target's embedding and lm_head) or a `BlockProposer`.
        adapter: The target's adapter; default ``adapter_for(target)``.
        layer_ids: Feature layers (internal convention: hidden state entering the layer); default the drafter
            config's ``aux_layer_ids``; required with a `BlockProposer`.
    """

    def __init__(self, target: nn.Module, drafter: DFlashDrafter | BlockProposer,
                 adapter: TargetAdapter | None = None, layer_ids: Sequence[int] | None = None):
        adapter = adapter or adapter_for(target)
        if isinstance(drafter, DFlashDrafter) and drafter.sample_from_anchor:
            raise ValueError(f"{type(drafter).__name__} predicts from the anchor slot (sample_from_anchor): wrap it in "
                             "its own BlockProposer (a DSpark drafter: eagle3_zoo.speculative.dspark_decode)")
        if isinstance(drafter, DFlashDrafter):
            _check_fits(drafter, target, adapter)
            layer_ids = layer_ids or drafter.config.aux_layer_ids
            head = None if drafter.config.reduced_vocab else adapter.lm_head(target).weight
            drafter = DFlashProposer(drafter, adapter.embed_tokens(target).weight, head)
        elif layer_ids is None:
            raise ValueError("layer_ids is required with a BlockProposer (the target layers whose entering hidden "
                             "states it reads); a DFlashDrafter brings its own (config.aux_layer_ids)")
        if drafter.num_draft < 1:
            raise ValueError(f"the drafter proposes {drafter.num_draft} tokens per block; expected >= 1")
        self.target = target
        self.draft = drafter
        self.runner = TargetRunner(target, adapter, layer_ids)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int,
                 eos_token_id: int | Iterable[int] | None = None) -> GenerationOutput:
        """Greedy-decode up to `max_new_tokens` after `input_ids` (`[n]` or `[1, n]`), stopping at the first
        EOS/stop token (default the target's ``generation_config.eos_token_id``)."""
        ids = _prompt(input_ids, max_new_tokens)
        stop = eos_ids(self.target, eos_token_id)
        start = time.perf_counter()
        runner, draft = self.runner, self.draft
        draft.reset()
        logits, aux = runner.prefill(ids)
        anchor = int(logits.argmax(-1))
        out = GenerationOutput(tokens=[])
        reason = _emit(out.tokens, [anchor], max_new_tokens, stop)
        if reason is None:
            draft.extend(aux)
        while reason is None:
            tree = chain_tree([anchor, *draft.propose(anchor)])
            node_logits, aux = runner.verify(tree)
            result = accept(tree, node_logits, _GREEDY)  # the chain prefix the target's argmax follows, + its bonus
            accepted = len(result.path) - 1
            out.accept_lengths.append(accepted)
            out.attempted_next.append(result.attempted_next)
            runner.keep_path(result.path)  # the anchor and the accepted drafts stay; the rejected tail goes
            reason = _emit(out.tokens, [*tree.tokens[1:accepted + 1].tolist(), result.bonus], max_new_tokens, stop)
            if reason is None:
                draft.extend(aux[:, : accepted + 1])  # features of the anchor and the accepted drafts
                anchor = result.bonus
        out.stop_reason = reason
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
        out.seconds = time.perf_counter() - start
        return out


def _prompt(input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    if not (input_ids.dim() == 1 or (input_ids.dim() == 2 and input_ids.shape[0] == 1)):
        raise ValueError(f"batch size 1 only: input_ids has shape {tuple(input_ids.shape)}; expected [n] or [1, n]")
    ids = input_ids.reshape(-1)
    if ids.numel() == 0:
        raise ValueError("input_ids is empty: a prompt needs at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    return ids


def measure(generator: DFlashGenerator, prompts: Sequence[torch.Tensor], max_new_tokens: int,
            eos_token_id: int | Iterable[int] | None = None, warmup: int = 1) -> dict[str, Any]:
    """Decode every prompt speculatively and with plain greedy KV-cache decoding (same process, after `warmup`
    untimed requests of each) and pool them like the EAGLE-3 evaluation (`BenchStats`, protocol in
    `eagle3_zoo.speculative.metrics.PROTOCOL`): tau, acceptance per draft position, tokens/s of both, speedup, and
    whether every speculative output equals the plain greedy one (`lossless`)."""
    if not prompts:
        raise ValueError("measure needs at least one prompt")
    for p in list(prompts)[:warmup]:
        generator.generate(p, max_new_tokens, eos_token_id)
        plain_generate(generator.target, p, max_new_tokens, eos_token_id=eos_token_id)
    stats = BenchStats()
    for i, p in enumerate(prompts):
        spec = generator.generate(p, max_new_tokens, eos_token_id)
        base = plain_generate(generator.target, p, max_new_tokens, eos_token_id=eos_token_id)
        stats.add(spec, base, request_id=str(i), check_lossless=True)
    return stats.summary()
