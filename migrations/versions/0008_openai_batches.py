"""The OpenAI-compatible Files and Batch APIs; backfills that expire; a key's embeddings lane."""

import sqlalchemy as sa
from alembic import op

from core.db.schema import UTCDateTime

revision = "0008"
down_revision = "0007"


def upgrade() -> None:
    op.create_table(
        "files",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("api_key_id", sa.String(32), sa.ForeignKey("api_keys.id"), nullable=False),
        sa.Column("purpose", sa.String(32), nullable=False),
        sa.Column("filename", sa.String(255), nullable=False),
        sa.Column("bytes", sa.Integer(), nullable=True),
        sa.Column("batch_id", sa.String(40), nullable=True),
        sa.Column("role", sa.String(16), nullable=True),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("expires_at", UTCDateTime(), nullable=True),
        sa.Column("deleted_at", UTCDateTime(), nullable=True),
        sa.UniqueConstraint("batch_id", "role", name="uq_files_batch_role"),
    )
    op.create_index("ix_files_key_created", "files", ["api_key_id", "created_at"])
    op.create_table(
        "file_parts",
        sa.Column("file_id", sa.String(40), sa.ForeignKey("files.id"), primary_key=True),
        sa.Column("part", sa.Integer(), primary_key=True),
        sa.Column("data", sa.LargeBinary(), nullable=False),
    )
    op.create_table(
        "openai_batches",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("api_key_id", sa.String(32), sa.ForeignKey("api_keys.id"), nullable=False),
        sa.Column("backfill_id", sa.String(36), nullable=True, unique=True),
        sa.Column("endpoint", sa.String(64), nullable=False),
        sa.Column("input_file_id", sa.String(40), nullable=False),
        sa.Column("completion_window", sa.String(16), nullable=False),
        sa.Column("model", sa.String(64), nullable=True),
        sa.Column("metadata", sa.JSON(), nullable=True),
        sa.Column("errors", sa.JSON(), nullable=True),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("failed_at", UTCDateTime(), nullable=True),
    )
    op.create_index(
        "ix_openai_batches_key_created", "openai_batches", ["api_key_id", "created_at"]
    )
    with op.batch_alter_table("backfills") as batch:
        batch.add_column(sa.Column("expires_at", UTCDateTime(), nullable=True))
    with op.batch_alter_table("api_keys") as batch:
        batch.add_column(sa.Column("embeddings_lane", sa.String(16), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.drop_column("embeddings_lane")
    with op.batch_alter_table("backfills") as batch:
        batch.drop_column("expires_at")
    op.drop_index("ix_openai_batches_key_created", "openai_batches")
    op.drop_table("openai_batches")
    op.drop_table("file_parts")
    op.drop_index("ix_files_key_created", "files")
    op.drop_table("files")
