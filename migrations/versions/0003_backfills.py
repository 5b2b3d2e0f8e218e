"""Backfills: the table, and the columns that make a job one of a backfill's items."""

import sqlalchemy as sa
from alembic import op

from core.db.schema import UTCDateTime

revision = "0003"
down_revision = "0002"


def upgrade() -> None:
    op.create_table(
        "backfills",
        sa.Column("id", sa.String(36), primary_key=True),
        sa.Column("api_key_id", sa.String(32), sa.ForeignKey("api_keys.id"), nullable=False),
        sa.Column("model", sa.String(64), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("callback_url", sa.Text(), nullable=True),
        sa.Column("total", sa.Integer(), nullable=False),
        sa.Column("completed", sa.Integer(), nullable=False),
        sa.Column("failed", sa.Integer(), nullable=False),
        sa.Column("expired", sa.Integer(), nullable=False),
        sa.Column("cancelled", sa.Integer(), nullable=False),
        sa.Column("fed_through", sa.Integer(), nullable=False),
        sa.Column("input_bytes", sa.Integer(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("in_progress_at", UTCDateTime(), nullable=True),
        sa.Column("finalizing_at", UTCDateTime(), nullable=True),
        sa.Column("finished_at", UTCDateTime(), nullable=True),
        sa.Column("cancelling_at", UTCDateTime(), nullable=True),
        sa.Column("updated_at", UTCDateTime(), nullable=False),
    )
    op.create_index("ix_backfills_key_created", "backfills", ["api_key_id", "created_at"])
    op.create_index("ix_backfills_status", "backfills", ["status"])
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("backfill_id", sa.String(36), nullable=True))
        batch.add_column(sa.Column("line_no", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("custom_id", sa.String(255), nullable=True))
        batch.create_unique_constraint("uq_jobs_backfill_line", ["backfill_id", "line_no"])
        batch.create_unique_constraint("uq_jobs_backfill_custom_id", ["backfill_id", "custom_id"])
    with op.batch_alter_table("webhook_deliveries") as batch:
        batch.add_column(sa.Column("backfill_id", sa.String(36), nullable=True))
        batch.create_unique_constraint(
            "uq_deliveries_backfill_event", ["backfill_id", "event_type"]
        )


def downgrade() -> None:
    with op.batch_alter_table("webhook_deliveries") as batch:
        batch.drop_constraint("uq_deliveries_backfill_event", type_="unique")
        batch.drop_column("backfill_id")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_constraint("uq_jobs_backfill_custom_id", type_="unique")
        batch.drop_constraint("uq_jobs_backfill_line", type_="unique")
        batch.drop_column("custom_id")
        batch.drop_column("line_no")
        batch.drop_column("backfill_id")
    op.drop_index("ix_backfills_status", table_name="backfills")
    op.drop_index("ix_backfills_key_created", table_name="backfills")
    op.drop_table("backfills")
