"""Where converted models are kept between runs."""

import os
from pathlib import Path


def cache_root() -> Path:
    """``$BLOCKSPEC_CACHE`` if set, else ``~/.cache/blockspec``; conversions are done once per file."""
    env = os.environ.get("BLOCKSPEC_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "blockspec"
