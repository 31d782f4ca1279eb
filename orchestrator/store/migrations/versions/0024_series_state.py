"""series state: the analysis' per-series rows (series, series_points, series_runs,
series_progress), kept as runs arrive so that the nightly analysis and the dashboard read what
they need of a series without its whole history (orchestrator/store/series_models.py). Filled
by the analysis from the runs already stored the first time it runs after this migration.

Create Date: 2026-12-06 08:30:00
"""

import sqlalchemy as sa
from alembic import op

revision, down_revision, branch_labels, depends_on = '0024', '0023', None, None


def upgrade() -> None:
    op.create_table(
        'series',
        sa.Column('id', sa.String(length=16), nullable=False),
        sa.Column('key', sa.Text(), nullable=False),
        sa.Column('series', sa.JSON(), nullable=False),
        sa.Column('device_id', sa.Integer(), nullable=False),
        sa.Column('metric', sa.String(length=128), nullable=False),
        sa.Column('workload', sa.String(length=512), nullable=False),
        sa.Column('env_key', sa.String(length=32), nullable=False),
        sa.Column('runs', sa.Integer(), nullable=False),
        sa.Column('builds', sa.Integer(), nullable=False),
        sa.Column('last_build_id', sa.Integer(), nullable=True),
        sa.Column('last_build_created', sa.DateTime(timezone=True), nullable=True),
        sa.Column('last_median', sa.Double(), nullable=True),
        sa.Column('last_n', sa.Integer(), nullable=False),
        sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(['device_id'], ['devices.id'], name=op.f('fk_series_device_id_devices'),
                                ondelete='CASCADE'),
        sa.ForeignKeyConstraint(['last_build_id'], ['builds.id'], name=op.f('fk_series_last_build_id_builds'),
                                ondelete='SET NULL'),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_series')),
    )
    op.create_index('ix_series_device_workload', 'series', ['device_id', 'workload', 'env_key'])
    op.create_index('ix_series_metric', 'series', ['metric'])
    op.create_table(
        'series_points',
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('series_id', sa.String(length=16), nullable=False),
        sa.Column('build_id', sa.Integer(), nullable=False),
        sa.Column('build_created', sa.DateTime(timezone=True), nullable=False),
        sa.Column('n', sa.Integer(), nullable=False),
        sa.Column('median', sa.Double(), nullable=False),
        sa.Column('minimum', sa.Double(), nullable=False),
        sa.Column('maximum', sa.Double(), nullable=False),
        sa.ForeignKeyConstraint(['series_id'], ['series.id'], name=op.f('fk_series_points_series_id_series'),
                                ondelete='CASCADE'),
        sa.ForeignKeyConstraint(['build_id'], ['builds.id'], name=op.f('fk_series_points_build_id_builds'),
                                ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_series_points')),
        sa.UniqueConstraint('series_id', 'build_id', name=op.f('uq_series_points_series_id_build_id')),
    )
    op.create_index('ix_series_points_order', 'series_points', ['series_id', 'build_created', 'build_id'])
    op.create_table(
        'series_runs',
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('series_id', sa.String(length=16), nullable=False),
        sa.Column('run_id', sa.Integer(), nullable=False),
        sa.Column('build_id', sa.Integer(), nullable=False),
        sa.Column('build_created', sa.DateTime(timezone=True), nullable=False),
        sa.Column('n', sa.Integer(), nullable=False),
        sa.Column('median', sa.Double(), nullable=False),
        sa.Column('log_median', sa.Double(), nullable=True),
        sa.Column('within', sa.Double(), nullable=True),
        sa.Column('flagged', sa.Boolean(), nullable=False),
        sa.ForeignKeyConstraint(['series_id'], ['series.id'], name=op.f('fk_series_runs_series_id_series'),
                                ondelete='CASCADE'),
        sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_series_runs_run_id_runs'), ondelete='CASCADE'),
        sa.ForeignKeyConstraint(['build_id'], ['builds.id'], name=op.f('fk_series_runs_build_id_builds'),
                                ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_series_runs')),
        sa.UniqueConstraint('series_id', 'run_id', name=op.f('uq_series_runs_series_id_run_id')),
    )
    op.create_index('ix_series_runs_order', 'series_runs', ['series_id', 'build_created', 'build_id', 'run_id'])
    op.create_index('ix_series_runs_run', 'series_runs', ['run_id'])
    op.create_table(
        'series_progress',
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('last_run_id', sa.Integer(), nullable=False),
        sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_series_progress')),
    )


def downgrade() -> None:
    op.drop_table('series_progress')
    op.drop_index('ix_series_runs_run', table_name='series_runs')
    op.drop_index('ix_series_runs_order', table_name='series_runs')
    op.drop_table('series_runs')
    op.drop_index('ix_series_points_order', table_name='series_points')
    op.drop_table('series_points')
    op.drop_index('ix_series_metric', table_name='series')
    op.drop_index('ix_series_device_workload', table_name='series')
    op.drop_table('series')
