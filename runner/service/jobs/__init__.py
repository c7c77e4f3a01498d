"""A job, from admission to its record: the wire request checked and admitted, the queue, the workers and
the template each job restores from, one job's life in its VM, sessions across steps, warm bases and
pre-warmed VMs, interactive sandboxes, logs, outputs, secrets and signed records. No HTTP, no GitHub
protocol: those wings call in here."""
