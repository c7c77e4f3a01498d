"""The project's error tree: one root, one base per area. A leaf module that imports nothing of the project.

It sits below everything (policy, runner.vm, runner.net, the service, the action, vmimages), so any
layer can raise an area's error, and the CLI can print it, without importing the layers above.

What an error of this tree means: it was raised on purpose and its message is complete for the
person who reads it (what failed, and what to do). The CLI prints one as a single line
("microvm-check: <message>", exit status 1); anything else that escapes a command is a bug and is
printed with its traceback. So never derive a project error from ValueError or RuntimeError: an
`except ValueError` meant for `int()` would then swallow it, and a `ValueError` from a bug would be
taken for a user's mistake.

    MicrovmCheckError
    ├── UserError        a command's own input: its flags, the action's inputs, a file named on the command line
    ├── ConfigError      the host's configuration: service config, webhook and runner settings (runner.fleet)
    ├── JobError         a job API request the service refuses: spec, body, state, queue (runner.service)
    ├── ClientError      the client side of the job API: service unreachable or refusing (runner.jobapi, action)
    ├── ArchiveError     a tar stream breaking a rule or bound: checkout, artifacts (runner.tarsafe, action)
    ├── SandboxError     a VM or its guest cannot go on (runner.vm, the job's log budget)
    ├── TemplateError    a VM template cannot be found, described or built (runner.vm.templates, vmimages)
    │   └── ImageError   an OCI image a template is built from, refused (vmimages.oci)
    ├── NetworkError     namespaces, uplink, firewall rules, the guests' resolver (runner.net)
    ├── AttestationError a signed job record cannot be made, read or verified (runner.attest)
    ├── GitHubError      GitHub did not answer with what we asked for (runner.github)
    └── PolicyError      an egress policy that does not load (defined in policy.load, with its problems)

Domain errors carry no HTTP status: the job API maps them to statuses in one table at its edge
(runner.service.api.refusals.STATUS). These exceptions stay outside the tree on purpose:
`runner.jobapi.contract.StateTransitionError` (a bug in the service: it must show a traceback),
`runner.vm.guestwire.ProtocolError` (that file is also installed alone in the guest, which has no
`runner` package; the host's agent turns it into an AgentError), `action.__main__.Interrupted` and
`runner.commands.localrun.Stopped` (signals, not errors: KeyboardInterrupts, so cleanup runs as for
Ctrl-C) and `runner.net.namecheck._Short` (the name check's private "read more bytes" signal).
`runner.fleet.cgroup.CgroupError` is still an OSError until the fleet stops catching it as one.
"""

from __future__ import annotations

from collections.abc import Sequence


class MicrovmCheckError(Exception):
    """Raised on purpose, with a message complete for its reader: the CLI prints it as one line."""


class UserError(MicrovmCheckError):
    """A command's own input (its flags, the action's inputs, a file it was told to read) refused."""


class ConfigError(MicrovmCheckError):
    """A configuration the host refuses: a message, or every problem found, each naming file:line and key.

    Given problems (objects whose `str()` is one located line, in the order to print), `problems`
    keeps them for callers that report them elsewhere (a JSON check, an editor).
    """

    def __init__(self, message: str | Sequence[object]) -> None:
        self.problems = [] if isinstance(message, str) else list(message)
        super().__init__(message if isinstance(message, str) else "\n".join(str(p) for p in self.problems))


class JobError(MicrovmCheckError):
    """A job API request the service refuses: the message tells the client what to change or when to retry."""


class ClientError(MicrovmCheckError):
    """The client side of the job API (the action, `run`, `jobs`) could not get a job through."""


class ArchiveError(MicrovmCheckError):
    """A tar stream broke a rule or a bound; the message names the member and the rule."""


class SandboxError(MicrovmCheckError):
    """The sandbox cannot go on (its VM died, expired, or its guest misbehaved); it has been destroyed."""


class SandboxOpFailed(SandboxError):
    """The sandbox could not do what was asked (a path that is missing or of the wrong kind, a tar it
    cannot unpack): the guest or the host said why, nothing broke, and the sandbox lives on."""


class CommandNotStarted(SandboxOpFailed):
    """The guest could not start the program at all (not found, not executable): nothing of it ran, so
    starting something else in its place runs the job's command once, not twice. The sandbox lives on."""


class TemplateError(MicrovmCheckError):
    """A VM template that cannot be found, described or built."""


class ImageError(TemplateError):
    """An OCI image a template is built from was refused (vmimages.oci): the message names the reference,
    blob or layer member, the rule it broke, and what to do."""


class NetworkError(MicrovmCheckError):
    """The host's network plumbing for VMs (namespaces, uplink, rules, resolver) failed; no VM runs on it."""


class AttestationError(MicrovmCheckError):
    """A signed job record that cannot be made, read or verified; the message says which part failed."""


class GitHubError(MicrovmCheckError):
    """GitHub answered, but not with what we asked for (or not at all)."""

    def __init__(self, message: str, *, status: int | None = None, method: str = "", path: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.method = method
        self.path = path
