"""Thin routers, one module per resource; data access lives in ``jobs.store.crud``."""
