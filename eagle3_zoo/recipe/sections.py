"""Typed training recipes: the `Recipe` schema (an OmegaConf structured config; types and choices come from the
annotations, each value rule sits on its field: `eagle3_zoo.util.schema.ruled`), loading with dotlist overrides, and
validation that raises every problem (unknown key, wrong type, bad value, missing file) at once in one `RecipeError`.

    recipe = load_recipe("recipes/qwen25_7b.yaml", ["trainer.max_steps=2000"])

A recipe is data in every artefact (recipe.yaml, provenance.json, hyperparameters, checkpoints, model cards:
`recipe_to_dict`): a value that comes from an `${oc.env:VAR}` interpolation is written as that text, never as the
variable's value, and the secrets the recipe gives the run (`eagle3_zoo.util.redaction`) are redacted. Only the typed
`Recipe` the process runs with holds the resolved values.
"""

from __future__ import annotations

import dataclasses
import hashlib
import operator
import os
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from eagle3_zoo.drafters import kind_names, unknown_kind_message
from eagle3_zoo.losses import Loss, available_losses, make_loss, params_problems, unknown_loss_message
from eagle3_zoo.recipe.engine import EngineConfig, device_list, urls_problems
from eagle3_zoo.util import schema
from eagle3_zoo.util.redaction import redact_data, register_recipe, register_variable
from eagle3_zoo.util.schema import GE0, GT0, UNIT, ConfigProblem, rule, ruled
from eagle3_zoo.values import locations
from eagle3_zoo.values.dtypes import DTYPE_NAMES
from eagle3_zoo.values.locations import EMBEDDED_SHAREGPT, EMBEDDED_TARGET, hub_or_local_problem, path_problem


class RecipeError(schema.ConfigError):
    """All problems of a recipe, reported at once."""
    what = "recipe"


def _family_problem(family: str) -> str | None:
    from eagle3_zoo.adapters import available_adapters  # the registry: a new family needs no edit here

    families = sorted(available_adapters())
    return None if family == "auto" or family in families else \
        f"unknown adapter family; available: auto, {', '.join(families)}" + schema.did_you_mean(family, families) + \
        "; to add one see docs/contributing/adding-a-family.md"


def _aux_problem(ids: list[int]) -> str | None:
    return next((msg for broken, msg in [
        (len(ids) not in (1, 3), f"expected 1 or 3 layer ids (low, mid, high), got {len(ids)}"),
        (any(i < 0 for i in ids), "layer ids must be >= 0 (HF output_hidden_states indices)"),
        (any(b <= a for a, b in zip(ids, ids[1:])), "layer ids must be strictly increasing (low, mid, high)")]
        if broken), None)


def _devices_ok(devices: int | str) -> bool:
    if isinstance(devices, int):
        return devices >= 1 or devices == -1
    parts = [p.strip() for p in devices.split(",") if p.strip()]
    return devices == "auto" or (bool(parts) and all(p.isdigit() for p in parts))


# ------------------------------------------------------------------------------------------------ schema
@dataclass
class TargetConfig:
    """The frozen target model the drafter learns to predict."""
    name_or_path: str = ruled(EMBEDDED_TARGET, locations.target_problem)  # Hub id, local folder or embedded
    family: str = ruled("auto", _family_problem)  # adapter (HF model_type); "auto" = read from the target config
    dtype: Literal[DTYPE_NAMES] = "bfloat16"  # dtype the frozen target runs in
    lora_path: str | None = ruled(None, hub_or_local_problem)  # PEFT LoRA adapter merged into the target first
    trust_remote_code: bool = False  # passed to transformers; off: it executes code from the Hub


def _target_layers_problem(ids: list[int]) -> str | None:
    return next((msg for broken, msg in [
        (not ids, "expected at least one decoder-layer id"),
        (any(i < 0 for i in ids), "layer ids must be >= 0 (0-based target decoder layers whose output is read)"),
        (any(b <= a for a, b in zip(ids, ids[1:])), "layer ids must be strictly increasing")] if broken), None)


@dataclass
class BlockDrafterSection:
    """What every block drafter on the DFlash backbone shares (`drafter.dflash`, `drafter.dspark`): the backbone's
    shape, the target features it reads, its mask token and how its blocks are drawn. Defaults are the DFlash paper's
    (block 16, 5 draft layers, 5 target features spread from layer 1 to N-3)."""
    num_layers: int = ruled(5, GT0)  # draft decoder layers (Qwen3-style, at the target's width)
    block_size: int = ruled(16, rule(lambda v: v >= 2, "must be >= 2 (the anchor and at least one drafted token)"))
    num_anchors: int = ruled(512, GT0)  # blocks drawn per sequence each step (fewer where fewer positions qualify)
    decay_gamma: float = ruled(4.0, GT0)  # the decay position weighting's gamma
    num_target_features: int = ruled(5, GT0)  # target layers read, evenly spread from layer 1 to N-3
    # 0-based target decoder layers whose OUTPUT is read (z-lab's and vLLM's dflash_config.target_layer_ids; the hidden
    # states HF numbers id + 1); null = num_target_features spread from layer 1 to N-3
    target_layer_ids: list[int] | None = ruled(None, _target_layers_problem)
    # the id embedded at the masked slots of a block; null = the target config's mask_token_id if it has one, else
    # the last id of its vocabulary (recorded in the drafter's config.json either way)
    mask_token_id: int | None = ruled(None, GE0)
    # random = the model's initialisation; target = the draft layers start as copies of the target's last num_layers
    # decoder layers (parameters whose names and shapes match; the rest, e.g. q/k norms a Llama target lacks, keep
    # their initialisation) and the final norm as the target's
    init_layers: Literal["random", "target"] = "random"


@dataclass
class DFlashSection(BlockDrafterSection):
    """The DFlash block drafter (`drafter.kind: dflash`; read only then): the shared backbone keys and its position
    weights."""
    weighting: Literal["dpace", "decay"] = "dpace"  # D-PACE (expected accepted length) or exp(-(k-1)/gamma)
    dpace_alpha: float = ruled(0.5, rule(lambda v: 0 < v <= 1, "must be in (0, 1]"))  # D-PACE smoothing
    # hard = cross-entropy to the next tokens x_{a+k}; soft = cross-entropy to the target's own distribution at
    # each predicted position (its lm_head on its last hidden state; renormalised over a reduced draft vocabulary):
    # the data stage then provides the target's last hidden state too
    labels: Literal["hard", "soft"] = "hard"


