"""engine host and executor: a device's `runtime` column is its `engine_host` (python or
browser: what hosts the engine on it), and a job's stored spec names its `executor` (native,
plan or browser; the spec's former `engine_runtime`), browser for the jobs of browser devices,
which until now were told so only when they ran

Create Date: 2026-12-06 05:00:00
"""

import sqlalchemy as sa
from alembic import op

revision, down_revision, branch_labels, depends_on = '0022', '0021', None, None

devices = sa.table('devices', sa.column('id', sa.Integer), sa.column('engine_host', sa.String))
jobs = sa.table('jobs', sa.column('id', sa.Integer), sa.column('device_id', sa.Integer), sa.column('spec', sa.JSON))


def upgrade() -> None:
    with op.batch_alter_table('devices', schema=None) as batch_op:
        batch_op.alter_column('runtime', new_column_name='engine_host', existing_type=sa.String(length=16),
                              existing_nullable=False, existing_server_default='python')
    bind = op.get_bind()
    browsers = set(bind.scalars(sa.select(devices.c.id).where(devices.c.engine_host == 'browser')))
    for job_id, device_id, spec in bind.execute(sa.select(jobs.c.id, jobs.c.device_id, jobs.c.spec)).all():
        new = dict(spec or {})
        executor = new.pop('engine_runtime', None)
        new['executor'] = 'browser' if device_id in browsers else (executor or new.get('executor') or 'native')
        if new != spec:
            bind.execute(sa.update(jobs).where(jobs.c.id == job_id).values(spec=new))


def downgrade() -> None:
    bind = op.get_bind()
    for job_id, spec in bind.execute(sa.select(jobs.c.id, jobs.c.spec)).all():
        new = dict(spec or {})
        executor = new.pop('executor', None)
        if executor not in (None, 'native'):
            new['engine_runtime'] = executor
        if new != spec:
            bind.execute(sa.update(jobs).where(jobs.c.id == job_id).values(spec=new))
    with op.batch_alter_table('devices', schema=None) as batch_op:
        batch_op.alter_column('engine_host', new_column_name='runtime', existing_type=sa.String(length=16),
                              existing_nullable=False, existing_server_default='python')
