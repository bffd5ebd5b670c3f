"""Files written whole or not at all: a reader (or a crash) never sees half a file."""

from __future__ import annotations

import os


def write_text_atomically(path: str, text: str) -> None:
    """Write to a temporary name in the same directory, then rename over ``path`` (atomic on POSIX)."""
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    temporary = f"{path}.tmp-{os.getpid()}"
    try:
        with open(temporary, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())  # on disk before the rename makes it visible
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)
