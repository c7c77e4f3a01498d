"""Commands that span layers: each reads the service's config or records and drives a lower layer.

They sit on top of the layers (see the import-linter contracts in pyproject.toml), next to the other
`cli` modules that `runner.cli` registers, so that `policy`, `runner.vm` and `runner.github` never
import the service that is built on them.
"""
