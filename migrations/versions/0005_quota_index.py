"""An index that keeps the per-key quota of outstanding jobs cheap.

(api_key_id, status) over the jobs that are not backfill items: the quota counts
only those, so backfill items never have to be read and thrown away. Built
CONCURRENTLY on PostgreSQL, so submissions go on while it builds.
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"

WHERE = sa.text("backfill_id IS NULL")


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        with op.get_context().autocommit_block():
            op.create_index(
                "ix_jobs_key_outstanding",
                "jobs",
                ["api_key_id", "status"],
                postgresql_where=WHERE,
                postgresql_concurrently=True,
            )
    else:
        op.create_index(
            "ix_jobs_key_outstanding", "jobs", ["api_key_id", "status"], sqlite_where=WHERE
        )


def downgrade() -> None:
    op.drop_index("ix_jobs_key_outstanding", table_name="jobs")