@dataclass
class DSparkSection(BlockDrafterSection):
    """The DSpark block drafter (`drafter.kind: dspark`; read only then): the DFlash backbone keys, the Markov and
    confidence heads, and the loss weights (the paper's 0.1 CE + 0.9 TV + 1.0 BCE, position decay exp(-k/gamma))."""
    markov_rank: int = ruled(256, GT0)  # r of the low-rank Markov head (markov_w1 [V, r], markov_w2 [V_draft, r])
    enable_confidence_head: bool = True  # the head that predicts each slot's acceptance (trained by the BCE term)
    ce_weight: float = ruled(0.1, GE0)  # cross-entropy to the target's greedy token
    tv_weight: float = ruled(0.9, GE0)  # total variation to the target's distribution
    bce_weight: float = ruled(1.0, GE0)  # the confidence head's BCE to the slot's acceptance (1 - TV)


@dataclass
class DrafterConfig:
    """The drafter: its kind, and the shape of an EAGLE-3 drafter (one Llama decoder layer); null fields follow the
    target."""
    # a registered drafter kind (eagle3_zoo/drafters/; docs/contributing/adding-a-drafter-kind.md): eagle3 = EAGLE-3
    # with its EAGLE-3.1 options below
    kind: str = ruled("eagle3", lambda v: None if v in kind_names() else unknown_kind_message(v))
    hidden_size: int | None = ruled(None, GT0)  # must equal the target's: its frozen embedding feeds the drafter
    intermediate_size: int | None = ruled(None, GT0)  # MLP width of the single decoder layer
    num_attention_heads: int | None = ruled(None, GT0)
    num_key_value_heads: int | None = ruled(None, GT0)
    head_dim: int | None = ruled(None, GT0)
    draft_vocab_size: int = ruled(32000, GT0)  # most frequent supervised target tokens (EAGLE-3 uses 32000)
    aux_layer_ids: list[int] | None = ruled(None, _aux_problem)  # HF output_hidden_states ids (low, mid, high) or one
    init_from: str | None = ruled(None, hub_or_local_problem)  # an existing drafter (local dir or Hub id) to start from
    # random = normal(0, 0.02) (official EAGLE-3); target = the target's lm_head rows and final norm (vLLM speculators)
    init_head: Literal["random", "target"] = "random"  # the same accuracy on SmolLM2 after 200 steps (recipes/README)
    # EAGLE-3.1 (arXiv 2605.09992): an RMSNorm on each aux hidden state before fc, and the post-norm output fed back
    # to the next step; written as config.json's fc_norm / norm_output (vLLM serves them; see `eagle3-zoo check`)
    fc_norm: bool = False
    norm_output: bool = False
    dflash: DFlashSection = field(default_factory=DFlashSection)  # drafter.kind = dflash only
    dspark: DSparkSection = field(default_factory=DSparkSection)  # drafter.kind = dspark only


@dataclass
class DataSourceConfig:
    """One conversation source."""
    path: str = ruled(MISSING, locations.source_problem)  # JSON/JSONL file or folder, Hub dataset id, or embedded
    format: Literal["auto", "sharegpt", "messages", "jsonl"] = "auto"  # auto: JSON list/JSONL, ShareGPT/OpenAI
    max_samples: int | None = ruled(None, rule(lambda v: v > 0, "must be > 0 (or null = all)"))
    split: Literal["train", "val"] | None = None  # null = split by data.val_fraction; else feed one split only


@dataclass
class RegenerateConfig:
    """Regeneration of assistant turns by the target before training (as EAGLE-3 does: raises acceptance)."""
    enabled: bool = False
    max_new_tokens: int = ruled(1024, GT0)
    temperature: float = ruled(0.0, GE0)  # 0 = greedy, matching T=0 evaluation
    batch_size: int = ruled(8, GT0)
    max_turns: int | None = ruled(None, GT0)  # answer at most this many assistant turns per conversation; null = all
    output: str | None = ruled(None, lambda v: path_problem(v, False, "a JSONL file path for the regenerated "
                                                         "conversations (or null = in data.cache_dir)"))
    # hf = `generate` in this process; openai = any OpenAI-compatible server at base_url (vLLM, SGLang, ...);
    # vllm = a vLLM server started for the target (scripts/setup_engine.sh); engine = the recipe's engine deployment
    # (`engine:`; attach: the servers at engine.urls, launch: its servers started here, with its parallelism, for the
    # regeneration only; the conversations split among the servers). Same output file and cache key.
    backend: Literal["hf", "openai", "vllm", "engine"] = "hf"
    # base_url and api_key_env are checked by `_secret_problems` (their messages never echo the value)
    base_url: str | None = None  # backend openai: the server root, e.g. http://10.0.0.5:8000 (no user:password@)
    api_key_env: str | None = None  # backend openai: the environment variable holding the API key (null = none)
    # backend openai/vllm: conversations in flight at once (the server batches them); engine: per server
    concurrency: int = ruled(4, GT0)
    # backend openai/vllm/engine: seconds one request may take in all (connect, send, the whole answer)
    timeout: float = ruled(600.0, rule(lambda v: 0 < v < float("inf"), "must be a number of seconds > 0"))
    # backend openai/vllm/engine: retries of a failed request (429, 5xx, timeouts), backoff 1 s
    retries: int = ruled(4, GE0)


