"""Tiny tokenizers for tests: byte-level BPE (like Llama-3, Qwen-2.5 and DeepSeek-V3) with a family's special tokens
and its real chat template, trained in about a second with no download.

Their ids fit the adapters' `tiny_config()` vocabulary (512), so a tiny model and its tokenizer make a complete,
offline target for data and training tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

TINY_VOCAB_SIZE = 512

# Enough text for a few hundred merges over the words tests use; any other text still encodes via the byte alphabet.
_CORPUS = (
    "You are a helpful assistant. What is the capital of France? The capital of France is Paris.",
    "And of Italy? Rome, of course. Thanks! Say goodbye in French. Au revoir! Hello, how are you today?",
    "system user assistant tool The quick brown fox jumps over the lazy dog. 0123456789",
    "Explain speculative decoding in one sentence. A small draft model proposes tokens that the target verifies.",
)


@dataclass(frozen=True)
class TinyTokenizerSpec:
    """The special tokens a family's tokenizer defines (declared by each adapter).

    Attributes:
        special_tokens: Atomic tokens of the chat format (headers, turn markers, BOS/EOS).
        eos_token: End-of-sequence token.
        bos_token: Beginning-of-sequence token, if the family uses one.
        pad_token: Padding token, if the family defines one.
    """

    special_tokens: tuple[str, ...]
    eos_token: str
    bos_token: str | None = None
    pad_token: str | None = None


def build_tiny_tokenizer(
    spec: TinyTokenizerSpec, chat_template: str, vocab_size: int = TINY_VOCAB_SIZE
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer with `spec`'s special tokens and attach `chat_template`.

    Args:
        spec: The family's special tokens.
        chat_template: The family's real Jinja chat template.
        vocab_size: Total vocabulary (byte alphabet + specials + merges).

    Returns:
        A fast tokenizer (character offsets supported), deterministic for a given spec.
    """
    # here, not at the top: the adapter registry imports this module, and recipe validation must not pay for them
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(spec.special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=spec.bos_token,
        eos_token=spec.eos_token,
        pad_token=spec.pad_token,
        chat_template=chat_template,
    )
