"""Models an operator unloaded: they take no new jobs until loaded again."""

import sqlalchemy as sa
from alembic import op

from core.db.schema import UTCDateTime

revision = "0010"
down_revision = "0009"


def upgrade() -> None:
    op.create_table(
        "model_unloads",
        sa.Column("model", sa.String(64), primary_key=True),
        sa.Column("unloaded_at", UTCDateTime(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("model_unloads")