@dataclass
class DataConfig:
    """Conversations -> tokens, loss masks and (offline) features."""
    sources: list[DataSourceConfig] = ruled(check=rule(bool, "at least one data source is required"),
                                         factory=lambda: [DataSourceConfig(path=EMBEDDED_SHAREGPT)])
    max_length: int = ruled(2048, rule(lambda v: v >= 2, "must be >= 2 tokens"))  # EAGLE-3 trains on 2048 tokens
    overflow: Literal["truncate", "drop"] = "truncate"  # a conversation longer than max_length tokens
    # several conversations per row, up to max_length tokens (attention, positions and targets kept per
    # conversation: the same loss as unpacked, with less padding); false = one conversation per row
    packing: bool = False
    max_samples: int | None = ruled(None, GT0)  # cap on conversations over all sources
    on_error: Literal["raise", "skip"] = "raise"  # bad records: stop naming file and record, or skip and count
    regenerate: RegenerateConfig = field(default_factory=RegenerateConfig)
    # extra chat-template variables for regeneration and tokenisation, e.g. {enable_thinking: false} (Qwen3) or
    # {reasoning_effort: low} (gpt-oss); {} = the template's defaults (Qwen3 and gpt-oss think)
    chat_template_kwargs: dict = field(default_factory=dict)
    # token counts, regenerated data and features, keyed by content fingerprints (shared across runs); default:
    # $EAGLE3_ZOO_CACHE or ~/.cache/eagle3_zoo, next to the converted embedded target, whatever directory a command
    # runs from (a relative path would be a new, empty cache in each one)
    cache_dir: str = ruled(check=lambda v: path_problem(v, True, "a directory (token counts, regenerated data and "
                                                        "features)"), factory=lambda: str(locations.cache_root()))
    # online = features computed as training goes (in the training step, or streamed from the engine); offline =
    # feature shards written once before training; hybrid = streamed from the engine on the first pass, which writes
    # the feature shards that later epochs read
    mode: Literal["online", "offline", "hybrid"] = "online"
    features_dir: str | None = ruled(None, lambda v: path_problem(v, True, "a directory of feature shards (or null = "
                                                                "in data.cache_dir)"))
    features_dtype: Literal[DTYPE_NAMES] = "bfloat16"
    features_shard_size: int = ruled(256, GT0)  # samples per feature shard (a crash loses at most one shard)
    # hf = the target in this process; vllm = the recipe's engine (`engine:`; vLLM's extract_hidden_states)
    features_backend: Literal["hf", "vllm"] = "hf"
    # streamed from the engine: batches requested ahead of the one being trained on, and the disk those requests'
    # files may take at most (the batch being trained on is always requested, whatever its size)
    prefetch_batches: int = ruled(4, GE0)
    prefetch_disk_gib: float = ruled(8.0, GT0)
    val_fraction: float = ruled(0.01, rule(lambda v: 0 <= v < 1, "must be in [0, 1)"))
    num_workers: int = ruled(2, GE0)
    seed: int = 0  # seed of the train/val split and shuffling


@dataclass
class TTTConfig:
    """Training-time test: the loss unrolled over K drafter steps, step k reading the drafter's own step k-1 output."""
    steps: int = ruled(7, rule(lambda v: v >= 1, "must be >= 1 (number of TTT unroll steps)"))  # official EAGLE-3 K
    step_weight_decay: float = ruled(0.8, GT0)  # step k weighs step_weight_decay ** k unless step_weights is given
    step_weights: list[float] | None = None  # explicit per-step weights (length ttt.steps)
    schedule: Literal["constant", "ramp"] = "constant"  # constant = all K steps at once; ramp = grow 1 -> K
    ramp_fraction: float = ruled(0.3, UNIT)  # fraction of training over which the ramp reaches K


def _loss_problem(name: str) -> str | None:  # the registry's names: a new loss needs no edit here
    return None if name in available_losses() else unknown_loss_message(name)


@dataclass
class LossConfig:
    """The per-position objective of each TTT step against the target's distribution p over the draft vocabulary
    (alpha = sum_v min(p_v, q_v), the expected acceptance of a drafted token); steps keep ttt's weights."""
    # a registered loss (eagle3_zoo/losses/, one module each; docs/concepts.md): soft_ce = EAGLE-3's soft
    # cross-entropy; tv = 1 - alpha; neg_log_alpha = -log alpha; lk_hybrid = lambda * KL(p || q) + (1 - lambda) *
    # (1 - alpha), lambda = exp(-eta * alpha) per position (the LK losses, arXiv 2602.23881)
    name: str = ruled("soft_ce", _loss_problem)
    # the loss's own parameters, checked against its Params dataclass (lk_hybrid: eta = 3.0); a loaded recipe holds
    # every one, defaults filled in
    params: dict[str, Any] = field(default_factory=dict)
    # loss.params.eta as recipes wrote it before loss.params (lk_hybrid only; other losses ignore it, as they did)
    lk_eta: float | None = ruled(None, GT0)

    def effective_params(self) -> dict[str, Any]:
        """`params`, with `lk_eta` as lk_hybrid's `eta` unless `params` has one."""
        if self.lk_eta is None or self.name != "lk_hybrid":
            return dict(self.params)
        return {"eta": self.lk_eta, **self.params}

    def build(self) -> Loss:
        """The `Loss` this section names, with its parameters (`eagle3_zoo.losses.make_loss`)."""
        return make_loss(self.name, self.effective_params())

    def resolved(self) -> LossConfig:
        """This section as a run records it: every parameter of the loss with its value, `lk_eta` moved into it."""
        return LossConfig(self.name, dataclasses.asdict(self.build().params))


def _loss_problems(loss: LossConfig) -> list[ConfigProblem]:
    """The loss's parameters against its Params dataclass; `lk_eta` against a different `params.eta`."""
    problems = params_problems(loss.name, loss.params)
    eta = loss.params.get("eta") if isinstance(loss.params, dict) else None
    if loss.name == "lk_hybrid" and loss.lk_eta is not None and eta is not None and eta != loss.lk_eta:
        problems.append(ConfigProblem("loss.lk_eta", f"is the older spelling of loss.params.eta, which says {eta}: "
                                      "give only loss.params.eta", loss.lk_eta))
    return problems


@dataclass
class OptimConfig:
    """AdamW and the learning-rate schedule."""
    lr: float = ruled(1e-4, GT0)  # SpecForge default; the official EAGLE-3 8B run uses 5e-5 (recipes set it)
    weight_decay: float = ruled(0.0, GE0)
    betas: list[float] = ruled(check=rule(lambda b: len(b) == 2 and all(0 <= x < 1 for x in b), "expected two AdamW "
                                        "betas in [0, 1), e.g. [0.9, 0.95]"), factory=lambda: [0.9, 0.95])  # EAGLE-3's
    warmup_steps: int = ruled(0, GE0)
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    min_lr_ratio: float = ruled(0.0, UNIT)  # final learning rate as a fraction of lr
    grad_clip: float | None = ruled(0.5, GT0)  # gradient norm clip (official EAGLE-3); null = off
    # train fc on features scaled to unit RMS per dimension (measured on the first training samples), folded into
    # fc.weight on export: same format, but a few "massive activation" dims no longer dominate (recipes/README.md)
    precondition_fc: bool = False


