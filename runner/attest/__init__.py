"""Signed job records: an in-toto Statement v1 in a DSSE envelope, signed with the service's Ed25519 key.

- `dsse.py`: the envelope and its pre-authentication encoding (PAE), signing and checking one, reading
  an in-toto bundle (`.intoto.jsonl`: envelopes a line, other tools' lines among them).
- `keys.py`: the service's key pair, made on first start, its private half readable by the service only;
  its keyid, the OpenSSH fingerprint other DSSE verifiers derive.
- `statement.py`: the Statement (subjects: the artifacts by sha256, or the job itself) and the job
  predicate, with this project's predicate type.
- `verify.py`: what `microvm-check verify` checks: our record among the bundle's lines by type and key,
  its signature, then each artifact's digest.

Depends on nothing of the runner but its errors and `cryptography`, so a verifier needs no service.
"""
