"""adapter groups: devices whose work runs on one physical GPU (a host's virtual phones and the
host itself) share an `adapter_group`, and a device lease says whether its holder is timed
(`lease_timed`), so the farm never times a job while anything else runs on that GPU

Create Date: 2026-11-25 02:00:00
"""

import sqlalchemy as sa
from alembic import op

revision, down_revision, branch_labels, depends_on = '0007', '0006', None, None


def upgrade() -> None:
    with op.batch_alter_table('devices', schema=None) as batch_op:
        batch_op.add_column(sa.Column('adapter_group', sa.String(length=64), nullable=True))
        batch_op.add_column(sa.Column('lease_timed', sa.Boolean(), nullable=False, server_default=sa.false()))
        batch_op.create_index('ix_devices_adapter_group', ['adapter_group'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('devices', schema=None) as batch_op:
        batch_op.drop_index('ix_devices_adapter_group')
        batch_op.drop_column('lease_timed')
        batch_op.drop_column('adapter_group')
