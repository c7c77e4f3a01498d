"""The service's YAML configuration, read once into typed, frozen settings that every wing of the service
reads and none writes: settings.py declares them (what an operator reads), reading.py reads a file into
them, checks.py checks what spans settings, schema.py publishes their JSON Schema."""
