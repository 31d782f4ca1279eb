"""devices heal: health-check back-off and consecutive infrastructure failures

Create Date: 2026-11-25 12:00:00
"""

import sqlalchemy as sa
from alembic import op

revision, down_revision, branch_labels, depends_on = '0008', '0007', None, None


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
