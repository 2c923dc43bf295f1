"""The limits pydatacopy holds arguments and settings to (the core's, exported by _C, and the
language's): only _C imported, so that the argument checks (_torch_utils) and the settings
(runtime/settings.py) both take them from here."""

from __future__ import annotations

from . import _C

INT32_MAX = 2**31 - 1
SIZE_MAX = 2**64 - 1
#: The longest timeout pydatacopy takes, in seconds (about 31 years): the core counts nanoseconds
#: in 64 bits.
MAX_TIMEOUT_S = _C.MAX_TIMEOUT_S
MAX_CHUNK_BYTES = _C.MAX_CHUNK_BYTES
MAX_SEND_BLOCKS = _C.MAX_SEND_BLOCKS  # one thread block per slice of a chunk
