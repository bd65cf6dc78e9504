"""The EAGLE-3 drafter: one Llama decoder layer over fused target features, in the SGLang/official layout.

    g        = fc(cat(low, mid, high))                                  # step 0 only
    x        = cat(input_layernorm(embed(token)), hidden_norm(h))       # width 2H, embedding first
    h'       = h + o_proj(attn(q_proj(x), k_proj(x), v_proj(x)))        # residual is the pre-norm input h
    h'       = h' + mlp(post_attention_layernorm(h'))
    logits   = lm_head(norm(h'))                                        # draft vocab; h' is fed back

EAGLE-3.1 options (`Eagle3Config.fc_norm` / `norm_output`, arXiv 2605.09992, the forward pass vLLM runs for them):
`fc_norm` puts one RMSNorm on each aux hidden state before fc (g = fc(cat(fc_norm_i(chunk_i)))), `norm_output`
feeds `norm(h')` back to the next step instead of `h'` (it becomes that step's residual too).

Two forward paths share the weights and the projection/RoPE code: `ttt_rollout` (whole sequences, K unrolled
steps, the TTT attention pattern) and `step` (a few new tokens over a KV cache, explicit mask and positions),
which chain and tree drafting use.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from eagle3_zoo.modeling.attention import cached_attention, ttt_attention
from eagle3_zoo.modeling.config import Eagle3Config
from eagle3_zoo.util.fileio import atomic_write
from eagle3_zoo.values.dtypes import torch_dtype

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


def _in_autocast_dtype(x: torch.Tensor) -> torch.Tensor:
    """`x` in autocast's dtype under autocast, else unchanged. An fp32 norm output feeding several projections
    would otherwise be cast (and saved for backward) once per projection: cast once, shared by all of them."""
    device_type = x.device.type  # (`meta` has no autocast)
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return x.to(torch.get_autocast_dtype(device_type))
    return x


class Eagle3RotaryEmbedding(LlamaRotaryEmbedding):
    """`LlamaRotaryEmbedding` whose frequencies stay fp32 whatever the drafter is cast to.

    A non-persistent buffer: it moves with the module (`.to(device)`, Lightning, FSDP2), so RoPE never copies it
    host-to-device in a step, and it is not part of the saved weights. Any cast (`.to(bf16)`, `.half()`, `to_empty`)
    puts the fp32 frequencies back on the new device: a bf16 round trip would shift every rotation angle.
    """

    def __init__(self, config):
        super().__init__(config)
        with torch.device("cpu"):  # a real copy also when the drafter is built on the meta device
            # a plain tensor attribute, not a buffer (an `nn.Buffer` value would register as one): never cast or moved
            self._fp32_inv_freq = LlamaRotaryEmbedding(config).inv_freq.detach().clone()

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        device = self.inv_freq.device
        self.inv_freq = self._fp32_inv_freq.to(device, copy=True)
        self.original_inv_freq = self._fp32_inv_freq.to(device, copy=True)
        return self


class Eagle3Attention(nn.Module):
    def __init__(self, config: Eagle3Config):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        self.q_proj = nn.Linear(2 * h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B,T,2H] -> q [B,heads,T,d], k/v [B,kv_heads,T,d] with RoPE applied to q and k."""
        b, t, _ = x.shape
        x = _in_autocast_dtype(x)  # one copy for the three projections (fp32 under autocast with fp32 norm weights)
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def output(self, attn: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = attn.shape
        return self.o_proj(attn.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))