@dataclass
class TauEvalConfig:
    """Periodic acceptance-length measurement during training."""
    every_n_steps: int | None = ruled(None, GT0)  # measure tau with real speculative decoding every N steps; null = off
    num_prompts: int = ruled(8, GT0)
    max_new_tokens: int = ruled(64, GT0)


@dataclass
class TrainerConfig:
    """Lightning Trainer switches; parallelism stays coarse (one strategy builder reads them)."""
    max_steps: int | None = ruled(None, GT0)  # optimizer steps; null = run max_epochs
    max_epochs: int | None = ruled(1, GT0)
    # wall-clock seconds of training (Lightning's max_time: checked after every step, validation included, data
    # preparation and model loading not); the run stops at the first limit reached; null = no time limit
    max_time: float | None = ruled(None, GT0)
    precision: Literal["32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "64-true"] = "32-true"
    accelerator: Literal["auto", "cpu", "gpu"] = "auto"  # gpu: stop at once without CUDA GPUs; auto: else the CPU
    devices: int | str = ruled("auto", rule(_devices_ok, 'expected a count >= 1, -1 (all), "auto" or a comma list of '
                                          'indices like "0,1"'))
    num_nodes: int = ruled(1, GT0)
    strategy: Literal["auto", "ddp", "fsdp"] = "auto"
    accumulate_grad_batches: int = ruled(1, GT0)
    batch_size: int = ruled(1, GT0)  # per-device micro-batch (conversations)
    checkpoint_every_n_steps: int | None = ruled(1000, GT0)
    val_check_interval: int | None = ruled(None, GT0)  # validate every N training batches; null = once per epoch
    log_every_n_steps: int = ruled(10, GT0)
    # wandb: pip install 'eagle3-zoo[wandb]'; WANDB_MODE, WANDB_PROJECT... as wandb reads them
    logger: list[Literal["csv", "tensorboard", "wandb"]] = field(default_factory=lambda: ["csv", "tensorboard"])
    seed: int = 42  # seed of the drafter initialisation and data order
    activation_checkpointing: bool = False
    gpu_memory_gb: float | None = ruled(None, GT0)  # memory of one GPU the recipe is planned for; `plan` checks it
    tau_eval: TauEvalConfig = field(default_factory=TauEvalConfig)


@dataclass
class Recipe:
    """A complete training recipe."""
    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    ttt: TTTConfig = field(default_factory=TTTConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)  # the inference engine serving the target (vLLM)
    # checkpoints, logs, the resolved recipe and the exported drafter
    output_dir: str = ruled("runs/eagle3", lambda v: path_problem(v) if v.strip() else "must not be empty")
    demo: bool = False  # a smoke/demo run (e.g. the quickstart's): its model card says it is not a drafter to serve


# ------------------------------------------------------------------------------------------------ decisions
def features_from_engine(data: DataConfig) -> bool:
    """Whether the run's hidden states come from the engine (`data.features_backend: vllm`)."""
    return data.features_backend == "vllm"


def streams_features(data: DataConfig) -> bool:
    """Whether training reads hidden states streamed from the engine (online or hybrid with the vllm backend)."""
    return features_from_engine(data) and data.mode in ("online", "hybrid")


def target_in_training_step(data: DataConfig) -> bool:
    """Whether the frozen target runs inside the training step (online mode with the in-process backend)."""
    return data.mode == "online" and not features_from_engine(data)


def target_sharded_in_trainer(data: DataConfig, trainer: TrainerConfig) -> bool:
    """Whether FSDP shards the frozen target over the trainer's GPUs: when it runs in the training step, or (states
    streamed from the engine) to measure tau during training (speculative decoding needs the target there too)."""
    tau = bool(trainer.tau_eval.every_n_steps)
    return trainer.strategy == "fsdp" and (target_in_training_step(data) or (streams_features(data) and tau))


def regenerates_in_engine(data: DataConfig) -> bool:
    """Whether the run's regeneration is answered by the engine's servers (`data.regenerate.backend: engine`)."""
    return data.regenerate.enabled and data.regenerate.backend == "engine"


def regeneration_max_model_len(engine: EngineConfig, data: DataConfig) -> int:
    """`engine.max_model_len`, or what a regeneration request needs: a prompt of up to `data.max_length` tokens (a
    longer one ends its conversation) plus an answer of `data.regenerate.max_new_tokens`."""
    return engine.max_model_len or data.max_length + data.regenerate.max_new_tokens


def engine_max_model_len(engine: EngineConfig, data: DataConfig) -> int:
    """`engine.max_model_len`, or what a hidden-states request needs: the longest sample plus the token made."""
    return engine.max_model_len or data.max_length + 1


def _trainer_gpus(trainer: TrainerConfig) -> set[int]:
    if trainer.accelerator != "gpu":
        return set()
    if isinstance(trainer.devices, str):
        return {int(p) for p in trainer.devices.split(",") if p.strip().isdigit()}
    return set(range(trainer.devices)) if trainer.devices > 0 else set()


def engine_problems(recipe: Recipe) -> list[ConfigProblem]:
    """The engine rules that read several fields (attach needs URLs, hybrid needs the engine, device overlaps)."""
    e, d = recipe.engine, recipe.data
    uses, g = features_from_engine(d), d.regenerate
    regen = regenerates_in_engine(d)
    devices = device_list(e.devices) or []
    overlap = sorted(_trainer_gpus(recipe.trainer) & set(devices)) if e.mode == "launch" else []
    gpus, nodes = e.tensor_parallel_size * e.data_parallel_size, e.num_nodes
    rules = [
        ("engine.mode", e.mode == "attach" and not e.urls, "attach needs the servers' URLs in engine.urls, e.g. "
         "[http://10.0.0.5:8000] (or engine.mode: launch to start them here)", ()),
        ("data.regenerate.base_url", regen and g.base_url is not None, "is for backend openai; backend engine sends "
         "the requests to the recipe's engine (engine.urls in engine.mode: attach, else servers launched here): "
         "remove base_url, or set data.regenerate.backend: openai", ("data.regenerate.backend",)),
        ("engine.max_model_len", regen and e.max_model_len is not None
         and e.max_model_len < d.max_length + g.max_new_tokens, f"must be at least data.max_length + "
         f"data.regenerate.max_new_tokens ({d.max_length} + {g.max_new_tokens}) for regeneration in the engine: a "
         "prompt of up to data.max_length tokens plus the answer (or null = exactly that)",
         ("data.max_length", "data.regenerate.max_new_tokens", "data.regenerate.backend")),
        ("engine.urls", e.mode == "launch" and bool(e.urls), "launch starts its own servers, but engine.urls lists "
         "some: set engine.mode: attach to use them (or empty engine.urls)", ("engine.mode",)),
        ("engine.replicas", e.mode == "attach" and e.replicas != 1, "replicas are started in launch mode only; in "
         "attach mode list one URL per server in engine.urls", ("engine.mode",)),
        ("engine.hidden_states_dir", uses and e.mode == "attach" and not e.hidden_states_dir, "attach mode with "
         "data.features_backend: vllm needs the directory the servers' hidden-states connector writes to, as this "
         "machine sees it", ("engine.mode", "data.features_backend")),
        ("engine.devices", bool(devices) and len(devices) % e.replicas != 0, f"{len(devices)} devices cannot be "
         f"split evenly over {e.replicas} replicas", ("engine.replicas",)),
        ("engine.devices", bool(overlap), f"GPUs {overlap} are also the trainer's (trainer.devices = "
         f"{recipe.trainer.devices!r}); give the engine other GPUs", ("trainer.devices", "trainer.accelerator")),
        ("engine.max_model_len", uses and e.max_model_len is not None and e.max_model_len <= d.max_length,
         f"must exceed data.max_length ({d.max_length}): a hidden-states request is the sample plus one token made",
         ("data.max_length",)),
        ("data.mode", d.mode == "hybrid" and not uses, "hybrid (the first pass streams from the engine and writes the "
         "feature store) needs data.features_backend: vllm", ("data.features_backend",)),
        ("engine.num_nodes", nodes > 1 and e.mode == "launch", "launch starts servers on this node only; a server "
         "over several nodes is started by `eagle3-zoo serve RECIPE --node-rank R` on each of them (engine.mode: "
         "attach)", ("engine.mode",)),
        ("engine.num_nodes", nodes > 1 and gpus % nodes != 0, f"the server's {gpus} GPUs (tensor_parallel_size x "
         f"data_parallel_size) cannot be split evenly over {nodes} nodes",
         ("engine.tensor_parallel_size", "engine.data_parallel_size")),
        ("engine.master_addr", nodes > 1 and not e.master_addr, f"a server over {nodes} nodes needs node 0's address "
         "as the other nodes reach it (e.g. engine.master_addr=10.0.0.5)", ("engine.num_nodes",)),
        ("engine.gpu_memory_utilization", e.platform == "cpu" and e.gpu_memory_utilization is not None,
         "is for GPU engines, but engine.platform is cpu (a CPU build's KV cache is engine.cpu_kv_cache_gib)",
         ("engine.platform",)),
    ]
    return urls_problems(e.urls) + [ConfigProblem(key, msg, operator.attrgetter(key)(recipe), related=rel)
                                     for key, broken, msg, rel in rules if broken]


def _cross_field_rules(r: Recipe) -> list[tuple[str, bool, str, tuple[str, ...]]]:
    """Rules that read several fields: (key, broken, message, the other keys read)."""
    d, t, tr, w = r.drafter, r.ttt, r.trainer, r.ttt.step_weights
    heads, kv = d.num_attention_heads, d.num_key_value_heads
    return [
        ("drafter.num_key_value_heads", bool(heads and kv and kv > 0 and heads % kv),
         f"must divide num_attention_heads ({heads})", ("drafter.num_attention_heads",)),
        ("ttt.step_weights", w is not None and len(w) != t.steps,
         f"has {len(w or [])} entries but ttt.steps = {t.steps}", ("ttt.steps",)),
        ("ttt.step_weights", w is not None and len(w) == t.steps and (any(x < 0 for x in w) or not any(w)),
         "weights must be >= 0 and not all 0", ()),
        ("optim.warmup_steps", tr.max_steps is not None and r.optim.warmup_steps > tr.max_steps,
         f"exceeds trainer.max_steps ({tr.max_steps})", ("trainer.max_steps",)),
        ("trainer.max_steps", tr.max_steps is None and tr.max_epochs is None,
         "set trainer.max_steps or trainer.max_epochs (both are null)", ("trainer.max_epochs",)),
        ("trainer.strategy", tr.num_nodes > 1 and tr.strategy == "auto",
         "multi-node training needs an explicit strategy: ddp or fsdp", ("trainer.num_nodes",)),
        ("ttt.schedule", t.schedule == "ramp" and t.steps == 1, "a ramp needs ttt.steps > 1", ("ttt.steps",)),
        ("data.packing", r.data.packing and streams_features(r.data), "cannot be combined with hidden states streamed "
         "from the engine (data.features_backend = vllm, data.mode online or hybrid): pack stored features "
         "(data.mode = offline) or set data.packing = false", ("data.features_backend", "data.mode")),
        ("optim.precondition_fc", r.optim.precondition_fc and d.fc_norm, "cannot be combined with drafter.fc_norm: "
         "its scale is measured on the raw features, which fc_norm normalises per aux layer first",
         ("drafter.fc_norm",))] + _dflash_rules(r) + _dspark_rules(r)


_DFLASH = "with drafter.kind = dflash"


def _dflash_rules(r: Recipe) -> list[tuple[str, bool, str, tuple[str, ...]]]:
    """EAGLE-3 settings that would silently do nothing (or something else) for a DFlash drafter, and DFlash's soft
    labels for another kind."""
    if r.drafter.kind != "dflash":
        return [("drafter.dflash.labels", r.drafter.dflash.labels != "hard", f"is read {_DFLASH} only; an "
                 f"{r.drafter.kind} drafter has its own objective (EAGLE-3 always trains against the target's "
                 "distribution: loss.name)", ("drafter.kind",))]
    return _block_rules(r, "DFlash", r.drafter.dflash, "drafter.dflash.weighting's (dpace or decay)",
                        "the DFlash loss is the cross-entropy to the next tokens (drafter.dflash.labels = hard) or to "
                        "the target's distribution (soft), weighted by drafter.dflash.weighting")


def _dspark_rules(r: Recipe) -> list[tuple[str, bool, str, tuple[str, ...]]]:
    """EAGLE-3 settings that would silently do nothing (or something else) for a DSpark drafter: DFlash's rules."""
    if r.drafter.kind != "dspark":
        return []
    return _block_rules(r, "DSpark", r.drafter.dspark, "drafter.dspark.decay_gamma's (exp(-k/gamma))",
                        "the DSpark loss is drafter.dspark's ce_weight CE + tv_weight TV + bce_weight BCE against the "
                        "target's distribution")


def _block_rules(r: Recipe, name: str, section: BlockDrafterSection, weights: str,
                 loss: str) -> list[tuple[str, bool, str, tuple[str, ...]]]:
    """The rules of a block drafter on the DFlash backbone (`name`: DFlash or DSpark; `section`: its recipe
    subsection; `weights`: what sets its position weights; `loss`: what its loss is)."""
    d, t, sub = r.drafter, r.ttt, name.lower()
    kind, w = ("drafter.kind",), f"with drafter.kind = {sub}"
    return [
        ("drafter.aux_layer_ids", d.aux_layer_ids is not None, f"is EAGLE-3's; {w} set "
         f"drafter.{sub}.target_layer_ids (0-based decoder layers whose output is read) or num_target_features", kind),
        ("drafter.fc_norm", d.fc_norm, f"is an EAGLE-3.1 option; a {name} drafter has none ({w})", kind),
        ("drafter.norm_output", d.norm_output, f"is an EAGLE-3.1 option; a {name} drafter has none ({w})", kind),
        ("drafter.init_head", d.init_head != "random", f"must be random {w}: a full-vocabulary {name} drafter "
         "scores with the target's lm_head itself, a reduced one starts its own at random", kind),
        ("drafter.init_from", sub == "dspark" and d.init_from is not None,
         f"is not supported {w} yet (train from scratch)", kind),
        ("drafter.hidden_size", d.hidden_size is not None, f"must be null {w}: a {name} drafter has the "
         "target's width", kind),
        ("ttt.schedule", t.schedule != "constant", f"must be constant {w}: a block is drafted in one pass, "
         "nothing is unrolled (the ttt section is not read)", kind),
        ("ttt.step_weights", t.step_weights is not None, f"must be null {w}: position weights are {weights}", kind),
        ("loss.name", r.loss.name != "soft_ce", f"must be soft_ce (the default) {w}: {loss}", kind),
        ("optim.precondition_fc", r.optim.precondition_fc, f"is EAGLE-3's; not supported {w}", kind),
        ("trainer.tau_eval.every_n_steps", r.trainer.tau_eval.every_n_steps is not None, f"must be null {w}: "
         f"the tau callback drives the tree decoder (EAGLE-3); measure a {name} drafter's tau after training with "
         "`eagle3-zoo eval DRAFTER_DIR` (our block decoder)"
         + (" or `eval --engine vllm`" if sub == "dflash" else " (vLLM's CPU build does not serve DSpark)"), kind),
        ("trainer.activation_checkpointing", r.trainer.activation_checkpointing, f"is not supported {w} yet "
         f"(it recomputes EAGLE-3's single MLP; `eagle3-zoo plan` sizes a {name} step without it)", kind),
        (f"drafter.{sub}.target_layer_ids", section.target_layer_ids is not None
         and len(section.target_layer_ids) != section.num_target_features and section.num_target_features != 5,
         f"has {len(section.target_layer_ids or [])} ids but drafter.{sub}.num_target_features = "
         f"{section.num_target_features}: set one of them", (f"drafter.{sub}.num_target_features",))]


def _secret_problems(r: Recipe) -> list[ConfigProblem]:
    """The server URL and the key variable's name: their problems show a redacted value (a URL with a password in it,
    or a key pasted where its variable's name belongs, must not be printed)."""
    from eagle3_zoo.values.locations import env_name_problem, redact_url, url_problem

    g = r.data.regenerate
    return [ConfigProblem(key, msg, shown) for key, msg, shown in (
        ("data.regenerate.base_url", g.base_url is not None and url_problem(g.base_url), redact_url(g.base_url or "")),
        ("data.regenerate.api_key_env", g.api_key_env is not None and env_name_problem(g.api_key_env), "***"),
        ("engine.api_key_env", r.engine.api_key_env is not None and env_name_problem(r.engine.api_key_env), "***"))
        if msg]


def _problems(recipe: Recipe) -> list[ConfigProblem]:
    """Each field's own rule (sections and list items included), then the rules that read several fields."""
    return schema.value_problems(recipe) + _secret_problems(recipe) + [
        ConfigProblem(k, msg, operator.attrgetter(k)(recipe), related=rel)
        for k, broken, msg, rel in _cross_field_rules(recipe) if broken] + _loss_problems(recipe.loss) + \
        engine_problems(recipe)


def _raise_if(problems: list[ConfigProblem], source_of: typing.Callable[[str], str]) -> None:
    """Raise `problems` (if any), each attributed to its own source or else to `source_of(key)`."""
    for p in problems:
        p.source = p.source or source_of(p.key)
    if problems:
        raise RecipeError(problems)


def validate_recipe(cfg: Recipe | DictConfig, source: str = "recipe") -> None:
    """Check the values of a typed recipe or its structured config (ranges, paths, cross-field rules).

    Raises:
        RecipeError: every problem found, attributed to `source` (a file path).
    """
    _raise_if(_problems(OmegaConf.to_object(cfg) if isinstance(cfg, DictConfig) else cfg), lambda key: source)


def validate_against_target(drafter: DrafterConfig, num_layers: int, vocab_size: int, hidden_size: int,
                            source: str = "recipe") -> None:
    """Cross-check a recipe's `drafter` section against the target's config (known only once the target config is
    read).

    Raises:
        RecipeError: draft vocab larger than the target vocab, aux layer ids out of range, or a drafter width
            that differs from the target's (the frozen target embedding feeds the drafter directly).
    """
    d = drafter
    problems = [ConfigProblem(key, message, value, source) for key, value, broken, message in [
        ("drafter.draft_vocab_size", d.draft_vocab_size, d.draft_vocab_size > vocab_size,
         f"exceeds the target vocabulary ({vocab_size})"),
        ("drafter.aux_layer_ids", d.aux_layer_ids, any(not 0 <= i < num_layers for i in d.aux_layer_ids or []),
         f"out of range for a {num_layers}-layer target (valid 0..{num_layers - 1})"),
        ("drafter.hidden_size", d.hidden_size, d.hidden_size not in (None, hidden_size),
         f"must equal the target hidden size ({hidden_size}) because the frozen target embedding is fed to the "
         "drafter"),
        *((f"drafter.{k}.target_layer_ids", getattr(d, k).target_layer_ids, d.kind == k
           and any(not 0 <= i < num_layers - 1 for i in getattr(d, k).target_layer_ids or []),
           f"out of range for a {num_layers}-layer target (valid 0..{num_layers - 2}: the output of layer id is the "
           "hidden state entering layer id + 1)") for k in ("dflash", "dspark"))] if broken]
    if problems:
        raise RecipeError(problems)


# ------------------------------------------------------------------------------------------------ loading
def _read_text(path: str | os.PathLike, source: str) -> str:
    """The recipe file's text; a binary file (or another encoding) is one problem naming the byte."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RecipeError([ConfigProblem("<file>", f"not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}): "
                                         "a recipe is a YAML file (see recipes/)", source=source)]) from None


def _parse_yaml(text: str, source: str) -> DictConfig:
    try:
        parsed = yaml.safe_load(text)
    except RecursionError:  # PyYAML's composer recurses per nesting level
        raise RecipeError([ConfigProblem("<yaml>", "nested too deeply for the YAML reader (a recipe has a few levels "
                                         "of sections)", source=source)]) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line, source = (mark.line + 1, f"{source}:{mark.line + 1}:{mark.column + 1}") if mark else ("?", source)
        raise RecipeError([ConfigProblem("<yaml>", f"YAML syntax error at line {line}: "
                                         f"{getattr(e, 'problem', None) or e}", source=source)]) from None
    if not isinstance(parsed, dict):
        raise RecipeError([ConfigProblem("<file>", "empty recipe file (no keys)", source=source) if parsed is None
                           else ConfigProblem("<root>", "expected a mapping at the top level", parsed, source)])
    try:  # OmegaConf's own loader: it reads 1e-4 as a float, where PyYAML's YAML 1.1 rules give a string
        return OmegaConf.create(text)
    except RecursionError:
        raise RecipeError([ConfigProblem("<yaml>", "nested too deeply (a recipe has a few levels of sections)",
                                         source=source)]) from None
    except (yaml.YAMLError, OmegaConfBaseException) as e:
        raise RecipeError([ConfigProblem("<yaml>", str(e).splitlines()[0], source=source)]) from None


def _shown(override: str) -> str:
    """An override as messages quote it: the value of a key-variable setting and any `user:password@` of a URL
    hidden (a key pasted on the command line must not be printed back)."""
    key, sep, value = override.partition("=")
    if sep and key.strip().endswith("api_key_env"):
        return f"{key}=***"
    return re.sub(r"(://)[^/@\s]*@", r"\1***@", override)


def _recipe_path_hint(path: Path) -> str:
    """"; did you mean 'recipes/smollm2_135m.yaml'?" with the YAML file of `path`'s folder closest to its name."""
    folder = path.parent
    if not folder.is_dir():
        return f" (no folder {str(folder)!r})"
    names = sorted(p.name for p in folder.iterdir() if p.suffix in (".yaml", ".yml") and p.is_file())
    return schema.did_you_mean(path.name, names, prefix="" if str(folder) == "." else f"{folder}{os.sep}")


def load_recipe(path: str | os.PathLike, overrides: typing.Sequence[str] = ()) -> Recipe:
    """The typed `Recipe` (interpolations resolved) of a YAML file with OmegaConf dotlist `overrides` applied in
    order (e.g. `["trainer.max_steps=2000"]`), validated.

    Raises:
        RecipeError: every problem at once (file or override, dotted key, bad value, what is expected).
    """
    source, applied, problems = str(path), {}, []
    if not Path(path).is_file():
        raise RecipeError([ConfigProblem("<file>", "recipe file not found" + _recipe_path_hint(Path(path)), source,
                                         source)])
    cfg = _parse_yaml(_read_text(path, source), source)
    for ov in overrides:
        (key, sep, _), src = ov.partition("="), f"override '{_shown(ov)}'"
        try:
            if not sep or not key.strip():
                raise ValueError("an override must look like key=value")
            cfg.merge_with_dotlist([ov])
            applied[key.strip()] = src
        except (OmegaConfBaseException, yaml.YAMLError, ValueError) as e:
            why = str(e) if not sep or not key.strip() else f"cannot apply override: {str(e).splitlines()[0]}"
            problems.append(ConfigProblem(key or ov, why, source=src))

    def source_of(key: str) -> str:  # the last override that set the key (or a section above or an item under it)
        return next((src for k, src in reversed(applied.items()) if key == k or key.startswith((k + ".", k + "["))
                     or k.startswith(key + ".")), source)

    try:
        raw = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as e:
        raise RecipeError([*problems, ConfigProblem(getattr(e, "full_key", None) or "<interpolation>",
                                                    str(e).splitlines()[0], source=source)]) from None
    unresolved = OmegaConf.to_container(cfg, resolve=False)
    _register_secrets(raw, unresolved)  # before any message could quote one
    clean = schema.check_types(raw, Recipe, "", problems)
    try:  # the typed values (an integer for a number becomes a float) over the defaults
        recipe = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Recipe), clean))
    except OmegaConfBaseException:  # only after a schema problem
        recipe = None
    problems += schema.unechoed(_problems(recipe) if recipe else [], problems)
    _raise_if(problems, source_of)
    recipe.loss = recipe.loss.resolved()
    typed = _plain(recipe)
    # not a dataclass field: OmegaConf.structured and dataclass equality ignore it
    setattr(recipe, _ENV_VALUES, {path: (text, _at(typed, path)) for path, text in _env_sourced(unresolved).items()
                                  if _at(typed, path) is not _ABSENT})
    return recipe


