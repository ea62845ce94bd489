"""files.py -- the files every script writes, written whole, and JSON.

`atomic_write` writes a file so that a crash or power loss leaves the old file or the new one, never a torn one
(checkpoints, grids, loss.png); JSON goes through `read_json` / `write_json`, and log.jsonl's lines through
`append_json` (strict JSON: NaN and inf become null).
"""
import contextlib
import json
import math
import os
import pathlib


def atomic_write(path, write, keep=None):
    """write(f) into path.tmp, fsync it, then rename it over `path` (first moving the old file to `keep`, if
    given): a crash or power loss leaves the old file or the new one, never a torn or empty one."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before a name points at them
        if keep and os.path.exists(path):
            os.replace(path, keep)
        os.replace(tmp, path)
        fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
        try:
            os.fsync(fd)  # and so are the renames
        finally:
            os.close(fd)
    finally:  # on any error no .tmp is left behind, and the error goes on
        with contextlib.suppress(OSError):
            os.remove(tmp)


def read_text(path):
    """A file's text; None where there is no such file."""
    return pathlib.Path(path).read_text() if os.path.exists(path) else None


def read_json(path):
    """A JSON file's value; None where there is no such file."""
    return None if (text := read_text(path)) is None else json.loads(text)


def write_json(path, value):
    """value -> path as JSON (indent 1: readable, diffable)."""
    with open(path, "w") as f:
        json.dump(value, f, indent=1)


def append_json(f, rec):
    """One JSON line to an open file (log.jsonl), flushed; NaN and inf become null, since bare NaN is not JSON."""
    def finite(x):
        if isinstance(x, float):
            return x if math.isfinite(x) else None
        if isinstance(x, dict):
            return {k: finite(v) for k, v in x.items()}
        return [finite(v) for v in x] if isinstance(x, (list, tuple)) else x
    if f:
        f.write(json.dumps(finite(rec), allow_nan=False) + "\n")
        f.flush()
