"""The two words every part of tierzero.config speaks: the error a bad config raises, and the warning for an ignored key."""

from __future__ import annotations


class TierZeroConfigWarning(UserWarning):
    """A config key was ignored, e.g. a DeepSpeed key with no tierzero equivalent."""


class ConfigError(ValueError):
    """A config the engine cannot run. The message is one line: key, value, what is allowed, the fix.

    `key` is the dotted tierzero key at fault (None when the fault is not one key's), so a
    caller can put the message in its own words, e.g. name the DeepSpeed key it came from.
    """

    def __init__(self, message: str, *, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key
