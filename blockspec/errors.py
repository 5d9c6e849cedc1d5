"""User-facing errors: each carries one line that names the problem and the fix.

The CLI and the server print these messages as they are (no traceback); anything else is a bug.
"""


class BlockspecError(Exception):
    """Base class for errors whose message is meant for the user."""


class ConfigError(BlockspecError):
    """A flag, config file or checkpoint configuration that cannot work."""


class OutOfMemoryError(BlockspecError):
    """The model plus the minimum KV cache does not fit in the memory we may use."""


class RequestError(BlockspecError):
    """A request the engine refuses (too long, bad sampling parameters); `param` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
