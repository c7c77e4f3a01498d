"""One job's secret bindings at work (docs/secrets.md): what admission decided (`JobSecrets`: the
bindings with their values and fresh placeholders, and where each came from), bound into the job's VM
network before its CA goes in, their uses noted in the log and the record, and the guest's output
masked on its way to the log. The values live in this process's memory only."""

from __future__ import annotations

from dataclasses import dataclass, field

from policy.model import Policy
from runner.jobapi.contract import JobRecord
from runner.net.secretswap import BoundSecret, Masker, SecretSwap
from runner.sandbox.port import SandboxLike, needs_network
from runner.service.jobs.joblog import JobLog

OPERATOR, WORKFLOW = "operator", "workflow"  # where a job's binding came from (its record says)


@dataclass(frozen=True)
class JobSecrets:
    """One job's bindings with their values and fresh placeholders, and where each came from."""

    bound: tuple[BoundSecret, ...] = ()
    sources: tuple[tuple[str, str], ...] = ()  # (binding name, OPERATOR or WORKFLOW)

    def __repr__(self) -> str:
        return f"JobSecrets({[name for name, _ in self.sources]!r})"

    @property
    def swap(self) -> SecretSwap:
        """The bindings as the VM's network uses them (runner/net/secretswap.py)."""
        return SecretSwap(self.bound)

    def bind(self, sandbox: SandboxLike, policy: Policy | None, log: JobLog) -> dict[str, str]:
        """The bindings, bound in the VM's network: the variables holding their placeholders. A binding
        whose host the job's policy does not let it reach is bound anyway (its placeholder is refused
        everywhere) and the log says why it cannot be used."""
        if not self.bound:
            return {}
        if not needs_network(policy):
            log.system(f"secret bindings {', '.join(b.binding.name for b in self.bound)} unused: the job's egress "
                       "policy allows nothing, so its VM has no network")
            return {}
        for entry in self.bound:
            binding = entry.binding
            if not any(rule.name_checked and rule.allows(port, "tcp", name=binding.host)
                       for rule in (policy.rules if policy else ()) for port in binding.ports):
                log.system(f"secret binding {binding.name}: the job's policy has no host: rule (name-checked, "
                           f"not raw) for {binding.host} on port(s) {','.join(map(str, sorted(binding.ports)))}, "
                           "so no request can use it")
        placeholders = sandbox.bind_secrets(self.swap)
        log.system("secret bindings: " + "; ".join(f"{b.binding.name} in ${b.binding.env} (only {b.binding.where()})"
                                                   for b in self.bound))
        return placeholders

    def note_uses(self, sandbox: SandboxLike, policy: Policy | None, log: JobLog, record: JobRecord) -> None:
        """How often each binding's value went out: in the log and the record (the signed record and the
        check run read it there), as names, hosts and counts, never a value."""
        if not self.bound:
            return
        uses = sandbox.secret_uses() if needs_network(policy) else {}
        log.system("secrets used: " + ", ".join(f"{b.binding.name} {uses.get(b.binding.name, 0)} request(s) to "
                                                f"{b.binding.host}" for b in self.bound))
        sources = dict(self.sources)
        record.secrets_used = [{"name": b.binding.name, "host": b.binding.host,
                                "source": sources.get(b.binding.name, OPERATOR),
                                "requests": uses.get(b.binding.name, 0)} for b in self.bound]


def job_secrets(operator: tuple[BoundSecret, ...], workflow: tuple[BoundSecret, ...] = ()) -> JobSecrets:
    return JobSecrets(operator + workflow, tuple((bound.binding.name, OPERATOR) for bound in operator)
                      + tuple((bound.binding.name, WORKFLOW) for bound in workflow))


@dataclass
class MaskedLog:
    """The guest's output on its way to the job log with every form of the job's secret values masked
    (`runner.net.secretswap.Masker`, per stream, across writes): the guest never has a value, so this is
    only the last fence before the log, the summary and the check run, which read the log."""

    log: JobLog
    secrets: JobSecrets
    maskers: dict[str, Masker] = field(default_factory=dict)

    def append(self, stream: str, data: bytes) -> None:
        if not self.secrets.bound:
            self.log.append(stream, data)
            return
        masker = self.maskers.setdefault(stream, Masker([needle for bound in self.secrets.bound
                                                         for needle in bound.reflections()]))
        out = masker.feed(data)
        if out:
            self.log.append(stream, out)

    def flush(self) -> None:
        for stream, masker in self.maskers.items():
            out = masker.flush()
            if out:
                self.log.append(stream, out)
