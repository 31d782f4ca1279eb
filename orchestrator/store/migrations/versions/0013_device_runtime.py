"""device runtime: who runs the engine on a device, its farm-agent ("python") or its web
browser ("browser")

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-25 11:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0013'
down_revision: str | Sequence[str] | None = '0012'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('devices', schema=None) as batch_op:
        batch_op.add_column(sa.Column('runtime', sa.String(length=16), server_default='python', nullable=False))


def downgrade() -> None:
    with op.batch_alter_table('devices', schema=None) as batch_op:
        batch_op.drop_column('runtime')