# ------------------------------------------------------------------------------------------------ recipes as data
_ENV_INTERPOLATION = re.compile(r"\$\{\s*oc\.env\s*:")
_ENV_VARIABLE = re.compile(r"\$\{\s*oc\.env\s*:\s*([A-Za-z_][A-Za-z0-9_]*)")
_SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSW|CREDENTIAL|AUTH", re.IGNORECASE)  # OPENAI_API_KEY, DB_PASSWORD
_ENV_PROBE, _PROBED = "eagle3_zoo.env_probe", "EAGLE3ZOOENVPROBE"
_ENV_VALUES = "_env_values"  # attribute of a loaded Recipe: {path: (interpolation text, the typed value it gave)}
_ABSENT = object()


def _register_secrets(raw: dict, unresolved: dict) -> None:
    """Tell the redaction layer what the recipe gives the run: its key variables, the values of key flags in its
    server arguments, URL credentials, and the variables named through `${oc.env:...}` that hold keys by name."""
    register_recipe(raw)
    for text in _strings(unresolved):
        for name in _ENV_VARIABLE.findall(text):
            if _SECRET_NAME.search(name):
                register_variable(name, f"the value of ${name} (named in the recipe)")


def _strings(tree: typing.Any) -> typing.Iterator[str]:
    if isinstance(tree, str):
        yield tree
    for value in tree.values() if isinstance(tree, dict) else tree if isinstance(tree, list) else ():
        yield from _strings(value)


