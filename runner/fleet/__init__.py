"""The host's ephemeral GitHub runners: installed once, copied fresh for every job, one job each.

`install` puts the official runner release on the host (verified, read-only), `workdir` makes one
runner's own directory from it, `fleet` keeps as many runners as the config asks for and cleans up
after each, and `status` is what `microvm-check status` shows of them.
"""
