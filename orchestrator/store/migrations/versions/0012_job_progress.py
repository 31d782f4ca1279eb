"""job progress: where a running job is (its agent's last phase and step), recorded as the
transport relays the agent's events

Create Date: 2026-11-25 19:00:00
"""

import sqlalchemy as sa
from alembic import op

revision, down_revision, branch_labels, depends_on = '0012', '0011', None, None


def upgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('progress', sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('progress')
