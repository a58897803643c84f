"""What a model's files say, read from this machine only: a local folder, or a model name
already in the local Hugging Face cache. Nothing here reaches the network.

The worker reads them to describe the model it serves in its registry entry; the API reads
them to find a tokenizer it can count prompts with.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# The config keys vLLM derives a model's context length from (the smallest one present).
_CONTEXT_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "model_max_length",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)
# A folder holds a tokenizer when it has one of these.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def local_folder(source: str | None) -> Path | None:
    """The folder `source` names on this machine: itself when it is a folder, else the
    snapshot of a model name in the local Hugging Face cache (never downloaded); None
    when neither is here."""
    if not source:
        return None
    path = Path(source)
    if path.is_dir():
        return path
    if path.is_absolute() or source.startswith((".", "~")) or source.count("/") > 1:
        return None  # a path that is not on this machine, not a model name
    from huggingface_hub import try_to_load_from_cache

    for name in ("config.json", *_TOKENIZER_FILES):
        try:
            found = try_to_load_from_cache(source, name)
        except Exception:  # noqa: BLE001 - not a valid model name: not here
            return None
        if isinstance(found, str):
            return Path(found).parent
    return None


def has_tokenizer(folder: Path) -> bool:
    return any((folder / name).is_file() for name in _TOKENIZER_FILES)


def read_config(folder: Path | None) -> dict[str, Any] | None:
    """The folder's config.json, or None when it has none (or it is not JSON)."""
    if folder is None or not (folder / "config.json").is_file():
        return None
    try:
        data = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def context_length(config: dict[str, Any] | None) -> int | None:
    """The context length in tokens a model's config gives, as vLLM derives it."""
    for section in (config or {}, (config or {}).get("text_config") or {}):
        found = [int(v) for k in _CONTEXT_KEYS if isinstance(v := section.get(k), int) and v > 0]
        if found:
            return min(found)
    return None


def vocab_size(config: dict[str, Any] | None) -> int | None:
    """The vocabulary size (the logits' width, what vLLM checks token ids against)."""
    if not config:
        return None
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    return int(size) if isinstance(size, int) and size > 0 else None
