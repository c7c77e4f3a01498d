"""Error base classes every layer may raise: a leaf module that imports nothing of the project.

It sits below everything (policy, runner.vm, runner.net, the service, the action, vmimages), so an
area can raise an error the CLI knows how to print without importing the CLI module and the
command modules it loads, which is what made `policy` and `vmimages` import `runner.cli`.
"""

from __future__ import annotations


class UserError(Exception):
    """An error the user can act on: printed as one message, never as a traceback."""
