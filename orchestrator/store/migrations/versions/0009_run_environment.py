"""every run carries the environment it ran in: `runs.environment` (OS, kernel, driver,
adapter, engine runtime, clocks, profile, as the agent read them at run time) and
`runs.env_key`, the short key series are keyed by; runs stored before stay empty ({} and '')
and the analysis reads their device's record for them

Create Date: 2026-11-25 12:00:00
"""

import sqlalchemy as sa
from alembic import op

revision, down_revision, branch_labels, depends_on = '0009', '0008', None, None


def upgrade() -> None:
    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('environment', sa.JSON(), nullable=False, server_default=sa.text("'{}'")))
        batch_op.add_column(sa.Column('env_key', sa.String(length=32), nullable=False, server_default=''))
        batch_op.create_index('ix_runs_device_env_key', ['device_id', 'env_key'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.drop_index('ix_runs_device_env_key')
        batch_op.drop_column('env_key')
        batch_op.drop_column('environment')
