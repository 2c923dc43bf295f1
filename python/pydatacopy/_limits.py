"""The limits pydatacopy holds arguments and settings to (the core's, and its own): no imports, so
that the argument checks (_torch_utils) and the settings (runtime/settings.py) both take them from
here."""

from __future__ import annotations

INT32_MAX = 2**31 - 1
SIZE_MAX = 2**64 - 1
#: The longest timeout pydatacopy takes, in seconds (about 31 years): the core counts nanoseconds
#: in 64 bits.
MAX_TIMEOUT_S = 1e9
MAX_CHUNK_BYTES = 1 << 40
MAX_SEND_BLOCKS = 1024  # the core's limit (one thread block per slice of a chunk)
