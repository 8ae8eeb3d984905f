"""Signed URLs: a path of this API that answers without a key until it expires, for clients that fetch with no
credentials (the tinker CLI's ``checkpoint download`` reads each file of an export with plain ``urllib``).

A signature is an HMAC-SHA256 (RFC 2104) of the path, the expiry and what the caller binds it to (the object's
identity, so that an object deleted and made again under the same name is not reached by the old URLs), keyed with
a random key that the API keeps in the artifacts folder: every API process sharing that folder signs and checks
alike, and nothing outside the service's user can read it.
"""

import hashlib
import hmac
import os
import secrets
from functools import lru_cache
from pathlib import Path

KEY_FILE = Path("secrets") / "url-signing-key"
"""Where the signing key lives, under the artifacts folder (made on first use, owner-only)."""
TTL_S = 3600
"""How long a signed URL answers: the tinker CLI asks for new ones when fewer than 5 minutes are left."""


@lru_cache
def signing_key(artifacts: Path) -> bytes:
    """The key of ``artifacts``, made (32 random bytes, mode 0600) by the first process that needs it: written
    aside and linked into place, so that processes starting together all read the one that won."""
    path = artifacts / KEY_FILE
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        aside = path.with_name(f".{path.name}.{secrets.token_hex(8)}")
        descriptor = os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "wb") as file:
            file.write(secrets.token_bytes(32))
            file.flush()
            os.fsync(file.fileno())
        try:
            os.link(aside, path)
        except FileExistsError:
            pass
        finally:
            aside.unlink()
    key = path.read_bytes()
    if len(key) < 32:
        raise RuntimeError(f"the URL signing key {path} is damaged: delete it (signed URLs given so far stop working)")
    return key


def signature(key: bytes, path: str, expires: int, bound_to: str) -> str:
    message = f"{path}\n{expires}\n{bound_to}".encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def is_valid(key: bytes, path: str, expires: int, bound_to: str, given: str, now: float) -> bool:
    """Whether ``given`` signs ``path`` until ``expires`` (unix seconds, not passed at ``now``) for ``bound_to``;
    compared in constant time."""
    return now < expires and hmac.compare_digest(signature(key, path, expires, bound_to), given)
