"""The database: its schema and every write of SQL Ferry makes outside a route.

The tables and how to open them (``schema``), the Alembic migrations run from
code (``migrate``), API keys (``keys``), each key's outstanding jobs
(``usage``), what every terminal write also does (``terminal``), the job
resource as JSON (``resources``), backfills (``backfills``), webhook deliveries
(``webhooks``) and model versions and activations (``versions``). May import
``core.config``, ``core.models`` and ``core.streams``.
"""
