"""device state changes: each change of a device's state (not its lease's busy and available)
with the event and the reason, for its health page's history

Create Date: 2026-11-28 14:20:00
"""

import sqlalchemy as sa
from alembic import op

revision, down_revision, branch_labels, depends_on = '0021', '0020', None, None


def upgrade() -> None:
    op.create_table(
        'device_state_changes',
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('device_id', sa.Integer(), nullable=False),
        sa.Column('at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('from_state', sa.String(length=24), nullable=False),
        sa.Column('to_state', sa.String(length=24), nullable=False),
        sa.Column('event', sa.String(length=24), nullable=False),
        sa.Column('reason', sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(['device_id'], ['devices.id'], name=op.f('fk_device_state_changes_device_id_devices'),
                                ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_device_state_changes')),
    )
    op.create_index('ix_device_state_changes_device_at', 'device_state_changes', ['device_id', 'at'])


def downgrade() -> None:
    op.drop_index('ix_device_state_changes_device_at', table_name='device_state_changes')
    op.drop_table('device_state_changes')
