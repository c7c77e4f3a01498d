"""The job API's client side and wire contract: all the action and `microvm-check run` need of the service.

`contract` is the single source of the API's types, limits, patterns and states (the service imports
it too); `client` speaks the API over a Unix socket or TCP. The client side's data, which the service
also needs for `run` and the jobs page: `pack` packs a checkout as the upload's tar, `workflow` writes text
no workflow command can be forged from, `terminal` shows log entries on a terminal. None imports the service.
"""

