"""fairq: a fair, multi-tenant, durable message queue inside PostgreSQL."""

__version__ = "0.1.0"
