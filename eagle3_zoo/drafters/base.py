"""What a kind of drafter declares, and the registry its objects are kept in (torch-free at import).

A drafter kind (EAGLE-3, or another speculator architecture) is one `DrafterKind` object, registered by name with
`register_kind`; `eagle3_zoo.drafters.get_kind` finds it (the built-in kinds are imported on first use). Everything
above this layer that must know the kind asks it: the recipe validates `drafter.kind` against `kind_names` (no torch
imported), the run's DataModule derives the drafter's config with `config_from`, the LightningModule builds the
drafter (`build`), its trained unit (`objective`) and its loss (`training_loss`), and speculative decoding wraps a
trained drafter in the kind's `DraftModel` (`draft_model`). How to add one: docs/contributing/adding-a-drafter-kind.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch
    from torch import nn

    from eagle3_zoo.modeling import DraftStepOutput

GUIDE = "docs/contributing/adding-a-drafter-kind.md"

_KINDS: dict[str, DrafterKind] = {}


@dataclass(frozen=True)
class FeatureNeeds:
    """What a kind reads from the frozen target, so the data stage produces exactly that.

    Attributes:
        aux_layer_ids: Hugging Face `output_hidden_states` indices of the target's hidden states the drafter reads
            (`aux_hidden`, concatenated in this order).
        final_hidden: whether the target's post-norm last hidden state is read (`final_hidden`: the target's
            logits are formed from it with its frozen lm_head).
    """

    aux_layer_ids: tuple[int, ...]
    final_hidden: bool = True


class StepLine(NamedTuple):
    """One buffer of a training step, as `plan` prints it (`DrafterKind.step_lines`)."""

    what: str
    bytes: float
    note: str


@dataclass(frozen=True)
class StepSizing:
    """What `plan` decided of a run's training step, for `DrafterKind.step_lines` (the recipe's `drafter` section and
    the drafter's config say the rest). The dtypes are torch dtypes; a sizing reads only their `itemsize` and `str`.

    Attributes:
        compute_dtype: the matmuls' dtype (autocast's under `*-mixed`, the weights' under `*-true`).
        drafter_dtype: the dtype the drafter's parameters are stored in.
        target_dtype: the target's weights' dtype.
        feature_dtype: the dtype the step receives the target's features in (the target's when the step runs it;
            else the feature store's or the engine stream's).
        target_in_step: the target runs in the training step (online, in process).
        on_gpu: the trainer runs on GPUs.
        autocast_copies: autocast keeps a compute-dtype copy of each fp32 matmul weight for backward (`*-mixed`
            outside FSDP's bf16 policy).
        logits_chunk: rows per chunk of a product with the frozen lm_head.
        batch_size: sequences per step on one rank (`trainer.batch_size`).
        max_length: tokens per sequence (`data.max_length`).
        mixed: the precision is a `*-mixed` one (`trainer.precision`).
        activation_checkpointing: `trainer.activation_checkpointing`.
        ttt_steps: the unrolled steps (`ttt.steps`; a kind that does not unroll ignores it).
    """

    compute_dtype: Any
    drafter_dtype: Any
    target_dtype: Any
    feature_dtype: Any
    target_in_step: bool
    on_gpu: bool
    autocast_copies: bool
    logits_chunk: int
    batch_size: int
    max_length: int
    mixed: bool
    activation_checkpointing: bool
    ttt_steps: int


def starts_from_target_layers(section: Any, kind: str) -> bool:
    """Whether the recipe's `drafter` section starts a fresh drafter of `kind` from the target's decoder layers: the
    kind's own subsection (`drafter.<kind>`) says `init_layers: target` (torch-free: `plan` asks it too)."""
    return getattr(getattr(section, kind, None), "init_layers", "random") == "target"


@dataclass(frozen=True)
class TargetLayers:
    """The target's decoder layers and final norm, for a drafter whose own layers start from them
    (`DrafterKind.starts_from_target_layers`).

    Attributes:
        layers: each decoder layer's parameters, first to last, by their names inside the layer (`self_attn.q_proj
            .weight`, ...): the target's own tensors, not copies.
        norm: the target's final norm weight (None: a norm without one).
    """

    layers: tuple[dict[str, torch.Tensor], ...]
    norm: torch.Tensor | None = None


@runtime_checkable
class DraftModel(Protocol):
    """What `eagle3_zoo.speculative.SpeculativeGenerator` needs from a drafter (batch size 1).

    The generator calls `reset` once per request, `extend` once per cycle with the newly accepted tokens, then
    `expand` once per tree depth with the frontier nodes.
    """

    def reset(self) -> None:
        """Forget all context (start of a request)."""

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Map draft-vocabulary ids to target-vocabulary ids."""

    def extend(self, aux_hidden: torch.Tensor, input_ids: torch.Tensor, next_ids: torch.Tensor) -> DraftStepOutput:
        """Drop any tree entries and append `m` context rows.

        Args:
            aux_hidden: `[1, m, F]` target features of the new context positions.
            input_ids: `[m]` the tokens at those positions (x_t).
            next_ids: `[m]` the tokens that follow them (x_{t+1}); the last one is the newest emitted token.

        Returns:
            Logits `[1, 1, Vd]` (draft vocabulary) and hidden `[1, 1, H]` of the LAST new row: the proposal for the
            first draft token and the state its tree nodes start from.
        """

    def expand(
        self, token_ids: torch.Tensor, hidden: torch.Tensor, depths: torch.Tensor, visible: torch.Tensor
    ) -> DraftStepOutput:
        """Run `q` tree nodes in one pass; their entries are appended after the tree nodes run so far.

        Args:
            token_ids: `[q]` target ids of the nodes.
            hidden: `[1, q, H]` the hidden state each node continues from (its parent's output).
            depths: `[q]` depth of each node below the last context row (1 = first draft token).
            visible: `[q, n + q]` bool over the tree entries (n already cached, then these q): True where node i
                may attend (its ancestors and itself). Every context row is always visible.

        Returns:
            Logits `[1, q, Vd]` and hidden `[1, q, H]` of the nodes.
        """


@runtime_checkable
class BlockProposer(Protocol):
    """What the block speculative decoder (`eagle3_zoo.speculative.dflash_decode.DFlashGenerator`) needs from a block
    drafter (batch size 1): the context it has seen is the features of positions 0..P-1; `propose` drafts the tokens
    at P+1 .. P+num_draft after the anchor at position P."""

    num_draft: int  # draft tokens per block (B-1 for a DFlash drafter)

    def reset(self) -> None:
        """Forget all context (start of a request)."""

    def extend(self, aux_hidden: torch.Tensor) -> None:
        """Append the target features `[1, m, F]` of the next `m` verified positions."""

    def propose(self, anchor_id: int) -> list[int]:
        """`num_draft` target token ids following `anchor_id`, which sits right after the context."""


class TrainingContext(Protocol):
    """What a kind's `training_loss` may ask of the LightningModule that trains it
    (`eagle3_zoo.training.module.DrafterModule`), besides its `kind`, `drafter` and `objective`."""

    step_weights: list[float]  # per-step weights of an unrolled objective (the recipe's `ttt` section)
    logits_chunk_size: int  # rows per chunk of a product with the frozen lm_head

    @property
    def frozen_heads(self) -> tuple[nn.Module, nn.Module]:
        """The frozen target's (input embedding, lm_head)."""

    def target_features(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(`aux_hidden` `[B, T, len(aux_layer_ids) * H]`, `final_hidden` `[B, T, H]` or None) of the batch, as the
        kind's `features` asked: from the batch offline, from the target run in the step online."""

    def data_parallel_ranks(self) -> int:
        """The ranks a training step's gradients are averaged over (1 outside a data-parallel trainer)."""

    def sum_over_ranks(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` summed over the data-parallel ranks, in place (queued on the device: no wait)."""

    def read_counts(self, counts: torch.Tensor, read_along: bool) -> list[int]:
        """`counts` (a 1-D device tensor) on the host: the training step's one wait for the device (with
        `read_along` it brings what the previous step left to read)."""


class DrafterKind:
    """One kind of drafter: subclass it, set the class attributes, implement the methods, `register_kind` an instance.

    Class attributes:
        name: the recipe's `drafter.kind` value.
        config_class: the drafter's config (what its folder's config.json holds).
        drafter_class: the trained `nn.Module` (`owns` recognises the kind's drafters by it).
        layouts: the names of the drafter-folder layouts the kind is written in (`eagle3_zoo.values.layout_names`;
            empty: none yet).
        card_tags: the Hub tags of its model card.
        decoding: how speculative decoding drives a trained drafter: "tree" (a `DraftModel` expanded into a draft
            tree, `draft_model`) or "block" (a `BlockProposer` drafting a chain of tokens in one pass,
            `block_proposer`); `eagle3-zoo eval` picks its decoder by it.
        unrolls: `training_loss` unrolls `steps` steps (the recipe's `ttt` section): the run schedules them
            (`TTTScheduleCallback`, logged and shown as `train/ttt_steps`). False: nothing is unrolled, the run has
            no schedule and logs no `ttt_steps`.
    """

    name: ClassVar[str]
    config_class: ClassVar[type]
    drafter_class: ClassVar[type]
    layouts: ClassVar[tuple[str, ...]] = ()
    card_tags: ClassVar[tuple[str, ...]] = ()
    decoding: ClassVar[str] = "tree"
    unrolls: ClassVar[bool] = True

    # ------------------------------------------------------------------ the data stage and the drafter
    def config_from(self, section: Any, target_config: Any, *, aux_layer_ids: tuple[int, ...] | None,
                    defaults: dict[str, Any], target_name: str, torch_dtype: str) -> Any:
        """A fresh drafter's config: from the recipe's `drafter` section, the target's config, the aux layers the
        run reads (None: the kind's default), the target family's published-drafter shape (`defaults`,
        `TargetAdapter.drafter_defaults`), the target's name and the dtype the drafter is saved in."""
        raise NotImplementedError

    def features(self, config: Any) -> FeatureNeeds:
        """What the drafter of `config` reads from the target."""
        raise NotImplementedError

    def training_features(self, config: Any, section: Any = None) -> FeatureNeeds:
        """What training the drafter of `config` reads from the target, given the recipe's `drafter` section (None:
        the defaults): the training step (`TrainingContext.target_features`) and `plan` ask this. Default: `features`
        (a kind whose objective needs more than decoding does, e.g. the target's last hidden state for soft labels,
        overrides it)."""
        return self.features(config)

    def build(self, config: Any, *, d2t: torch.Tensor, t2d: torch.Tensor,
              target_head: tuple[torch.Tensor, torch.Tensor | None] | None = None,
              target_layers: TargetLayers | None = None) -> nn.Module:
        """A fresh drafter (its random initialisation draws from the global generator) with its draft vocabulary
        (`d2t`, `t2d`: `eagle3_zoo.modeling.build_draft_vocab`), started from the target's (lm_head, final norm)
        weights when `target_head` is given and from the target's decoder layers when `target_layers` is given
        (only where `starts_from_target_layers` said so)."""
        raise NotImplementedError

    def starts_from_target_layers(self, section: Any) -> bool:
        """Whether a fresh drafter of the recipe's `drafter` section starts its layers from the target's decoder
        layers (`build` then gets `target_layers`, and the run loads the whole target): `starts_from_target_layers`
        (the kind's own subsection says `init_layers: target`)."""
        return starts_from_target_layers(section, self.name)

    def step_lines(self, section: Any, config: Any, target_config: Any, sizing: StepSizing) -> list[StepLine]:
        """The buffers one training step of a drafter of `config` holds besides its weights, gradients and optimizer
        state (`plan`'s training step: what the step reads of the target, what the loss keeps for backward, autocast's
        weight copies), estimated from the recipe, the shapes and `sizing`, with nothing allocated. `plan` asks it
        through `eagle3_zoo.drafters.step_lines` (a built-in kind answers from a torch-free module of its own)."""
        raise NotImplementedError(f"the {self.name!r} drafter kind does not size its training step "
                                  f"(DrafterKind.step_lines; see {GUIDE})")

    def num_parameters(self, config: Any) -> int:
        """The parameter count of a drafter of `config` (default: `drafter_class(config)` built on the meta device,
        nothing allocated)."""
        import torch

        with torch.device("meta"):
            return sum(p.numel() for p in self.drafter_class(config).parameters())

    def owns(self, drafter: Any) -> bool:
        """Whether `drafter` is one of this kind's."""
        return isinstance(drafter, self.drafter_class)

    # ------------------------------------------------------------------ training
    def objective(self, drafter: nn.Module, loss: Any, section: Any = None) -> nn.Module:
        """The trained unit: an `nn.Module` holding `drafter` (as `.drafter`) whose `forward` computes the loss,
        so FSDP2 gathers the drafter's parameters around it. `loss` is the recipe's per-position `Loss`; `section`
        the recipe's `drafter` section (the kind's training settings; None outside a recipe: the defaults)."""
        raise NotImplementedError

    def training_loss(self, module: TrainingContext, batch: dict[str, torch.Tensor], steps: int, *,
                      global_norm: bool = False, read_along: bool = False, with_alpha: bool = True) -> Any:
        """The loss of one batch (`steps`: unrolled steps, for a kind that unrolls). Returns an object with a
        scalar `loss` the module backpropagates; `train_metrics` and `validation_metrics` read the rest."""
        raise NotImplementedError

    def train_metrics(self, out: Any, with_alpha: bool) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(what a training step logs besides `train/loss`, what the live progress bar shows besides it)."""
        raise NotImplementedError

    def validation_metrics(self, steps: int) -> Any:
        """A `torchmetrics.Metric` over validation batches: `update(out)` with a `training_loss` output and
        `compute("val")` -> the logged dict; the module logs `val/loss` from `validation_loss` of it."""
        raise NotImplementedError

    def validation_loss(self, metrics: dict[str, torch.Tensor], step_weights: list[float]) -> torch.Tensor | None:
        """The headline `val/loss` from `validation_metrics(...).compute("val")` (None: nothing was measured)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ the trained drafter, written
    def to_write(self, trained: nn.Module, state: dict[str, torch.Tensor]) -> nn.Module:
        """The drafter to write (plain, fp32, on the CPU) from `trained` (the module trained, maybe sharded) and the
        full state dict of its weights (gathered on this rank)."""
        raise NotImplementedError

    def from_checkpoint(self, config: Any, state: dict[str, torch.Tensor], recorded: dict[str, Any]) -> nn.Module:
        """The drafter to write from a checkpoint of `fit` (`eagle3-zoo consolidate`): its config, the full state dict
        of its weights, and what the run recorded of it beside them (`eagle3_zoo.training.rundir.outputs.drafter_info`).
        Default: `to_write` of a fresh drafter of `config`."""
        return self.to_write(self.drafter_class(config), state)

    def save(self, drafter: nn.Module, folder: Any) -> None:
        """Write `drafter`'s weights and config.json into `folder` (in the first of `layouts` when it has some)."""
        raise NotImplementedError

    def load(self, folder: Any) -> nn.Module:
        """The drafter `save` wrote into `folder`."""
        raise NotImplementedError

    def check_folder(self, folder: Any) -> list[str]:
        """The errors of the folder `save` wrote (empty: none). Only asked of a kind with no `layouts`: a folder in a
        registered layout is checked by that layout's checks (`eagle3-zoo check`)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ decoding
    def draft_model(self, drafter: nn.Module, embed_tokens: nn.Module) -> DraftModel:
        """The drafter as the tree speculative decoder drives it, with the target's frozen input embedding. A kind
        whose drafter is decoded otherwise (`decoding` "block": `block_proposer`) raises TypeError naming its
        decoder; `trainer.tau_eval` is refused for such a kind when the recipe is read."""
        raise NotImplementedError

    def block_proposer(self, drafter: nn.Module, embed_weight: torch.Tensor,
                       lm_head_weight: torch.Tensor) -> BlockProposer:
        """The drafter as the block speculative decoder drives it (a kind whose `decoding` is "block"), with the
        target's frozen input embedding and lm_head weights."""
        raise NotImplementedError

    def target_mismatches(self, drafter: nn.Module, target_config: Any) -> list[str]:
        """Why `drafter` cannot draft for a target of `target_config` (empty: it can)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ a run started from a drafter (`init_from`)
    def init_mismatches(self, drafter: nn.Module, section: Any, aux_layer_ids: tuple[int, ...]) -> list[str]:
        """Why a run whose recipe's `drafter` section is `section` and whose data stage reads `aux_layer_ids` cannot
        continue training `drafter` (`drafter.init_from`): the features it reads, and the recipe settings that change
        its forward pass but that the drafter's own config fixes (empty: it can). Default: the aux layers."""
        ids = drafter.config.aux_layer_ids
        if ids is not None and tuple(ids) != tuple(aux_layer_ids):
            return [f"aux_layer_ids {list(ids)} != the run's {list(aux_layer_ids)} (set drafter.aux_layer_ids to the "
                    "drafter's)"]
        return []

    def draft_vocab(self, drafter: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """`drafter`'s draft vocabulary as `build` takes it: (`d2t` int64 offsets `[draft_vocab_size]`, `t2d` bool
        `[vocab_size]`). Default: its `d2t` and `t2d` buffers."""
        return drafter.d2t, drafter.t2d

    def fc_input_scale(self, drafter: nn.Module) -> torch.Tensor | None:
        """The training-time scale `drafter`'s feature projection is preconditioned with (`optim.precondition_fc`),
        kept when a run continues it (None: none; the default)."""
        return None


def register_kind(kind: DrafterKind, *, replace: bool = False) -> DrafterKind:
    """Register `kind` under `kind.name`; a second kind of the same name is refused unless `replace`."""
    if not isinstance(kind, DrafterKind):
        raise TypeError(f"register_kind takes a DrafterKind instance, not {type(kind).__name__} (see {GUIDE})")
    name = getattr(type(kind), "name", None)
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"a drafter kind's name must be an identifier (the recipe's drafter.kind), not {name!r}")
    if name in _KINDS and _KINDS[name] is not kind and not replace:
        raise ValueError(f"a drafter kind named {name!r} is registered already ({type(_KINDS[name]).__name__})")
    _KINDS[name] = kind
    return kind


def unregister_kind(name: str) -> None:
    """Remove the kind registered as `name` (a kind registered by a test, at its end)."""
    _KINDS.pop(name, None)


def registered() -> dict[str, DrafterKind]:
    """The kinds registered so far (a copy), by name."""
    return dict(_KINDS)
