"""The GitHub action (`uses: org/microvm-check@v1`): a thin client of the job service on the runner host.

action.yml runs `python -I -m action`; see action/README.md for the inputs, the outputs and what the
action guarantees about guest output.
"""
