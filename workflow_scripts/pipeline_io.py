"""Small helpers shared by the workflow scripts: one-line errors, atomic writes, hashing."""

import contextlib
import functools
import hashlib
import json
import logging
import os
import sys
import tempfile
from pathlib import Path


class UserError(Exception):
    """A problem with the user's input or config: printed as one line, no traceback."""


def cli(main):
    """Run ``main`` so that a UserError ends the process with one line and exit code 2."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
        try:
            return main(*args, **kwargs)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)

    return wrapper


@contextlib.contextmanager
def atomic_path(path):
    """Yield a temporary path beside ``path``; rename it onto ``path`` only on success."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def write_json(path, obj) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def file_sha256(path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def json_object(text: str) -> dict:
    """argparse type of --template-kwargs: a JSON object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"--template-kwargs: not JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise UserError(f"--template-kwargs: a JSON object is needed, not {text!r}")
    return value
