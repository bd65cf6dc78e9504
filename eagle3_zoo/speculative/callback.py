"""`TauEvalCallback`: real speculative decoding on held-out prompts during training, logged as `val/tau`.

The TTT accuracies estimate acceptance; this measures it, with the same generator and metric protocol as
`eagle3-zoo eval`, so checkpoints can be selected by measured tau
(``ModelCheckpoint(monitor="val/tau", mode="max")``).

It reads from the LightningModule: ``.drafter`` (a drafter of a registered kind), ``.target`` (the frozen target,
so online mode or any module that keeps the target), optionally ``.adapter`` and ``.tokenizer`` (needed for text prompts
unless a tokenizer is given to the callback). Text prompts are rendered as the data stage renders the training
conversations (`eagle3_zoo.chat.formats.prompt_ids`: the tokenizer's chat template, else the adapter's chat format,
with the recipe's ``data.chat_template_kwargs``), so tau is measured on prompts like those the drafter learns from.
It runs greedily; under torch.distributed (ddp) rank r of W decodes prompts r, r + W, ... and the per-prompt results
are gathered on every rank, so every rank logs exactly the figure one process would measure.

Under FSDP the drafter's shards are gathered into a plain copy on every rank (`unsharded_drafter`: its stored
weights, fp32 under bf16-mixed, not the policy's bf16 compute copy). A target whose decoder layers are sharded
(online mode) all-gathers each layer in every forward, a collective every rank must enter in the same order: then
every rank decodes every prompt in lockstep (greedy decoding takes the same steps on the same weights), and before
each target forward the ranks compare a fingerprint of its inputs (`Lockstep`), so ranks that decoded differently
fail together with an error instead of waiting on each other forever. A whole target (offline mode) splits the
prompts as under ddp.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from typing_extensions import override

from eagle3_zoo.chat.conversation import Message
from eagle3_zoo.speculative.benchmarks import chat_input_ids, completion_input_ids, prompt_chat_format
from eagle3_zoo.speculative.generate import SpeculativeGenerator, tree_spec
from eagle3_zoo.speculative.metrics import BenchStats
from eagle3_zoo.speculative.sharded import is_sharded, reshard, unsharded_drafter
from eagle3_zoo.values.draft_shapes import DEFAULT_DEPTH, DEFAULT_TOP_K, DEFAULT_TOTAL_TOKENS


class TauEvalCallback(L.Callback):
    """Every `every_n_steps` optimizer steps, decode `prompts` speculatively and log `val/tau` (and acceptance@1).

    Args:
        prompts: Text (one user turn through the chat template; raw text without a template) or token ids.
        every_n_steps: Evaluation period in optimizer steps.
        max_new_tokens: Per prompt.
        mode: ``"tree"`` or ``"chain"``; `depth`, `top_k`, `total_tokens` shape the draft as in `evaluate`.
        tokenizer: For text prompts; default: the trainer's DataModule's ``tokenizer`` (taken in `setup`), else
            ``pl_module.tokenizer``.
        chat_template_kwargs: Variables of the chat template (the running recipe's ``data.chat_template_kwargs``).
    """

    def __init__(self, prompts: Sequence[str | Sequence[int] | torch.Tensor], every_n_steps: int = 500,
                 max_new_tokens: int = 64, mode: str = "tree", depth: int = DEFAULT_DEPTH,
                 top_k: int = DEFAULT_TOP_K, total_tokens: int = DEFAULT_TOTAL_TOKENS, tokenizer: Any = None,
                 chat_template_kwargs: Mapping[str, Any] | None = None):
        if not prompts:
            raise ValueError("TauEvalCallback needs at least one prompt")
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.prompts = list(prompts)
        self.every_n_steps, self.max_new_tokens = every_n_steps, max_new_tokens
        self.tree = tree_spec(mode, depth, top_k, total_tokens)
        self.tokenizer = tokenizer
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.last: dict[str, Any] | None = None  # summary of the latest evaluation
        self._last_step = -1

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.tokenizer is None:
            self.tokenizer = getattr(trainer.datamodule, "tokenizer", None)

    def _input_ids(self, pl_module: L.LightningModule) -> list[torch.Tensor]:
        tokenizer = self.tokenizer or getattr(pl_module, "tokenizer", None)
        chat_format = None if tokenizer is None else prompt_chat_format(getattr(pl_module, "adapter", None), tokenizer)
        chat = tokenizer is not None and bool(getattr(tokenizer, "chat_template", None) or chat_format)
        ids = []
        for prompt in self.prompts:
            if not isinstance(prompt, str):
                ids.append(torch.as_tensor(prompt, dtype=torch.long).reshape(-1))
            elif tokenizer is None:
                raise ValueError("TauEvalCallback got text prompts but neither it nor the module has a tokenizer")
            elif chat:
                ids.append(chat_input_ids(tokenizer, [Message("user", prompt)], chat_format,
                                          self.chat_template_kwargs))
            else:
                ids.append(completion_input_ids(tokenizer, prompt))
        return ids

    @torch.no_grad()
    def measure(self, pl_module: L.LightningModule) -> dict[str, Any]:
        """Decode the prompts with the module's drafter and target; the `BenchStats` summary. Under
        torch.distributed every rank must call it at the same point."""
        drafter, target = pl_module.drafter, getattr(pl_module, "target", None)
        if target is None:
            raise ValueError("TauEvalCallback needs the target model on the module (.target); offline-feature "
                             "training without a target cannot decode")
        adapter = getattr(pl_module, "adapter", None)
        if isinstance(pl_module, torch.nn.Module):
            reshard(pl_module)
        if is_sharded(drafter):
            drafter = unsharded_drafter(drafter)
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        lockstep = world > 1 and is_sharded(target)  # every target forward is a collective: all decode all prompts
        prompts = self._input_ids(pl_module)
        was_training = drafter.training
        drafter.eval()
        try:
            generator = SpeculativeGenerator(target, drafter, self.tree, adapter)
            with Lockstep(generator.runner.adapter.base_model(target)) if lockstep else nullcontext():
                outputs = {i: generator.generate(ids, self.max_new_tokens)
                           for i, ids in enumerate(prompts) if lockstep or i % world == rank}
        finally:
            drafter.train(was_training)
        if world > 1 and not lockstep:
            shares: list[Any] = [None] * world
            dist.all_gather_object(shares, outputs)
            outputs = {i: out for share in shares for i, out in share.items()}
        stats = BenchStats()
        for i in sorted(outputs):  # prompt order, as one process adds them
            stats.add(outputs[i], request_id=str(i))
        return stats.summary()

    def _run(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._last_step = trainer.global_step
        summary = self.measure(pl_module)
        if summary["tau"] is None:
            return
        self.last = summary
        acc = summary["acceptance_per_depth"]
        pl_module.log("val/tau", float(summary["tau"]), on_step=True, on_epoch=False, batch_size=1)
        if acc and acc[0] is not None:
            pl_module.log("val/accept_1", float(acc[0]), on_step=True, on_epoch=False, batch_size=1)

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        # with gradient accumulation several micro-batches end on the same optimizer step: evaluate once
        if step > 0 and step % self.every_n_steps == 0 and step != self._last_step:
            self._run(trainer, pl_module)


class Lockstep:
    """While active, every rank checks before each forward of `model` (the sharded target's base model) that all
    ranks run the same forward: an all-reduce of a fingerprint of its inputs (token ids, positions, cached length),
    and one more when decoding ends. Ranks whose decoding diverged (nondeterministic kernels) all raise at the first
    forward that differs, where they would otherwise pair mismatched collectives and hang."""

    def __init__(self, model: torch.nn.Module):
        self.model, self.forwards, self._handle = model, 0, None

    def __enter__(self) -> Lockstep:
        self._handle = self.model.register_forward_pre_hook(self._check, with_kwargs=True)
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        self._handle.remove()
        if exc_type is None:  # a rank still decoding is caught here too
            self._agree(torch.zeros(4, dtype=torch.long, device=self._device), "the end of decoding")

    @property
    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _check(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None).reshape(-1).long()
        pos = kwargs.get("position_ids")
        cache = kwargs.get("cache", kwargs.get("past_key_values"))  # the name depends on the transformers version
        past = cache.get_seq_length() if cache is not None else 0
        weights = torch.arange(1, ids.numel() + 1, device=ids.device)
        self.forwards += 1
        self._agree(torch.stack([ids.new_tensor(ids.numel()), ids.sum(), (ids * weights).sum(),
                                 ids.new_tensor(past) + (0 if pos is None else pos.long().sum())]),
                    f"target forward {self.forwards}")

    def _agree(self, fingerprint: torch.Tensor, where: str) -> None:
        both = torch.cat([fingerprint, -fingerprint]).to(self._device)
        dist.all_reduce(both, op=dist.ReduceOp.MAX)  # max and -min of every entry
        if not torch.equal(both[:4], -both[4:]):
            raise RuntimeError(f"TauEvalCallback: the ranks decoded differently under FSDP at {where} (inputs "
                               f"[tokens, sum, weighted sum, positions] range from {(-both[4:]).tolist()} to "
                               f"{both[:4].tolist()}); lockstep decoding needs deterministic target and drafter "
                               "forwards on every rank")