def _env_sourced(unresolved: dict) -> dict[tuple, str]:
    """The paths of the values an `${oc.env:...}` interpolation gives (in the value itself, or in what it refers
    to) -> their interpolation text. Found by resolving a copy in which every `oc.env` returns a marker (no
    variable is read); a copy that does not resolve keeps every interpolation as text."""
    if not OmegaConf.has_resolver(_ENV_PROBE):
        OmegaConf.register_resolver(_ENV_PROBE, lambda *args: _PROBED, replace=True)

    def probe(tree: typing.Any) -> typing.Any:
        if isinstance(tree, str):
            return _ENV_INTERPOLATION.sub("${" + _ENV_PROBE + ":", tree)
        if isinstance(tree, dict):
            return {k: probe(v) for k, v in tree.items()}
        return [probe(v) for v in tree] if isinstance(tree, list) else tree

    try:
        probed = OmegaConf.to_container(OmegaConf.create(probe(unresolved)), resolve=True)
    except OmegaConfBaseException:
        probed = None
    found: dict[tuple, str] = {}

    def walk(text: typing.Any, value: typing.Any, path: tuple) -> None:
        if isinstance(text, str):
            if "${" in text and (probed is None or _PROBED in repr(value)):
                found[path] = text
        elif isinstance(text, dict):
            for k, v in text.items():
                walk(v, value.get(k) if isinstance(value, dict) else None, (*path, k))
        elif isinstance(text, list):
            for i, v in enumerate(text):
                walk(v, value[i] if isinstance(value, list) and i < len(value) else None, (*path, i))

    walk(unresolved, probed, ())
    return found


