"""Where burstgate keeps what it builds once per machine (compiled CPU kernels, tokenizers rebuilt from GGUF
metadata): ``$BURSTGATE_CACHE_DIR``, else ``$XDG_CACHE_HOME/burstgate``, else ``~/.cache/burstgate``."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """The cache folder (not created here)."""
    if env := os.environ.get("BURSTGATE_CACHE_DIR"):
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "burstgate"
