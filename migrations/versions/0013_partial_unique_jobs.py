"""The jobs table's unique indexes hold only the rows they constrain, and the quota's
index is gone: a plain job (no idempotency key, not a backfill item) enters three of
the table's indexes instead of seven, at its insert and at each of its two updates.

(api_key_id, idempotency_key), (backfill_id, line_no) and (backfill_id, custom_id) were
unique constraints over every row; a row with a NULL in them can never conflict, so a
unique index over the rows whose idempotency key (whose backfill) is set enforces the
same, and the backfill's reads (``backfill_id = ...``) can still use theirs. The quota is
a counter since 0007's key_usage; its rebuild (the reconciler's, rare) counts the
outstanding jobs through the status index. The new indexes are built CONCURRENTLY on
PostgreSQL, before the old ones are dropped, so submissions go on meanwhile and the
rows are never unguarded.
"""

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"

# (the new index, the old constraint, its columns, the column whose rows it holds)
UNIQUE = (
    (
        "ux_jobs_key_idempotency",
        "uq_jobs_key_idempotency",
        ["api_key_id", "idempotency_key"],
        "idempotency_key",
    ),
    ("ux_jobs_backfill_line", "uq_jobs_backfill_line", ["backfill_id", "line_no"], "backfill_id"),
    (
        "ux_jobs_backfill_custom_id",
        "uq_jobs_backfill_custom_id",
        ["backfill_id", "custom_id"],
        "backfill_id",
    ),
)
OUTSTANDING_WHERE = sa.text("backfill_id IS NULL")


def _where(over: str) -> sa.TextClause:
    return sa.text(f"{over} IS NOT NULL")


def upgrade() -> None:
    # First: SQLite's batch below copies the table's indexes, and a partial one might
    # come back whole.
    op.drop_index("ix_jobs_key_outstanding", table_name="jobs")
    if op.get_bind().dialect.name == "postgresql":
        with op.get_context().autocommit_block():
            for name, _old, columns, over in UNIQUE:
                op.create_index(
                    name,
                    "jobs",
                    columns,
                    unique=True,
                    postgresql_where=_where(over),
                    postgresql_concurrently=True,
                )
        for _name, old, _columns, _over in UNIQUE:
            op.drop_constraint(old, "jobs", type_="unique")
    else:
        with op.batch_alter_table("jobs") as batch:
            for _name, old, _columns, _over in UNIQUE:
                batch.drop_constraint(old, type_="unique")
        for name, _old, columns, over in UNIQUE:
            op.create_index(name, "jobs", columns, unique=True, sqlite_where=_where(over))


def downgrade() -> None:
    dialect = op.get_bind().dialect.name
    for name, _old, _columns, _over in UNIQUE:
        op.drop_index(name, table_name="jobs")
    if dialect == "postgresql":
        for _name, old, columns, _over in UNIQUE:
            op.create_unique_constraint(old, "jobs", columns)
    else:
        with op.batch_alter_table("jobs") as batch:
            for _name, old, columns, _over in UNIQUE:
                batch.create_unique_constraint(old, columns)
    op.create_index(
        "ix_jobs_key_outstanding",
        "jobs",
        ["api_key_id", "status"],
        postgresql_where=OUTSTANDING_WHERE,
        sqlite_where=OUTSTANDING_WHERE,
    )
