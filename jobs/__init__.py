"""Celery workers that run engine jobs. Filled by the service issue."""
