"""Jobs and API keys."""

import sqlalchemy as sa
from alembic import op

from core.db.schema import UTCDateTime

revision = "0001"
down_revision = None


def upgrade() -> None:
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("salt", sa.String(64), nullable=False),
        sa.Column("secret_hash", sa.String(128), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("revoked_at", UTCDateTime(), nullable=True),
    )
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(36), primary_key=True),
        sa.Column("api_key_id", sa.String(32), sa.ForeignKey("api_keys.id"), nullable=False),
        sa.Column("model", sa.String(64), nullable=False),
        sa.Column("priority", sa.String(16), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("input", sa.JSON(), nullable=False),
        sa.Column("cost", sa.Integer(), nullable=False),
        sa.Column("output", sa.JSON(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("started_at", UTCDateTime(), nullable=True),
        sa.Column("finished_at", UTCDateTime(), nullable=True),
        sa.Column("deadline_at", UTCDateTime(), nullable=True),
        sa.Column("batch_id", sa.String(36), nullable=True),
        sa.Column("batch_size", sa.Integer(), nullable=True),
        sa.Column("inference_ms", sa.Float(), nullable=True),
        sa.Column("callback_url", sa.Text(), nullable=True),
        sa.Column("idempotency_key", sa.String(255), nullable=True),
        sa.Column("metadata", sa.JSON(), nullable=True),
        sa.Column("request_id", sa.String(64), nullable=True),
        sa.UniqueConstraint("api_key_id", "idempotency_key", name="uq_jobs_key_idempotency"),
    )
    op.create_index("ix_jobs_key_created", "jobs", ["api_key_id", "created_at"])
    op.create_index("ix_jobs_status_finished", "jobs", ["status", "finished_at"])


def downgrade() -> None:
    op.drop_index("ix_jobs_status_finished", table_name="jobs")
    op.drop_index("ix_jobs_key_created", table_name="jobs")
    op.drop_table("jobs")
    op.drop_table("api_keys")
