"""retention: a run records when its samples and kernel timings were downsampled (and what the
summaries stand for) and when its log files were deleted (orchestrator/store/retention.py)

Create Date: 2026-12-07 10:00:00
"""

import sqlalchemy as sa
from alembic import op

revision, down_revision, branch_labels, depends_on = '0023', '0022', None, None


def upgrade() -> None:
    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('downsampled_at', sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column('retained', sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column('logs_deleted_at', sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.drop_column('logs_deleted_at')
        batch_op.drop_column('retained')
        batch_op.drop_column('downsampled_at')
