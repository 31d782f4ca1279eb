"""tuned profiles registered per GPU: the driver, backend and engine they were tuned with, the
tune run that made them, the family profile they are measured against, the gain their tune
estimated and the gain a latency run measured, and when they were promoted; jobs may wait
for another job (`after_job_id`: a latency run of the profile a tune job makes)

Create Date: 2026-11-25 12:00:00
"""

import sqlalchemy as sa
from alembic import op

revision, down_revision, branch_labels, depends_on = '0010', '0009', None, None


def upgrade() -> None:
    with op.batch_alter_table('profiles', schema=None) as batch_op:
        batch_op.add_column(sa.Column('gpu_driver', sa.String(length=255), server_default='', nullable=False))
        batch_op.add_column(sa.Column('gpu_backend', sa.String(length=64), server_default='', nullable=False))
        batch_op.add_column(sa.Column('engine_version', sa.String(length=255), server_default='', nullable=False))
        batch_op.add_column(sa.Column('tune_run_id', sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column('family', sa.String(length=255), server_default='', nullable=False))
        batch_op.add_column(sa.Column('estimated_gain', sa.Double(), nullable=True))
        batch_op.add_column(sa.Column('measured_gain', sa.Double(), nullable=True))
        batch_op.add_column(sa.Column('measured_gain_ci', sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column('measured_in_batch_id', sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column('promoted_at', sa.DateTime(timezone=True), nullable=True))
        batch_op.create_unique_constraint(batch_op.f('uq_profiles_tune_run_id'), ['tune_run_id'])
        batch_op.create_foreign_key(batch_op.f('fk_profiles_tune_run_id_runs'), 'runs', ['tune_run_id'], ['id'],
                                    ondelete='SET NULL')
        batch_op.create_foreign_key(batch_op.f('fk_profiles_measured_in_batch_id_batches'), 'batches',
                                    ['measured_in_batch_id'], ['id'], ondelete='SET NULL')
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('after_job_id', sa.Integer(), nullable=True))
        batch_op.create_foreign_key(batch_op.f('fk_jobs_after_job_id_jobs'), 'jobs', ['after_job_id'], ['id'],
                                    ondelete='SET NULL')


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_constraint(batch_op.f('fk_jobs_after_job_id_jobs'), type_='foreignkey')
        batch_op.drop_column('after_job_id')
    with op.batch_alter_table('profiles', schema=None) as batch_op:
        batch_op.drop_constraint(batch_op.f('fk_profiles_measured_in_batch_id_batches'), type_='foreignkey')
        batch_op.drop_constraint(batch_op.f('fk_profiles_tune_run_id_runs'), type_='foreignkey')
        batch_op.drop_constraint(batch_op.f('uq_profiles_tune_run_id'), type_='unique')
        for column in ('promoted_at', 'measured_in_batch_id', 'measured_gain_ci', 'measured_gain', 'estimated_gain',
                       'family', 'tune_run_id', 'engine_version', 'gpu_backend', 'gpu_driver'):
            batch_op.drop_column(column)
