"""query indexes: jobs by state newest first, jobs by build

Measured with benchmarks/store_scale.py (200 devices, 1,000 builds, 1,000,000 samples):
`farm jobs list --state succeeded` sorted every succeeded job by id (ix_jobs_state_heartbeat
is not in id order), and `--build` scanned the jobs table, which had no index on build_id
(also what ON DELETE SET NULL of a build walks).

Create Date: 2026-11-21 17:20:00.000000
"""

from alembic import op

revision, down_revision, branch_labels, depends_on = '0003', '0002', None, None


def upgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.create_index('ix_jobs_state_id', ['state', 'id'], unique=False)
        batch_op.create_index('ix_jobs_build', ['build_id'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_index('ix_jobs_build')
        batch_op.drop_index('ix_jobs_state_id')
