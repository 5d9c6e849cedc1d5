"""The one exception type the loader raises.

Every way a model can fail to load (a missing file, a corrupt shard, an unsupported GGUF) ends in
``ModelLoadError`` with a single line that names the problem and the fix, so the CLI and the server
print it as is instead of a traceback (it is a ``BlockspecError``, the user-facing family).
"""

from blockspec.errors import BlockspecError


class ModelLoadError(BlockspecError):
    """A model, its weights or its tokenizer could not be loaded; the message says what to do."""
