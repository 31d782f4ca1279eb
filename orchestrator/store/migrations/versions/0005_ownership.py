"""ownership: every job and deployment that waits on a message has a deadline (`due_at`) and a
dispatch sequence number, so the reconciler can send it again and drop superseded messages;
deployments get attempts and a heartbeat; a job names the deployment it waits for

Create Date: 2026-11-24 21:00:00
"""

import sqlalchemy as sa
from alembic import op

revision, down_revision, branch_labels, depends_on = '0005', '0004', None, None


def upgrade() -> None:
    with op.batch_alter_table('deployments', schema=None) as batch_op:
        batch_op.add_column(sa.Column('attempts', sa.Integer(), nullable=False, server_default='0'))
        batch_op.add_column(sa.Column('dispatch_seq', sa.Integer(), nullable=False, server_default='0'))
        batch_op.add_column(sa.Column('due_at', sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column('heartbeat_at', sa.DateTime(timezone=True), nullable=True))
        batch_op.create_index('ix_deployments_status_due', ['status', 'due_at'], unique=False)

    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('deployment_id', sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column('dispatch_seq', sa.Integer(), nullable=False, server_default='0'))
        batch_op.add_column(sa.Column('queued_at', sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column('due_at', sa.DateTime(timezone=True), nullable=True))
        batch_op.create_foreign_key(batch_op.f('fk_jobs_deployment_id_deployments'), 'deployments',
                                    ['deployment_id'], ['id'], ondelete='SET NULL')
        batch_op.create_index('ix_jobs_state_due', ['state', 'due_at'], unique=False)
    # Jobs queued before this revision: due now, so the first reconcile sends them.
    op.execute("UPDATE jobs SET queued_at = created_at, due_at = created_at WHERE state = 'queued'")


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_index('ix_jobs_state_due')
        batch_op.drop_constraint(batch_op.f('fk_jobs_deployment_id_deployments'), type_='foreignkey')
        batch_op.drop_column('due_at')
        batch_op.drop_column('queued_at')
        batch_op.drop_column('dispatch_seq')
        batch_op.drop_column('deployment_id')

    with op.batch_alter_table('deployments', schema=None) as batch_op:
        batch_op.drop_index('ix_deployments_status_due')
        batch_op.drop_column('heartbeat_at')
        batch_op.drop_column('due_at')
        batch_op.drop_column('dispatch_seq')
        batch_op.drop_column('attempts')
