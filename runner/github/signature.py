"""`X-Hub-Signature-256`: GitHub's HMAC-SHA256 of the raw body, keyed with the webhook secret."""

from __future__ import annotations

import hashlib
import hmac

PREFIX = "sha256="


def sign(secret: bytes, body: bytes) -> str:
    return PREFIX + hmac.new(secret, body, hashlib.sha256).hexdigest()


def verify(secret: bytes, body: bytes, header: str | None) -> bool:
    """Constant-time check of the header against the body; a missing or malformed header fails.

    Only `sha256=` is accepted: the legacy SHA-1 `X-Hub-Signature` is not a substitute.
    """
    if not header or not secret:
        return False
    return hmac.compare_digest(sign(secret, body).encode(), header.encode("utf-8", "replace"))
