"""Operator endpoints: every tenant's queues and keys (admin-scoped keys only)."""