def _plain(recipe: Recipe) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(recipe), resolve=True)


def _at(tree: typing.Any, path: tuple) -> typing.Any:
    for key in path:
        if isinstance(tree, dict) and key in tree:
            tree = tree[key]
        elif isinstance(tree, list) and isinstance(key, int) and key < len(tree):
            tree = tree[key]
        else:
            return _ABSENT
    return tree


def _with_env_text(recipe: Recipe, shown: typing.Callable[[str, typing.Any], typing.Any]) -> dict:
    """The recipe's plain dict with each value that came from `${oc.env:...}` (and still holds what it gave)
    replaced by `shown(interpolation text, value)`, secrets redacted."""
    plain = _plain(recipe)
    for path, (text, value) in getattr(recipe, _ENV_VALUES, {}).items():
        if path and _at(plain, path) == value:
            parent = _at(plain, path[:-1])
            parent[path[-1]] = shown(text, value)
    return redact_data(plain)


def recipe_to_dict(recipe: Recipe) -> dict:
    """The recipe as every artefact holds it (recipe.yaml, provenance.json, hyperparameters, checkpoints, model
    cards): plain nested dicts, resolved, except that a value that came from an `${oc.env:...}` interpolation is
    that text (it is resolved again when a recipe.yaml is loaded), and with the run's secrets redacted."""
    return _with_env_text(recipe, lambda text, value: text)


