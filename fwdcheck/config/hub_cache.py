"""A Hugging Face hub id (`meta-llama/Llama-3.2-1B`) read from the local hub cache, never downloaded.

The cache is where huggingface_hub puts it: $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub (XDG's
cache home when set). A model there is `models--{org}--{name}/snapshots/{commit}/`, its files links into `blobs/`;
`refs/main` names the commit the last download of the main branch fetched. Torch-free: a config is read with it.
"""

from __future__ import annotations

import os
import re
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")  # org/name, as the hub spells repository ids


class NotCached(Exception):
    """The hub id is not in the local cache (or only partly: no snapshot holds its config.json)."""


def looks_like_hub_id(text: str) -> bool:
    return bool(HUB_ID.fullmatch(text)) and ".." not in text


def fetch_command(hub_id: str) -> str:
    """The command that downloads `hub_id` with the installed huggingface_hub: `hf download` since 0.34 (the
    version transformers 5 requires), `huggingface-cli download` before, which later releases no longer install."""
    try:
        release = tuple(int(part) for part in re.findall(r"\d+", version("huggingface_hub"))[:2])
    except PackageNotFoundError:
        release = (1, 0)  # not installed: the `[hf]` extra installs a current one
    return f"hf download {hub_id}" if release >= (0, 34) else f"huggingface-cli download {hub_id}"


def hub_cache() -> Path:
    """The hub cache directory huggingface_hub would use, from the same environment variables."""
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(variable):
            return Path(os.environ[variable]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    cache_home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser()
    return cache_home / "huggingface" / "hub"


def cached_snapshot(hub_id: str) -> Path:
    """The snapshot directory of `hub_id` in the cache: the commit refs/main names, else the only snapshot there,
    else the most recent one holding a config.json. NotCached, saying why, when there is none."""
    repository = hub_cache() / f"models--{hub_id.replace('/', '--')}"
    snapshots = repository / "snapshots"
    if not snapshots.is_dir():
        raise NotCached(f"not in the Hugging Face cache ({hub_cache()})")
    main = repository / "refs" / "main"
    if main.is_file():
        snapshot = snapshots / main.read_text(encoding="utf-8").strip()
        if (snapshot / "config.json").is_file():
            return snapshot
    complete = [s for s in snapshots.iterdir() if (s / "config.json").is_file()]
    if not complete:
        raise NotCached(f"in the Hugging Face cache ({hub_cache()}) without a config.json")
    return max(complete, key=lambda s: s.stat().st_mtime)
