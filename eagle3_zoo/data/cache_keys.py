"""Every cache key of the data stage: one JSON -> sha256 helper and one table of key versions.

A key is the sha256 hex digest of a JSON document (sorted keys) holding what the cached result depends on. The
digests are part of the caches on disk (file and directory names, metadata), so the JSON encoding of each kind of
key is fixed: `KEY_ENCODINGS` keeps the encoding each key has always been written with (whether non-ASCII text is
escaped, whether values JSON cannot hold are written as their `str`), and changing either, or a version, changes
every key of that kind.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

KEY_VERSIONS: dict[str, Any] = {
    # The token stream (token cache, draft-vocab counts, features): bump it when a change to reading or tokenisation
    # rules changes the examples a recipe produces, so caches built by older code stop matching instead of being
    # reused silently. 2: location-independent source keys and conversation uids. 3: conversations whose first user
    # turn is blank are skipped (`empty_user_turn`). (Regenerated data keyed by the answers' content,
    # `answers_digest`, changed only the keys of regenerated data, by construction, so it needed no bump.) 4: tool
    # turns, reasoning and tool calls are read, and masks follow templates that rewrite earlier turns (Qwen3,
    # gpt-oss). 5: records' tool definitions reach the template; Llama-3.1, Qwen-2.5 tool turns supervised;
    # unrenderable tool calls are skipped.
    "token_stream": 5,
    # The regenerated answers (a per-conversation cache, `eagle3_zoo.data.prepare.regeneration_key`): bump it only
    # when a change alters the answer the target gives to one conversation, not which conversations are read.
    # 3: answers keep the target's reasoning; turns with tool calls are kept as recorded. 4: prompts carry the
    # records' tool definitions.
    "regeneration": 4,
    # The draft-vocab token counts (`eagle3_zoo.data.vocab_cache.vocab_cache_key`): bump when the counting rules
    # change.
    "draft_vocab_counts": 1,
    # The feature store's directory (`eagle3_zoo.data.feature_job.features_dir_for`): its layout ("parts": one store
    # per part of whole batches, merged by a top-level manifest).
    "features": "parts",
}

# kind -> (ensure_ascii, values JSON cannot hold written as their str): how each kind has always been encoded
KEY_ENCODINGS: dict[str, tuple[bool, bool]] = {
    "token_stream": (True, True),  # also the answers digest (`answers_digest`)
    "regeneration": (True, True),
    "answers": (True, True),
    "draft_vocab_counts": (False, False),  # also the source and tokenizer fingerprints
    "fingerprint": (False, False),
    "features": (True, False),
}


def key_version(kind: str) -> Any:
    """The version of the keys of `kind` (`KEY_VERSIONS`)."""
    return KEY_VERSIONS[kind]


def json_sha256(obj: Any, kind: str) -> str:
    """sha256 hex digest of `obj` as sorted-key JSON, encoded as keys of `kind` always were (`KEY_ENCODINGS`)."""
    ensure_ascii, as_str = KEY_ENCODINGS[kind]
    text = json.dumps(obj, sort_keys=True, ensure_ascii=ensure_ascii, default=str if as_str else None)
    return hashlib.sha256(text.encode()).hexdigest()