def recipe_identity_dict(recipe: Recipe) -> dict:
    """The recipe as a run's identity holds it (`eagle3_zoo.training.rundir.resume`, stored in every checkpoint): as
    `recipe_to_dict`, but a value from `${oc.env:...}` is its text with a digest of the value, so that a resume
    with another value is refused without the value being stored (secrets are redacted: a rotated key trains the
    same drafter)."""
    def shown(text: str, value: typing.Any) -> str:
        return f"{text} (sha256 {hashlib.sha256(repr(value).encode()).hexdigest()[:16]})"

    return _with_env_text(recipe, shown)


def resolved_recipe_yaml(recipe: Recipe | DictConfig) -> str:
    """The resolved recipe (defaults + file + overrides) as YAML, as `fit --print-config` shows it: the values this
    process runs with (those of `${oc.env:...}` included: the command prints them to whoever ran it), secrets
    redacted."""
    tree = OmegaConf.to_container(recipe if isinstance(recipe, DictConfig) else OmegaConf.structured(recipe),
                                  resolve=True)
    return OmegaConf.to_yaml(OmegaConf.create(redact_data(tree)), resolve=False)


def save_resolved_recipe(recipe: Recipe, path: str | os.PathLike) -> Path:
    """Write recipe.yaml (`recipe_to_dict`: resolved, `${oc.env:...}` kept as text, secrets redacted) atomically
    (temp file in the same directory, fsync, rename); the path."""
    from eagle3_zoo.util.fileio import atomic_write_text

    atomic_write_text(Path(path), OmegaConf.to_yaml(OmegaConf.create(recipe_to_dict(recipe)), resolve=False))
    return Path(path)
