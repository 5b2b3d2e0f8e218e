"""Model versions: the version a job asked for, the version that ran it, and activations."""

import sqlalchemy as sa
from alembic import op

from core.db.schema import UTCDateTime

revision = "0006"
down_revision = "0005"


def upgrade() -> None:
    op.create_table(
        "model_activations",
        sa.Column("model", sa.String(64), primary_key=True),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("updated_at", UTCDateTime(), nullable=False),
    )
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("requested_version", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("model_version", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("model_version")
        batch.drop_column("requested_version")
    op.drop_table("model_activations")
