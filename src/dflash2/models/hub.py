"""Hugging Face repository ids (``org/name``) as models: the snapshot in huggingface_hub's local cache.

Nothing is downloaded (this engine runs where the Hub may be out of reach): a repository already in the cache
(``$HF_HUB_CACHE``, default ``~/.cache/huggingface/hub``, filled by ``huggingface-cli download`` or transformers)
loads like a local directory; one that is not gives a one-line error naming the ways that work offline.
"""

from __future__ import annotations

import re
from pathlib import Path

from dflash2.models.chunks import ModelStoreError

REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")


def is_repo_id(ref: str) -> bool:
    """``org/name`` that is no existing path (a local directory of that name wins)."""
    return REPO_ID.fullmatch(ref) is not None and not Path(ref).expanduser().exists()


def cached_snapshot(repo_id: str) -> Path:
    """The directory of ``repo_id``'s cached snapshot (its ``main`` revision) holding config.json and safetensors."""
    from huggingface_hub import constants, snapshot_download

    try:
        path = Path(snapshot_download(repo_id, local_files_only=True))
    except Exception as error:  # noqa: BLE001 - huggingface_hub raises several kinds for "not in the cache"
        raise ModelStoreError(
            f"{repo_id} is not in the local Hugging Face cache ({constants.HF_HUB_CACHE}; {type(error).__name__}) "
            f"and dflash2 does not download from the Hub: run `huggingface-cli download {repo_id}` where the Hub is "
            "reachable and copy the cache here, or pass --model a local directory (config.json + *.safetensors) "
            "or a .gguf file") from None
    if not ((path / "config.json").is_file() and any(path.glob("*.safetensors"))):
        raise ModelStoreError(f"the cached snapshot of {repo_id} ({path}) has no config.json and *.safetensors; "
                              "download those files too, or pass a local directory or a .gguf file")
    return path
