"""Making local files durable: fsync of a file and of the directory that names it.

A rename is atomic but not durable until the directory is fsynced; a file's data is
not durable until the file is. Used by checkpoint storage and by file sinks.
"""

from __future__ import annotations

import os

__all__ = ["fsync_file", "fsync_dir"]


def fsync_file(path: str) -> None:
    """Flush a file's data to disk (raises if the file cannot be opened)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    """Flush a directory's entries (renames, new files) to disk, where the filesystem
    allows it; some refuse fsync on a directory, which is not an error."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
