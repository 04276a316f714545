"""User-facing errors. Each carries one line that names the problem and, where possible, the fix.

The CLI prints `error: <message>` for any `MoetideError` and exits with status 2, never a traceback.
"""


class MoetideError(Exception):
    """Base class: a problem with the user's input or environment, reported as one line."""


class CheckpointError(MoetideError):
    """The path is not a usable checkpoint (missing, not a directory, corrupt or truncated shard)."""


class UnsupportedModelError(MoetideError):
    """The checkpoint is a model moetide does not serve (dense, or an unknown MoE family)."""


class TokenizerError(MoetideError):
    """The checkpoint has no usable tokenizer."""


class BudgetError(MoetideError):
    """The GPU memory budget cannot hold what the chosen policy needs."""


class ConfigError(MoetideError, ValueError):
    """A configuration value is out of range; the message says which and what to change."""
