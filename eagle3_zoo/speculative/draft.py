"""The drafter side of speculative decoding: the generator talks to a drafter only through `DraftModel`, so anything
that proposes tokens (a registered drafter kind's draft model, an oracle built in a test) plugs in.

The protocol is declared with the drafter kinds (`eagle3_zoo.drafters.base`), which each give theirs
(`DrafterKind.draft_model`); EAGLE-3's is in `eagle3_zoo.drafters.eagle3.decode`.
"""

from __future__ import annotations

from eagle3_zoo.drafters import DraftModel

__all__ = ["DraftModel"]
