"""On PostgreSQL, a job's key is no longer a foreign key: its check locked the key's row
for every job inserted.

PostgreSQL checks a foreign key row by row, each check a ``SELECT ... FOR KEY SHARE`` of
the referenced row: every job a group inserts locked its key's row again, and the
groups of one key, from every API process at once, shared that lock (a multixact, kept
in the key's row). That was 6 to 12 µs of the database's CPU per job, of about 100
for its group's statement (a probe; bench/README.md). A key is never deleted (a
revoked one keeps its row, for the jobs that name it), and a job's key is the key
that authenticated its request, read before the insert; so the constraint guarded
against nothing the service does. SQLite keeps it:
its check is one index lookup, and dropping it would copy the whole table.
"""

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"


def _key_constraints() -> list[str]:
    return [
        str(fk["name"])
        for fk in sa.inspect(op.get_bind()).get_foreign_keys("jobs")
        if fk["constrained_columns"] == ["api_key_id"] and fk["name"]
    ]


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        for name in _key_constraints():
            op.drop_constraint(name, "jobs", type_="foreignkey")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql" and not _key_constraints():
        op.create_foreign_key("jobs_api_key_id_fkey", "jobs", "api_keys", ["api_key_id"], ["id"])
