"""alerts: what the regression analysis found, for triage; per-series analysis settings; how
many more-repetition rounds a batch may launch

Create Date: 2026-11-21 17:22:30.828183
"""

import sqlalchemy as sa
from alembic import op

revision, down_revision, branch_labels, depends_on = '0004', '0003', None, None


def upgrade() -> None:
    # Written by autogenerate from orchestrator.store.models, reviewed by hand.
    op.create_table('series_settings',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('series_key', sa.String(length=1024), nullable=False),
    sa.Column('min_effect', sa.Double(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_series_settings')),
    sa.UniqueConstraint('series_key', name=op.f('uq_series_settings_series_key'))
    )
    op.create_table('alerts',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('kind', sa.Enum('regression', 'improvement', 'fidelity', 'data_stoppage', name='kind', native_enum=False, create_constraint=True, length=21), nullable=False),
    sa.Column('state', sa.Enum('new', 'acknowledged', 'invalid', 'fixed', name='state', native_enum=False, create_constraint=True, length=20), nullable=False),
    sa.Column('device_id', sa.Integer(), nullable=True),
    sa.Column('build_id', sa.Integer(), nullable=True),
    sa.Column('baseline_build_id', sa.Integer(), nullable=True),
    sa.Column('batch_id', sa.Integer(), nullable=True),
    sa.Column('metric', sa.String(length=128), nullable=False),
    sa.Column('series', sa.JSON(), nullable=False),
    sa.Column('ratio', sa.Double(), nullable=True),
    sa.Column('ci_low', sa.Double(), nullable=True),
    sa.Column('ci_high', sa.Double(), nullable=True),
    sa.Column('p_value', sa.Double(), nullable=True),
    sa.Column('summary', sa.Text(), nullable=False),
    sa.Column('detail', sa.JSON(), nullable=False),
    sa.Column('note', sa.Text(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['baseline_build_id'], ['builds.id'], name=op.f('fk_alerts_baseline_build_id_builds'), ondelete='SET NULL'),
    sa.ForeignKeyConstraint(['batch_id'], ['batches.id'], name=op.f('fk_alerts_batch_id_batches'), ondelete='SET NULL'),
    sa.ForeignKeyConstraint(['build_id'], ['builds.id'], name=op.f('fk_alerts_build_id_builds'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['device_id'], ['devices.id'], name=op.f('fk_alerts_device_id_devices'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_alerts'))
    )
    with op.batch_alter_table('batches', schema=None) as batch_op:
        batch_op.add_column(sa.Column('max_extra_rounds', sa.Integer(), nullable=False, server_default='3'))

    with op.batch_alter_table('alerts', schema=None) as batch_op:
        batch_op.create_index('ix_alerts_build', ['build_id'], unique=False)
        batch_op.create_index('ix_alerts_device_created', ['device_id', 'created_at'], unique=False)
        batch_op.create_index('ix_alerts_state_created', ['state', 'created_at'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('batches', schema=None) as batch_op:
        batch_op.drop_column('max_extra_rounds')

    # Written by autogenerate from orchestrator.store.models, reviewed by hand.
    with op.batch_alter_table('alerts', schema=None) as batch_op:
        batch_op.drop_index('ix_alerts_state_created')
        batch_op.drop_index('ix_alerts_device_created')
        batch_op.drop_index('ix_alerts_build')

    op.drop_table('alerts')
    op.drop_table('series_settings')
