"""change points: where each series' level moved, found by scanning its whole history; a
batch's `round_metrics`, the metrics whose inconclusive comparison asks for more repetitions

Create Date: 2026-11-25 14:00:00
"""

import sqlalchemy as sa
from alembic import op

revision, down_revision, branch_labels, depends_on = '0011', '0010', None, None


def upgrade() -> None:
    op.create_table(
        'change_points',
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('series_key', sa.Text(), nullable=False),
        sa.Column('series', sa.JSON(), nullable=False),
        sa.Column('device_id', sa.Integer(), nullable=False),
        sa.Column('build_id', sa.Integer(), nullable=False),
        sa.Column('metric', sa.String(length=128), nullable=False),
        sa.Column('median_before', sa.Double(), nullable=False),
        sa.Column('median_after', sa.Double(), nullable=False),
        sa.Column('ratio', sa.Double(), nullable=True),
        sa.Column('p_value', sa.Double(), nullable=False),
        sa.Column('builds_in_history', sa.Integer(), nullable=False),
        sa.Column('detected_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(['build_id'], ['builds.id'], name=op.f('fk_change_points_build_id_builds'),
                                ondelete='CASCADE'),
        sa.ForeignKeyConstraint(['device_id'], ['devices.id'], name=op.f('fk_change_points_device_id_devices'),
                                ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_change_points')),
        sa.UniqueConstraint('series_key', 'build_id', name=op.f('uq_change_points_series_key_build_id')),
    )
    op.create_index('ix_change_points_device_detected', 'change_points', ['device_id', 'detected_at'], unique=False)
    with op.batch_alter_table('batches', schema=None) as batch_op:
        batch_op.add_column(sa.Column('round_metrics', sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('batches', schema=None) as batch_op:
        batch_op.drop_column('round_metrics')
    op.drop_index('ix_change_points_device_detected', table_name='change_points')
    op.drop_table('change_points')
