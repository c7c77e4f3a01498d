"""The service's YAML configuration, read once into typed, frozen settings (settings.py) that every wing
of the service reads and none writes."""
