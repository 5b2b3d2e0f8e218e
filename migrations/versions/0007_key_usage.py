"""Each key's outstanding jobs, kept as a counter instead of counted per submission."""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"


def upgrade() -> None:
    op.create_table(
        "key_usage",
        sa.Column(
            "api_key_id", sa.String(32), sa.ForeignKey("api_keys.id"), primary_key=True
        ),
        sa.Column("outstanding", sa.Integer(), nullable=False, server_default="0"),
    )
    # The jobs already queued or running count from the start.
    op.execute(
        "INSERT INTO key_usage (api_key_id, outstanding) "
        "SELECT api_key_id, count(*) FROM jobs "
        "WHERE status IN ('queued', 'running') AND backfill_id IS NULL GROUP BY api_key_id"
    )


def downgrade() -> None:
    op.drop_table("key_usage")
