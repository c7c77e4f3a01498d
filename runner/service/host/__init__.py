"""The service's assembly: `ServiceHost` (assembly.py) builds every part in one order from the config and
takes them apart again; its sides (vms, jobs, github, fleet, status); the commands that start it
(`serve`, `jobs`, `config`); retention, which expires what a job leaves behind."""
