"""devices heal: health-check back-off and consecutive infrastructure failures

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-25 12:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0008'
down_revision: str | Sequence[str] | None = '0007'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('devices', schema=None) as batch_op:
        batch_op.add_column(sa.Column('infra_failures_in_row', sa.Integer(), nullable=False, server_default='0'))
        batch_op.add_column(sa.Column('probe_failures', sa.Integer(), nullable=False, server_default='0'))
        batch_op.add_column(sa.Column('next_probe_at', sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('devices', schema=None) as batch_op:
        batch_op.drop_column('next_probe_at')
        batch_op.drop_column('probe_failures')
        batch_op.drop_column('infra_failures_in_row')
