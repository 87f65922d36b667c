"""The one error type of the merge core."""

from __future__ import annotations


class MergeError(ValueError):
    """Bad merge input (base checkpoint, adapter, box, dtype): the message names the key and the fix.

    Raised before anything is written: ``merge_checkpoint`` validates everything before it opens
    the output directory.
    """
