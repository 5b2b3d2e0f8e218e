"""The webhook events a job asks for (started, progress, terminal; null: terminal only),
and a delivery's ordinal, so that a job may have many started and progress deliveries
but still one terminal one.
"""

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("callback_events", sa.String(32), nullable=True))
    with op.batch_alter_table("webhook_deliveries") as batch:
        batch.add_column(sa.Column("ordinal", sa.Integer(), nullable=False, server_default="0"))
        batch.drop_constraint("uq_deliveries_job_event", type_="unique")
        batch.create_unique_constraint(
            "uq_deliveries_job_event", ["job_id", "event_type", "ordinal"]
        )


def downgrade() -> None:
    with op.batch_alter_table("webhook_deliveries") as batch:
        batch.drop_constraint("uq_deliveries_job_event", type_="unique")
        batch.create_unique_constraint("uq_deliveries_job_event", ["job_id", "event_type"])
        batch.drop_column("ordinal")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("callback_events")
