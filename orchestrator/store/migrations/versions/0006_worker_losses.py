"""worker losses: a job counts the executions it lost because their worker died apart from
the ones its device failed, so a flaky host does not use up an innocent job's attempts

Create Date: 2026-11-25 01:00:00
"""

import sqlalchemy as sa
from alembic import op

revision, down_revision, branch_labels, depends_on = '0006', '0005', None, None


def upgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('worker_losses', sa.Integer(), nullable=False, server_default='0'))


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('worker_losses')
