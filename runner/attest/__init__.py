"""Signed job records: an in-toto Statement v1 in a DSSE envelope, signed with the service's Ed25519 key.

- `dsse.py`: the envelope and its pre-authentication encoding (PAE), signing and checking one.
- `keys.py`: the service's key pair, made on first start, its private half readable by the service only.
- `statement.py`: the Statement (subjects: the artifacts by sha256) and the job predicate.
- `verify.py`: what `microvm-check verify` checks: the signature, then each artifact's digest.

Depends on nothing of the runner but its errors and `cryptography`, so a verifier needs no service.
"""
