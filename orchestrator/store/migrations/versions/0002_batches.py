"""batches: jobs submitted and analysed together (schedule firings, submits, demos)

Create Date: 2026-11-21 17:10:45.065891
"""

import sqlalchemy as sa
from alembic import op

revision, down_revision, branch_labels, depends_on = '0002', '0001', None, None


def upgrade() -> None:
    # Written by autogenerate from orchestrator.store.models, reviewed by hand.
    op.create_table('batches',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=255), nullable=False),
    sa.Column('schedule_id', sa.Integer(), nullable=True),
    sa.Column('build_id', sa.Integer(), nullable=True),
    sa.Column('idempotency_key', sa.String(length=255), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('summary', sa.JSON(), nullable=True),
    sa.ForeignKeyConstraint(['build_id'], ['builds.id'], name=op.f('fk_batches_build_id_builds'), ondelete='SET NULL'),
    sa.ForeignKeyConstraint(['schedule_id'], ['schedules.id'], name=op.f('fk_batches_schedule_id_schedules'), ondelete='SET NULL'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_batches')),
    sa.UniqueConstraint('idempotency_key', name=op.f('uq_batches_idempotency_key'))
    )
    with op.batch_alter_table('batches', schema=None) as batch_op:
        batch_op.create_index('ix_batches_schedule_created', ['schedule_id', 'created_at'], unique=False)

    with op.batch_alter_table('deployments', schema=None) as batch_op:
        batch_op.add_column(sa.Column('bytes_total', sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column('batch_id', sa.Integer(), nullable=True))
        batch_op.create_index(batch_op.f('ix_deployments_batch_id'), ['batch_id'], unique=False)
        batch_op.create_foreign_key(batch_op.f('fk_deployments_batch_id_batches'), 'batches', ['batch_id'], ['id'], ondelete='SET NULL')

    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('batch_id', sa.Integer(), nullable=True))
        batch_op.create_index(batch_op.f('ix_jobs_batch_id'), ['batch_id'], unique=False)
        batch_op.create_foreign_key(batch_op.f('fk_jobs_batch_id_batches'), 'batches', ['batch_id'], ['id'], ondelete='SET NULL')



def downgrade() -> None:
    # Written by autogenerate from orchestrator.store.models, reviewed by hand.
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_constraint(batch_op.f('fk_jobs_batch_id_batches'), type_='foreignkey')
        batch_op.drop_index(batch_op.f('ix_jobs_batch_id'))
        batch_op.drop_column('batch_id')

    with op.batch_alter_table('deployments', schema=None) as batch_op:
        batch_op.drop_constraint(batch_op.f('fk_deployments_batch_id_batches'), type_='foreignkey')
        batch_op.drop_index(batch_op.f('ix_deployments_batch_id'))
        batch_op.drop_column('batch_id')
        batch_op.drop_column('bytes_total')

    with op.batch_alter_table('batches', schema=None) as batch_op:
        batch_op.drop_index('ix_batches_schedule_created')

    op.drop_table('batches')
