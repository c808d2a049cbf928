"""The task template: copy this folder to start a new community run (README, "Starting your own community run")."""
