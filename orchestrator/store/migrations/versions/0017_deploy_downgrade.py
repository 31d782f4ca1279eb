"""deployments: whether a build older than the device's current one may become current
(`farm deploy --allow-downgrade`), and a note on what an install did besides succeeding
(an older build installed beside the current one, which stays)

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-27 18:45:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0017'
down_revision: str | Sequence[str] | None = '0016'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('deployments', schema=None) as batch_op:
        batch_op.add_column(sa.Column('allow_downgrade', sa.Boolean(), nullable=False, server_default=sa.false()))
        batch_op.add_column(sa.Column('note', sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('deployments', schema=None) as batch_op:
        batch_op.drop_column('note')
        batch_op.drop_column('allow_downgrade')
