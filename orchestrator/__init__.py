"""The control plane: the `farm` CLI, services, Celery tasks, transports and the SQL store."""
