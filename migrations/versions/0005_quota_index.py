"""An index that keeps the per-key quota of outstanding jobs cheap: (api_key_id, status).

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-30
"""

from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_jobs_key_status", "jobs", ["api_key_id", "status"])


def downgrade() -> None:
    op.drop_index("ix_jobs_key_status", table_name="jobs")
