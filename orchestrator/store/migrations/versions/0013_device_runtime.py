"""device runtime: who runs the engine on a device, its farm-agent ("python") or its web
browser ("browser")

Create Date: 2026-11-25 11:00:00
"""

import sqlalchemy as sa
from alembic import op

revision, down_revision, branch_labels, depends_on = '0013', '0012', None, None


def upgrade() -> None:
    with op.batch_alter_table('devices', schema=None) as batch_op:
        batch_op.add_column(sa.Column('runtime', sa.String(length=16), server_default='python', nullable=False))


def downgrade() -> None:
    with op.batch_alter_table('devices', schema=None) as batch_op:
        batch_op.drop_column('runtime')
