"""DSSE (Dead Simple Signing Envelope) v1: sign PAE(payloadType, payload), never the JSON around it.

    PAE(type, body) = "DSSEv1" SP LEN(type) SP type SP LEN(body) SP body

LEN is the ASCII decimal byte length. Binding the type into what is signed stops a signed payload of
one type from being passed off as another; signing bytes (not parsed JSON) needs no canonical form.
The envelope is the spec's JSON object: base64 payload, payloadType, signatures [{keyid, sig}].

A `.intoto.jsonl` file is an in-toto bundle: any number of lines, each meant to be an envelope, which
other tools may have appended or prepended. `bundle` reads it as the bundle spec says a consumer must:
lines it does not recognise are skipped, and nothing depends on their order; which envelope is ours is
for the verifier to decide (runner/attest/verify.py: by type and key).
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from runner.errors import AttestationError

MAX_ENVELOPE_BYTES = 8 * 1024 * 1024


class EnvelopeError(AttestationError):
    """An envelope that is not well formed, or whose signature does not verify with the key given."""


def pae(payload_type: str, payload: bytes) -> bytes:
    """The pre-authentication encoding DSSE signs."""
    kind = payload_type.encode()
    return b"DSSEv1 %d %s %d %s" % (len(kind), kind, len(payload), payload)


@dataclass(frozen=True)
class Envelope:
    payload_type: str
    payload: bytes
    signatures: tuple[tuple[str, bytes], ...]  # (keyid, signature)

    def to_json(self) -> dict[str, object]:
        return {"payloadType": self.payload_type, "payload": base64.b64encode(self.payload).decode(),
                "signatures": [{"keyid": keyid, "sig": base64.b64encode(sig).decode()} for keyid, sig in self.signatures]}

    def line(self) -> bytes:
        """One line of a `.intoto.jsonl` file (the in-toto bundle format: an envelope per line)."""
        return json.dumps(self.to_json(), separators=(",", ":")).encode() + b"\n"

    def verify(self, key: Ed25519PublicKey) -> bytes:
        """The payload, when one signature verifies with `key`; keyids are hints only (DSSE says so)."""
        message = pae(self.payload_type, self.payload)
        for _keyid, sig in self.signatures:
            try:
                key.verify(sig, message)
                return self.payload
            except InvalidSignature:
                continue
        raise EnvelopeError("the signature does not verify with this key: the record was changed after it was "
                            "signed, or another key signed it")


def sign(payload_type: str, payload: bytes, key: Ed25519PrivateKey, keyid: str) -> Envelope:
    return Envelope(payload_type, payload, ((keyid, key.sign(pae(payload_type, payload))),))


def bundle(data: bytes) -> list[Envelope]:
    """Every well-formed envelope among the lines of a `.intoto.jsonl` bundle, in file order; lines that
    are not one (blank, not JSON, not a DSSE envelope) are skipped, as the bundle spec requires."""
    if len(data) > MAX_ENVELOPE_BYTES:
        raise EnvelopeError(f"{len(data)} bytes, over the {MAX_ENVELOPE_BYTES}-byte limit for a bundle")
    found = []
    for line in data.split(b"\n"):
        try:
            found.append(parse(line))
        except EnvelopeError:
            continue
    return found


def parse(line: bytes) -> Envelope:
    """One envelope: a bundle's line, or a bare JSON envelope; EnvelopeError if it is not one."""
    if len(line) > MAX_ENVELOPE_BYTES:
        raise EnvelopeError(f"{len(line)} bytes, over the {MAX_ENVELOPE_BYTES}-byte limit for an envelope")
    try:
        obj = json.loads(line)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError; RecursionError: deep nesting
        raise EnvelopeError(f"not a JSON envelope: {str(exc)[:200]}") from None
    if not isinstance(obj, dict):
        raise EnvelopeError("not a JSON envelope: expected an object")
    payload_type, payload, signatures = obj.get("payloadType"), obj.get("payload"), obj.get("signatures")
    if not isinstance(payload_type, str) or not isinstance(payload, str) or not isinstance(signatures, list):
        raise EnvelopeError("not a DSSE envelope: payloadType, payload and signatures are required")
    sigs = []
    for item in signatures:
        if not isinstance(item, dict) or not isinstance(item.get("sig"), str):
            raise EnvelopeError("not a DSSE envelope: each signature needs a sig")
        keyid = item.get("keyid")
        sigs.append((keyid if isinstance(keyid, str) else "", _b64(item["sig"], "sig")))
    return Envelope(payload_type, _b64(payload, "payload"), tuple(sigs))


def _b64(text: str, what: str) -> bytes:
    """Standard or URL-safe base64: DSSE verifiers must accept either."""
    try:
        alphabet = b"-_" if ("-" in text or "_" in text) else None
        return base64.b64decode(text.encode(), altchars=alphabet, validate=True)
    except (binascii.Error, ValueError):
        raise EnvelopeError(f"the envelope's {what} is not base64") from None
