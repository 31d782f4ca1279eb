"""schedule errors: why a schedule could not fire last time (a cron that names no date, no
build, no devices), shown by `farm schedules list`; cleared by its next firing

Create Date: 2026-11-27 15:30:00
"""

import sqlalchemy as sa
from alembic import op

revision, down_revision, branch_labels, depends_on = '0016', '0015', None, None


def upgrade() -> None:
    with op.batch_alter_table('schedules', schema=None) as batch_op:
        batch_op.add_column(sa.Column('last_error', sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('schedules', schema=None) as batch_op:
        batch_op.drop_column('last_error')
