"""Files written whole or not at all: a reader (or a crash) never sees half a file."""

from __future__ import annotations

import os
from collections.abc import Callable


def _fsync_file(path: str) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def replace_atomically(path: str, write: Callable[[str], None]) -> None:
    """``write(temporary)`` into a temporary name in the same directory, flush it to disk, then rename it over
    ``path`` (atomic on POSIX): ``path`` is the old file or the new one, never a part of it. The temporary file is
    removed if ``write`` fails."""
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    temporary = f"{path}.tmp-{os.getpid()}"
    try:
        write(temporary)
        _fsync_file(temporary)  # on disk before the rename makes it visible
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


def write_text_atomically(path: str, text: str) -> None:
    """``path`` holds ``text``, written atomically (see ``replace_atomically``)."""

    def write(temporary: str) -> None:
        with open(temporary, "w") as handle:
            handle.write(text)

    replace_atomically(path, write)
