"""The cache keys of the data stage (`eagle3_zoo.data.cache_keys`) keep the digests they had before they shared one
helper and one version table: every cache already on disk (regenerated answers, tokens, draft-vocab counts,
feature stores) keeps matching. The digests below were computed by the code that wrote each key on its own."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from eagle3_zoo.data import cache_keys, prepare, vocab_cache
from eagle3_zoo.data.feature_job import features_dir_for
from eagle3_zoo.data.readers import Conversation


class _Tokenizer:  # no fast backend: fingerprinted by its vocabulary, template and special tokens
    chat_template = "{{ messages }}"
    special_tokens_map = {"eos_token": "</s>"}

    def get_vocab(self):
        return {"a": 0, "\u00e9": 1, "</s>": 2}


@pytest.fixture
def recipe(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the source's key is its path as the recipe writes it
    (tmp_path / "chat.jsonl").write_text('{"conversations": [{"from": "human", "value": "Caf\u00e9?"}, '
                                         '{"from": "gpt", "value": "Oui."}]}\n')
    regen = NS(enabled=True, max_new_tokens=16, temperature=0.0, max_turns=None)
    data = NS(sources=[NS(path="chat.jsonl", format="auto", max_samples=None, split=None)], max_length=512,
              overflow="truncate", max_samples=None, on_error="raise", val_fraction=0.1, seed=0,
              chat_template_kwargs={"enable_thinking": False}, regenerate=regen, features_dir=None,
              cache_dir="cache", features_dtype="bfloat16", features_shard_size=256)
    return NS(data=data, target=NS(dtype="bfloat16", lora_path=None))


def test_cache_keys_keep_their_digests(recipe):
    tok = _Tokenizer()
    conv = Conversation(id="c0", source="/abs/chat.jsonl", index=0, source_key="chat.jsonl",
                        messages=[{"role": "user", "content": "Caf\u00e9?"}, {"role": "assistant", "content": "Oui."}])
    assert vocab_cache.tokenizer_fingerprint(tok) == "d87ed62cf4e5223d3a2b811e5e0faab2b1588803228c0d5ff73ced14be091052"
    assert vocab_cache.fingerprint_sources(recipe.data.sources, {"x": "\u00e9"}) == (
        "9dfe740090f5e9464ee5a58d1e3f5cb2b0e3050b5428bf228013402c09661667")
    assert prepare.answers_digest([conv]) == "9534b11d6742ddd031d0feb5cb6287c619749a714c186315b50052338aa05994"
    assert prepare.data_fingerprint(recipe.data, tok, "tiny", "digest") == (
        "70900471c840cee6d805a81b903a5e537942d80bf8040a204ee9f51aee2831d8")
    assert prepare.regeneration_key(recipe.data, tok, "tiny") == (
        "996fabe076818b838e96e70341437e96cc5af8759fa63ca864e94c3a320508b4")
    assert vocab_cache.vocab_cache_key("f" * 64, "t" * 64, 32000) == (
        "f1e219cfe903c2936c5d8e72f527ffa2cd2838f9e93ff952b569dfd35d786ac5")
    assert features_dir_for(recipe.data, recipe.target, "f" * 64, "tiny", (1, 2, 3)).name == "62e2b45de23552ad"


def test_every_key_version_is_in_the_table(recipe, monkeypatch):
    """Bumping a version in the one table changes the keys of that kind, and only those."""
    tok = _Tokenizer()
    before = (prepare.data_fingerprint(recipe.data, tok, "tiny", "digest"),
              prepare.regeneration_key(recipe.data, tok, "tiny"),
              vocab_cache.vocab_cache_key("f" * 64, "t" * 64, 32000),
              features_dir_for(recipe.data, recipe.target, "f" * 64, "tiny", (1, 2, 3)).name)
    for i, kind in enumerate(("token_stream", "regeneration", "draft_vocab_counts", "features")):
        with monkeypatch.context() as m:
            m.setitem(cache_keys.KEY_VERSIONS, kind, f"{cache_keys.KEY_VERSIONS[kind]}-bumped")
            after = (prepare.data_fingerprint(recipe.data, tok, "tiny", "digest"),
                     prepare.regeneration_key(recipe.data, tok, "tiny"),
                     vocab_cache.vocab_cache_key("f" * 64, "t" * 64, 32000),
                     features_dir_for(recipe.data, recipe.target, "f" * 64, "tiny", (1, 2, 3)).name)
        assert [a != b for a, b in zip(after, before)] == [j == i for j in range(4)], kind
