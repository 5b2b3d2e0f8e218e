"""Webhook deliveries and attempts; a signing secret per API key."""

import base64
import secrets

import sqlalchemy as sa
from alembic import op

from core.db.schema import UTCDateTime

revision = "0002"
down_revision = "0001"


def upgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.add_column(sa.Column("webhook_secret", sa.String(100), nullable=True))
        batch.add_column(sa.Column("previous_webhook_secret", sa.String(100), nullable=True))
        batch.add_column(sa.Column("previous_webhook_secret_until", UTCDateTime(), nullable=True))
    # Keys made before webhooks existed get their secret now.
    keys = sa.table("api_keys", sa.column("id", sa.String), sa.column("webhook_secret", sa.String))
    connection = op.get_bind()
    for (key_id,) in connection.execute(sa.select(keys.c.id)).all():
        secret = "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()
        connection.execute(
            sa.update(keys).where(keys.c.id == key_id).values(webhook_secret=secret)
        )

    op.create_table(
        "webhook_deliveries",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("api_key_id", sa.String(32), sa.ForeignKey("api_keys.id"), nullable=False),
        sa.Column("job_id", sa.String(36), nullable=True),
        sa.Column("event_type", sa.String(40), nullable=False),
        sa.Column("url", sa.Text(), nullable=False),
        sa.Column("payload", sa.Text(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("next_attempt_at", UTCDateTime(), nullable=True),
        sa.Column("queued_until", UTCDateTime(), nullable=True),
        sa.Column("lease_until", UTCDateTime(), nullable=True),
        sa.Column("last_status_code", sa.Integer(), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("finished_at", UTCDateTime(), nullable=True),
        sa.UniqueConstraint("job_id", "event_type", name="uq_deliveries_job_event"),
    )
    op.create_index(
        "ix_deliveries_status_next", "webhook_deliveries", ["status", "next_attempt_at"]
    )
    op.create_table(
        "webhook_attempts",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column(
            "delivery_id", sa.String(40), sa.ForeignKey("webhook_deliveries.id"), nullable=False
        ),
        sa.Column("number", sa.Integer(), nullable=False),
        sa.Column("started_at", UTCDateTime(), nullable=False),
        sa.Column("duration_ms", sa.Float(), nullable=True),
        sa.Column("status_code", sa.Integer(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
    )
    op.create_index("ix_webhook_attempts_delivery_id", "webhook_attempts", ["delivery_id"])


def downgrade() -> None:
    op.drop_index("ix_webhook_attempts_delivery_id", table_name="webhook_attempts")
    op.drop_table("webhook_attempts")
    op.drop_index("ix_deliveries_status_next", table_name="webhook_deliveries")
    op.drop_table("webhook_deliveries")
    with op.batch_alter_table("api_keys") as batch:
        batch.drop_column("previous_webhook_secret_until")
        batch.drop_column("previous_webhook_secret")
        batch.drop_column("webhook_secret")
