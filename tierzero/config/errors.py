"""The two words every part of tierzero.config speaks: the error a bad config raises, and the warning for an ignored key."""

from __future__ import annotations

_LINE_BREAKS = {ord(c): repr(c)[1:-1] for c in "\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029"}
"""Every character str.splitlines() breaks at -> its escape, so user text cannot add a line."""


def one_line(text: str) -> str:
    """`text` with its line breaks escaped (a newline becomes the two characters \\n)."""
    return text.translate(_LINE_BREAKS)


class TierZeroConfigWarning(UserWarning):
    """A config key was ignored (e.g. a DeepSpeed key with no tierzero equivalent), or this machine serves
    it poorly (bf16 on a CPU without bf16 instructions). The `tierzero` command prints each as one
    `tierzero: warning: ...` line."""


class ConfigError(ValueError):
    """A config the engine cannot run. The message is one line: key, value, what is allowed, the fix.

    `key` is the dotted tierzero key at fault (None when the fault is not one key's), so a
    caller can put the message in its own words, e.g. name the DeepSpeed key it came from.
    Line breaks in the message (from a key, a path or a value the user wrote) are escaped.
    """

    def __init__(self, message: str, *, key: str | None = None) -> None:
        super().__init__(one_line(message))
        self.key = key
