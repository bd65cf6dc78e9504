"""The target-adapter protocol and the registry keyed by Hugging Face `model_type`.

An adapter *declares* how a family is built (decoder-layer class, attribute paths, keys to ignore on load, chat
formats, a tiny test config); shared code only reads the declarations, never branches on family names.

This module and the family modules import no torch or transformers at the top: recipe validation reads the registry
(the known families) and must answer in a second; the methods that work on models import them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from eagle3_zoo.chat.formats import ChatFormat, build_chat_example, load_chat_formats, resolve_chat_format
from eagle3_zoo.chat.tiny_tokenizer import build_tiny_tokenizer

if TYPE_CHECKING:
    import torch
    from torch import nn
    from transformers import PretrainedConfig

# The shape every family's tiny test config starts from (vocab 512 fits the tiny tokenizers); adapters change it
# with `tiny_config_fields`.
TINY_SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256)


class UnknownAdapterError(ValueError):
    """No adapter is registered for a `model_type`."""


class TargetAdapter:
    """What eagle3-zoo needs to know about one target family. Subclass, fill the declarations, register.

    Everything is a declaration (including the capabilities below): shared code reads them, never a family name.

    Attributes:
        model_type: HF ``config.model_type`` (set by `register_adapter`).
        decoder_layer_class: Class name of the decoder layer (the FSDP wrap unit); matched by name so
            ``trust_remote_code`` copies of the same architecture qualify too.
        base_model_attr: Attribute of the ``*ForCausalLM`` holding the base model.
        layers_attr: Attribute of the base model holding the decoder layers.
        embed_attr: Attribute of the base model holding the token embedding.
        lm_head_attr: Attribute of the ``*ForCausalLM`` holding the output projection.
        final_norm_attr: Attribute of the base model holding the norm before the output projection.
        keys_to_ignore_on_load: Regexes of checkpoint keys that are expected to be unused (e.g. MTP layers).
        chat_format_names: The family's chat formats, shipped as data in ``resources/chat_formats/`` (template +
            metadata, see `eagle3_zoo.chat.formats.load_chat_format`); the one matching the tokenizer is used.
        tiny_config_fields: The family's fields over `TINY_SHAPE` for its tiny random test config (`tiny_config`).
        sliding_window_layers: The family has sliding-window attention layers (which ones, and the window, come
            from each model's config: `attention_windows`). Speculative verification builds their window masks.
        attention_sinks: The attention adds learned per-head sink logits to the softmax (gpt-oss); they need no
            cache entries, so verification handles them like plain attention (eager kernel).
        quantized_formats: Checkpoint ``quantization_config.quant_method`` values `load_target` dequantises on load
            (anything else quantised is refused with what to do instead).
        drafter_defaults: Drafter shape fields the engines' published drafters of this family use where they differ
            from "sized like the target" (shape keys of the drafter's config / the recipe's ``drafter`` section); a
            recipe's own value wins.
    """

    model_type: ClassVar[str] = ""
    decoder_layer_class: ClassVar[str] = ""
    base_model_attr: ClassVar[str] = "model"
    layers_attr: ClassVar[str] = "layers"
    embed_attr: ClassVar[str] = "embed_tokens"
    lm_head_attr: ClassVar[str] = "lm_head"
    final_norm_attr: ClassVar[str] = "norm"
    keys_to_ignore_on_load: ClassVar[tuple[str, ...]] = ()
    chat_format_names: ClassVar[tuple[str, ...]] = ()
    tiny_config_fields: ClassVar[Mapping[str, Any] | None] = None
    sliding_window_layers: ClassVar[bool] = False
    attention_sinks: ClassVar[bool] = False
    quantized_formats: ClassVar[tuple[str, ...]] = ()
    drafter_defaults: ClassVar[Mapping[str, Any]] = MappingProxyType({})

    @property
    def chat_formats(self) -> tuple[ChatFormat, ...]:
        """The declared chat formats, loaded from their resource files."""
        return load_chat_formats(*self.chat_format_names)

    @property
    def reasoning(self) -> bool:
        """Whether the family's chat formats carry the target's reasoning (their ``thinking`` feature; how: each
        format's ``reasoning``)."""
        return any("thinking" in fmt.features for fmt in self.chat_formats)

    @property
    def tool_turns(self) -> bool:
        """Whether the family's chat formats render tool calls and tool results (their ``tools`` feature)."""
        return any("tools" in fmt.features for fmt in self.chat_formats)

    def aux_layer_ids(self, num_layers: int) -> tuple[int, int, int]:
        """Default EAGLE-3 aux layers (low, mid, high), internal convention (= HF hidden-state indices).

        The engines' rule (`eagle3_zoo.modeling.config.default_aux_layer_ids`); a family whose engines pick other
        layers overrides this.

        Raises:
            ValueError: if the target is too shallow for the default; pass explicit ids then.
        """
        from eagle3_zoo.modeling.config import default_aux_layer_ids

        return default_aux_layer_ids(num_layers)

    def attention_windows(self, config: PretrainedConfig) -> tuple[int | None, ...]:
        """Per decoder layer, its sliding window (a key at position k is visible from a query at q iff
        ``q - window < k <= q``, transformers' rule) or None for full attention, read from `config`.

        ``layer_types`` names each layer's kind (Gemma 3, gpt-oss, Qwen); without it a set ``sliding_window``
        applies to every layer (Mistral).

        Raises:
            ValueError: a layer kind other than full or sliding attention (e.g. chunked), which verification does
                not mask.
        """
        n = config.num_hidden_layers
        window = getattr(config, "sliding_window", None)
        kinds = getattr(config, "layer_types", None) or (["sliding_attention" if window else "full_attention"] * n)
        unknown = sorted(set(kinds) - {"full_attention", "sliding_attention"})
        if unknown:
            raise ValueError(f"adapter '{self.model_type}': layer_types {unknown} are not supported (only "
                             f"full_attention and sliding_attention)")
        if "sliding_attention" in kinds and not window:
            raise ValueError(f"adapter '{self.model_type}': config has sliding_attention layers but no sliding_window")
        return tuple(window if kind == "sliding_attention" else None for kind in kinds[:n])

    def tiny_config(self) -> PretrainedConfig:
        """A small random-weight config of this family for tests: `TINY_SHAPE` updated with the adapter's
        `tiny_config_fields` (its family's own fields: head_dim, experts, sliding windows, RoPE, tied head...)."""
        if self.tiny_config_fields is None:
            raise NotImplementedError(f"{type(self).__name__} declares no tiny_config_fields")
        from transformers import AutoConfig

        return AutoConfig.for_model(self.model_type, **{**TINY_SHAPE, **self.tiny_config_fields})

    def tiny_tokenizer(self) -> Any:
        """A byte-level BPE tokenizer with the family's special tokens and first chat format (ids < 512), for tests."""
        fmt = self.chat_formats[0] if self.chat_formats else None
        if fmt is None or fmt.tokenizer is None:
            raise NotImplementedError(f"{type(self).__name__}: its first chat format declares no 'tokenizer' specials")
        return build_tiny_tokenizer(fmt.tokenizer, fmt.template)

    def base_model(self, model: nn.Module) -> nn.Module:
        """The base (headless) model of a ``*ForCausalLM``; a base model is returned as is."""
        from torch import nn

        inner = getattr(model, self.base_model_attr, None)
        if isinstance(inner, nn.Module) and hasattr(inner, self.layers_attr):
            return inner
        if hasattr(model, self.layers_attr):
            return model
        raise ValueError(
            f"{type(model).__name__} has neither '{self.base_model_attr}.{self.layers_attr}' nor '{self.layers_attr}' "
            f"(adapter '{self.model_type}')"
        )

    def decoder_layers(self, model: nn.Module) -> nn.ModuleList:
        """The decoder layers, in order."""
        return getattr(self.base_model(model), self.layers_attr)

    def decoder_layer_cls(self, model: nn.Module) -> type[nn.Module]:
        """The decoder-layer class of `model` (the FSDP wrap unit / activation-checkpointing unit).

        Matched along each layer's MRO, so layers FSDP2 has already swapped to its ``FSDP<Name>`` subclasses still
        resolve to the declared class.

        Raises:
            ValueError: if the layers are not of the declared class (model and adapter disagree).
        """
        found = set()
        for layer in self.decoder_layers(model):
            match = [cls for cls in type(layer).__mro__ if cls.__name__ == self.decoder_layer_class]
            if not match:
                raise ValueError(
                    f"adapter '{self.model_type}' declares decoder layers '{self.decoder_layer_class}', "
                    f"{type(model).__name__} has {type(layer).__name__}"
                )
            found.add(match[0])
        if len(found) != 1:
            raise ValueError(f"{type(model).__name__} mixes decoder-layer classes {sorted(map(str, found))}")
        return found.pop()

    def embed_tokens(self, model: nn.Module) -> nn.Embedding:
        """The (frozen) input embedding the drafter shares."""
        return getattr(self.base_model(model), self.embed_attr)

    def lm_head(self, model: nn.Module) -> nn.Linear:
        """The (frozen) output projection that turns final hidden states into target logits."""
        return getattr(model, self.lm_head_attr)

    def final_norm(self, model: nn.Module) -> nn.Module:
        """The norm applied to the last decoder layer's output before `lm_head`."""
        return getattr(self.base_model(model), self.final_norm_attr)

    def ignored_on_load(self, key: str) -> bool:
        """Whether checkpoint key `key` is expected to be unused when loading this family."""
        return any(re.match(pattern, key) for pattern in self.keys_to_ignore_on_load)

    def chat_format(self, tokenizer: Any) -> ChatFormat:
        """The declared chat format that matches `tokenizer`'s template (or vocabulary)."""
        return resolve_chat_format(tokenizer, self.chat_formats)

    def build_example(
        self,
        tokenizer: Any,
        messages: Sequence[Mapping[str, Any]],
        max_length: int,
        system_prompt: str | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Tokenise a conversation with the target's chat template and mark the supervised assistant tokens.

        See `eagle3_zoo.chat.formats.build_chat_example` (same arguments, returns ``input_ids`` and ``loss_mask``).
        """
        fmt = self.chat_format(tokenizer)
        return build_chat_example(tokenizer, messages, max_length, fmt, system_prompt=system_prompt,
                                  template_kwargs=template_kwargs, tools=tools)

    def forward_features(
        self,
        model: nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        layer_ids: Sequence[int] | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """Run the base model once and return the EAGLE-3 target features.

        Call under ``torch.no_grad()``/``torch.inference_mode()`` for a frozen target.

        Args:
            model: The target (``*ForCausalLM`` or base model).
            input_ids: ``[B, T]`` token ids (the new tokens when a KV cache is passed).
            attention_mask: 2D padding mask ``[B, past + T]`` or a 4D float mask ``[B, 1, T, past + T]``.
            layer_ids: Aux layers (internal convention); default ``aux_layer_ids(N)``.
            **kwargs: Passed to the base model (``position_ids``, ``past_key_values``/``cache``, ``use_cache``...).

        Returns:
            ``(aux_hidden [B, T, 3H], final_hidden [B, T, H] post-norm, base-model outputs incl. the cache)``.
        """
        from eagle3_zoo.adapters.capture import cache_kwargs, capture_aux_hidden

        base = self.base_model(model)
        kwargs = cache_kwargs(base, kwargs)
        with capture_aux_hidden(model, self, layer_ids) as capture:
            outputs = base(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        return capture.aux_hidden, outputs.last_hidden_state, outputs


_REGISTRY: dict[str, type[TargetAdapter]] = {}
_A = TypeVar("_A", bound=type[TargetAdapter])


def register_adapter(model_type: str) -> Callable[[_A], _A]:
    """Class decorator registering a `TargetAdapter` subclass for HF ``config.model_type == model_type``.

    Raises:
        ValueError: if another class is already registered for `model_type`.
    """

    def decorate(cls: _A) -> _A:
        known = _REGISTRY.get(model_type)
        if known is not None and known.__qualname__ != cls.__qualname__:
            raise ValueError(f"model_type '{model_type}' is already registered by {known.__qualname__}")
        cls.model_type = model_type
        _REGISTRY[model_type] = cls
        return cls

    return decorate


def available_adapters() -> list[str]:
    """Registered model types, sorted."""
    return sorted(_REGISTRY)


def get_adapter(model_type: str) -> TargetAdapter:
    """The adapter registered for `model_type`.

    Raises:
        UnknownAdapterError: naming the known families and how to add one.
    """
    cls = _REGISTRY.get(model_type)
    if cls is None:
        raise UnknownAdapterError(
            f"unknown target model_type '{model_type}'; available: {', '.join(available_adapters()) or 'none'}. "
            f"To add a family: (1) write eagle3_zoo/adapters/<family>.py with a TargetAdapter subclass decorated "
            f"@register_adapter('{model_type}') (declare decoder_layer_class, chat_format_names, tiny_config_fields; "
            f"modules in eagle3_zoo/adapters/ are discovered automatically), (2) its chat format as "
            f"eagle3_zoo/resources/chat_formats/<format>.jinja + .yaml, (3) a recipe in recipes/; the family-wide "
            f"tests pick it up from the registry. See docs/contributing/adding-a-family.md"
        )
    return cls()


def adapter_for(model_or_config: Any) -> TargetAdapter:
    """The adapter for a model, a config, or a config dict (reads ``model_type``)."""
    config = getattr(model_or_config, "config", model_or_config)
    model_type = config.get("model_type") if isinstance(config, Mapping) else getattr(config, "model_type", None)
    if not model_type:
        raise UnknownAdapterError(f"{type(model_or_config).__name__} has no model_type to select an adapter by")
    text = config.get("text_config") if isinstance(config, Mapping) else getattr(config, "text_config", None)
    text_type = text.get("model_type") if isinstance(text, Mapping) else getattr(text, "model_type", None)
    if model_type not in _REGISTRY and text_type in _REGISTRY:
        raise UnknownAdapterError(
            f"target model_type '{model_type}' is a multimodal wrapper around a '{text_type}' text model; "
            f"eagle3-zoo trains drafters for text-only targets: use a text-only checkpoint of the family (config "
            f"model_type '{text_type}'), or save the wrapper's language model alone as one")
    return get_adapter(model_type)