class Eagle3DecoderLayer(nn.Module):
    def __init__(self, config: Eagle3Config):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = LlamaRMSNorm(h, eps=eps)
        self.hidden_norm = LlamaRMSNorm(h, eps=eps)
        self.self_attn = Eagle3Attention(config)
        self.post_attention_layernorm = LlamaRMSNorm(h, eps=eps)
        self.mlp = LlamaMLP(config.to_llama_config())

    def attn_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)

    def finish(self, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        h = hidden + self.self_attn.output(attn)
        return h + self.mlp(_in_autocast_dtype(self.post_attention_layernorm(h)))


class DraftCache:
    """KV cache of the drafter's single layer: keys/values `[B, kv_heads, S, d]` (RoPE applied)."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.keys is None else self.keys.shape[-2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys is None:
            self.keys, self.values = k, v
        else:
            self.keys = torch.cat([self.keys, k], dim=-2)
            self.values = torch.cat([self.values, v], dim=-2)
        return self.keys, self.values

    def keep(self, indices: torch.Tensor) -> None:
        """Keep the cached slots `indices` (in this order) and drop the rest."""
        if self.keys is None:
            return
        indices = indices.to(self.keys.device)
        self.keys = self.keys.index_select(-2, indices)
        self.values = self.values.index_select(-2, indices)

    def crop(self, length: int) -> None:
        if self.keys is not None:
            self.keys, self.values = self.keys[..., :length, :], self.values[..., :length, :]


@dataclass
class DraftStepOutput:
    logits: torch.Tensor  # [B, q, draft_vocab]
    hidden: torch.Tensor  # [B, q, H] fed back as the next step's `hidden`: pre-norm (post-norm with norm_output)


class Eagle3Drafter(nn.Module):
    """EAGLE-3 draft head. The target's embedding is passed in (frozen) and never part of this module."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.config = config
        self.fc = nn.Linear(config.num_aux_layers * config.target_hidden_size, config.hidden_size, bias=False)
        # EAGLE-3.1: weights fc_norm.{i}.weight, as vLLM loads them (registered only when on: an EAGLE-3 state dict
        # keeps exactly its canonical keys)
        self.fc_norm = nn.ModuleList(LlamaRMSNorm(config.target_hidden_size, eps=config.rms_norm_eps)
                                     for _ in range(config.num_aux_layers)) if config.fc_norm else None
        self.midlayer = Eagle3DecoderLayer(config)
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.rotary_emb = Eagle3RotaryEmbedding(config.to_llama_config())  # fp32 under any cast; not saved
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[: config.draft_vocab_size] = True  # identity-prefix mapping until set_vocab
        self.register_buffer("t2d", t2d)
        # per-input-dim multiplier of the fc input during training (`set_fc_input_scale`); not part of the checkpoint
        # format: `fold_fc_input_scale` moves it into fc.weight before a drafter is written
        self.register_buffer("fc_input_scale", torch.ones(self.fc.in_features), persistent=False)
        self._fc_scaled = False
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)

    # ---- vocabulary ----
    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape:
            raise ValueError(
                f"vocab mapping shapes d2t {tuple(d2t.shape)}, t2d {tuple(t2d.shape)} do not match the drafter "
                f"(draft_vocab_size={self.config.draft_vocab_size}, vocab_size={self.config.vocab_size})"
            )
        if int(t2d.sum()) != self.config.draft_vocab_size:
            raise ValueError(f"t2d marks {int(t2d.sum())} ids, expected {self.config.draft_vocab_size}")
        self.d2t.copy_(d2t.to(torch.int64))
        self.t2d.copy_(t2d.to(torch.bool))

    @torch.no_grad()
    def init_head_from_target(self, lm_head_weight: torch.Tensor, norm_weight: torch.Tensor | None = None) -> None:
        """Start the output side from the target's: `lm_head` = the target's lm_head rows of the draft vocabulary
        (call after `set_vocab`), `norm` = the target's final norm weight. A fresh head then already reads a hidden
        state the way the target does, instead of learning the readout from random (vLLM speculators starts from
        the verifier's lm_head the same way)."""
        expected = (self.config.vocab_size, self.config.hidden_size)
        if tuple(lm_head_weight.shape) != expected:
            raise ValueError(f"target lm_head weight has shape {tuple(lm_head_weight.shape)}, expected {expected} "
                             f"(vocab_size, drafter hidden_size)")
        rows = self.draft_to_target(torch.arange(self.config.draft_vocab_size, device=self.d2t.device))
        # rows picked where the target's weight lives (a GPU), then copied: only Vd rows cross to the drafter
        picked = lm_head_weight.index_select(0, rows.to(lm_head_weight.device))
        self.lm_head.weight.copy_(picked.to(self.lm_head.weight))
        if norm_weight is not None:
            if tuple(norm_weight.shape) != (self.config.hidden_size,):
                raise ValueError(f"target norm weight has shape {tuple(norm_weight.shape)}, expected "
                                 f"({self.config.hidden_size},)")
            self.norm.weight.copy_(norm_weight.to(self.norm.weight))

    @torch.no_grad()
    def set_fc_input_scale(self, scale: torch.Tensor) -> None:
        """Precondition the fc input: `fuse(x) = fc(x * scale)` until `fold_fc_input_scale`.

        Target residual streams carry a few "massive activation" dimensions (on SmolLM2, mean |x| of 100-330 in
        three dims at layers 15 and 27 against ~5 elsewhere). With `scale` = 1 / (per-dim RMS), every input dim
        moves the fused hidden state at the same rate under Adam, instead of the outlier dims dominating it. The
        function the drafter computes is unchanged by folding: fc.weight * scale is the exported weight.
        """
        if scale.shape != self.fc_input_scale.shape:
            raise ValueError(f"fc input scale has shape {tuple(scale.shape)}, "
                             f"expected {tuple(self.fc_input_scale.shape)}")
        if not torch.isfinite(scale).all() or (scale <= 0).any():
            raise ValueError("fc input scale must be finite and > 0 in every dimension")
        self.fc_input_scale.copy_(scale.to(self.fc_input_scale))
        self._fc_scaled = True

    @torch.no_grad()
    def fold_fc_input_scale(self) -> None:
        """Move the fc input scale into fc.weight (the canonical format has none); the scale becomes 1."""
        if self._fc_scaled:
            self.fc.weight.mul_(self.fc_input_scale.to(self.fc.weight).unsqueeze(0))
            self.fc_input_scale.fill_(1.0)
            self._fc_scaled = False

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    # ---- shared pieces ----
    def fuse(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """Target features `[B, T, n_aux*Ht]` -> step-0 hidden `[B, T, H]` (with `fc_norm`: each aux state normed)."""
        x = aux_hidden.to(self.fc.weight.dtype)
        if self.fc_norm is not None:
            x = torch.cat([norm(c) for norm, c in zip(self.fc_norm, x.chunk(len(self.fc_norm), dim=-1))], dim=-1)
        return self.fc(x * self.fc_input_scale.to(x.dtype) if self._fc_scaled else x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits of a step's pre-norm output."""
        return self.lm_head(self.norm(hidden))

    def feedback(self, hidden: torch.Tensor) -> torch.Tensor:
        """What a step feeds to the next one: its pre-norm output, or `norm(hidden)` with `norm_output`."""
        return self.norm(hidden) if self.config.norm_output else hidden

    def _rope(self, x: torch.Tensor, position_ids: torch.Tensor):
        return self.rotary_emb(x, position_ids)

    # ---- inference path ----
    def new_cache(self) -> DraftCache:
        return DraftCache()

    def step(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        cache: DraftCache,
        attn_mask: torch.Tensor | None = None,
        last_logits_only: bool = False,
    ) -> DraftStepOutput:
        """Run `q` new tokens over the cache.

        Args:
            embeds: `[B, q, H]` target embeddings of the input tokens.
            hidden: `[B, q, H]` step-0 fused features (`fuse`) or the previous step's `DraftStepOutput.hidden`.
            position_ids: `[B, q]` RoPE positions.
            cache: the drafter's KV cache; the new keys/values are appended.
            attn_mask: additive `[B, 1, q, len(cache)+q]` mask (0 = visible); None = causal, all past visible.
            last_logits_only: logits `[B, 1, Vd]` of the last row only (extending the context, where only the last
                row is drafted from: skips the lm_head on the other q - 1 rows, e.g. a whole prompt).
        """
        layer = self.midlayer
        hidden = hidden.to(self.fc.weight.dtype)
        x = layer.attn_input(embeds.to(hidden.dtype), hidden)
        cos, sin = self._rope(x, position_ids)
        q, k, v = layer.self_attn.project(x, cos, sin)
        k_all, v_all = cache.append(k, v)
        h = layer.finish(hidden, cached_attention(q, k_all, v_all, attn_mask))
        if self.config.norm_output:  # one norm serves the logits and the fed-back state
            out = self.norm(h)
            return DraftStepOutput(logits=self.lm_head(out[:, -1:] if last_logits_only else out), hidden=out)
        return DraftStepOutput(logits=self.logits(h[:, -1:] if last_logits_only else h), hidden=h)

    # ---- training path ----
    def ttt_rollout(
        self,
        embeds: torch.Tensor,
        aux_hidden: torch.Tensor,
        steps: int,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ):
        """Unroll the drafter for `steps` TTT steps over whole sequences; yields each step's pre-norm hidden.

        Args:
            embeds: `[B, T + steps, H]` target embeddings of the input tokens shifted by one: row t of step k uses
                `embeds[:, t + k]` (i.e. pass the embeddings of tokens x_1..x_{T+steps}; pad with any ids).
            aux_hidden: `[B, T, n_aux*Ht]` target features at positions 0..T-1.
            steps: number of unrolled steps K.
            position_ids: `[B, T]` base positions (default 0..T-1); step k uses position t + k.
            document_ids: `[B, T]` packed rows: the document of each position (attention stays inside it; see
                `ttt_attention`); None = one document per row.

        Yields:
            `[B, T, H]` pre-norm hidden of step k (logits = `self.logits(hidden)`), for k = 0..steps-1; the next
            step reads `self.feedback(hidden)` (gradients flow through the whole rollout).
        """
        layer = self.midlayer
        b, t, _ = aux_hidden.shape
        if embeds.shape[1] < t + steps - 1:
            raise ValueError(f"embeds must cover T + steps - 1 = {t + steps - 1} positions, got {embeds.shape[1]}")
        if position_ids is None:
            position_ids = torch.arange(t, device=aux_hidden.device).expand(b, t)
        hidden = self.fuse(aux_hidden)
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        for k in range(steps):
            x = layer.attn_input(embeds[:, k : k + t].to(hidden.dtype), hidden)
            cos, sin = self._rope(x, position_ids + k)
            q, key, value = layer.self_attn.project(x, cos, sin)
            keys.append(key)
            values.append(value)
            out = layer.finish(hidden, ttt_attention(q, keys, values, document_ids=document_ids))
            yield out
            hidden = self.feedback(out)

    # ---- checkpoint (canonical SGLang / official layout) ----
    def save_pretrained(self, save_dir: str | Path) -> Path:
        save_dir = Path(save_dir)
        save_dir.mkdir(parents=True, exist_ok=True)
        dtype = torch_dtype(self.config.torch_dtype)
        tensors = {
            name: (p.detach().to(dtype) if p.is_floating_point() else p.detach()).contiguous().cpu()
            for name, p in self.state_dict().items()
        }
        atomic_write(save_dir / WEIGHTS_NAME, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
        self.config.save(save_dir / CONFIG_NAME)
        return save_dir

    @classmethod
    def from_pretrained(
        cls, load_dir: str | Path, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
    ) -> Eagle3Drafter:
        load_dir = Path(load_dir)
        for name in (CONFIG_NAME, WEIGHTS_NAME):
            if not (load_dir / name).is_file():
                raise FileNotFoundError(f"{load_dir}: no {name}; a canonical EAGLE-3 drafter folder has {CONFIG_NAME} "
                                        f"and {WEIGHTS_NAME} (use eagle3_zoo.hub import for other formats)")
        config = Eagle3Config.load(load_dir / CONFIG_NAME)
        state = load_file(str(load_dir / WEIGHTS_NAME), device=str(device))
        model = cls(config)
        expected = set(model.state_dict())
        missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
        if missing or unexpected:
            raise ValueError(f"{load_dir / WEIGHTS_NAME}: missing keys {missing}, unexpected keys {unexpected}")
        model.load_state_dict(state)
        model.to(device=device, dtype=dtype or torch_dtype(config.torch_dtype))
        return model

