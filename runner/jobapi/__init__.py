"""The job API's client side and wire contract: all the action and `microvm-check run` need of the service.

`contract` is the single source of the API's types, limits, patterns and states (the service imports
it too); `client` speaks the API over a Unix socket or TCP. Neither imports the service.
"""
