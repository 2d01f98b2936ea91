"""Bearer keys of the servers miles_ray runs: every one has a key, and no key is shown by ``ps`` or printed.

A CLI takes its key from an environment variable or a file (``--api-key-file``); without either it makes a
random one and writes it to a file only its user can read, whose path it prints (``cli_key``).
"""

from __future__ import annotations

import hmac
import os
import secrets
import tempfile
from pathlib import Path


def new_key() -> str:
    """A random bearer key: 256 bits as 64 hex digits.

    Hex, not ``token_urlsafe``: a key that begins with ``-`` reads as a flag where a server takes it as an argument
    (SGLang turns its ``--config`` YAML into ``--api-key <key>``, and argparse then fails to start the server).
    """
    return secrets.token_hex(32)


def bearer_matches(authorization: str, key: str) -> bool:
    """Whether an ``Authorization`` header carries ``Bearer <key>`` (constant-time: no timing hint of the key)."""
    return hmac.compare_digest(authorization.encode(), f"Bearer {key}".encode())


def write_private(path: str | os.PathLike, text: str) -> None:
    """Create ``path`` readable by this user only (0600) holding ``text``; an existing file is replaced."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # O_CREAT's mode applies to new files only
    with os.fdopen(fd, "w") as f:
        f.write(text)


def cli_key(given: str | None, path: str | None, prefix: str) -> tuple[str, str]:
    """A server CLI's bearer key and where its user reads it.

    ``path`` if it exists; else ``given`` (from the environment or a flag); else a random key. A key not read from a
    file is written to ``path`` (or to a new private file named ``prefix...``) unless it was given without a path.
    """
    if path and Path(path).exists():
        return Path(path).read_text().strip(), path
    if given and not path:
        return given, "the environment or --api-key"
    key = given or new_key()
    path = path or str(Path(tempfile.mkdtemp(prefix=prefix)) / "api_key")
    write_private(path, key)
    return key, path
