"""initial schema

Create Date: 2026-11-21 16:36:38.576282
"""

import sqlalchemy as sa
from alembic import op

revision, down_revision, branch_labels, depends_on = '0001', None, None, None


def upgrade() -> None:
    # Written by autogenerate from orchestrator.store.models, reviewed by hand.
    op.create_table('builds',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=128), nullable=False),
    sa.Column('version', sa.String(length=64), nullable=False),
    sa.Column('source_revision', sa.String(length=128), nullable=False),
    sa.Column('manifest_sha256', sa.String(length=64), nullable=False),
    sa.Column('created', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_builds')),
    sa.UniqueConstraint('manifest_sha256', name=op.f('uq_builds_manifest_sha256')),
    sa.UniqueConstraint('name', name=op.f('uq_builds_name'))
    )
    op.create_table('hosts',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=255), nullable=False),
    sa.Column('last_seen', sa.DateTime(timezone=True), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_hosts')),
    sa.UniqueConstraint('name', name=op.f('uq_hosts_name'))
    )
    op.create_table('schedules',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=255), nullable=False),
    sa.Column('cron', sa.String(length=255), nullable=False),
    sa.Column('timezone', sa.String(length=64), nullable=False),
    sa.Column('enabled', sa.Boolean(), nullable=False),
    sa.Column('suite', sa.JSON(), nullable=False),
    sa.Column('last_run_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_schedules')),
    sa.UniqueConstraint('name', name=op.f('uq_schedules_name'))
    )
    op.create_table('build_files',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('build_id', sa.Integer(), nullable=False),
    sa.Column('path', sa.String(length=1024), nullable=False),
    sa.Column('sha256', sa.String(length=64), nullable=False),
    sa.Column('size', sa.BigInteger(), nullable=False),
    sa.Column('mode', sa.Integer(), nullable=False),
    sa.ForeignKeyConstraint(['build_id'], ['builds.id'], name=op.f('fk_build_files_build_id_builds'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_build_files')),
    sa.UniqueConstraint('build_id', 'path', name=op.f('uq_build_files_build_id_path'))
    )
    op.create_index(op.f('ix_build_files_sha256'), 'build_files', ['sha256'], unique=False)
    op.create_table('devices',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('serial', sa.String(length=255), nullable=False),
    sa.Column('host_id', sa.Integer(), nullable=True),
    sa.Column('transport', sa.Enum('adb', 'http', 'local', name='transport', native_enum=False, create_constraint=True, length=13), nullable=False),
    sa.Column('address', sa.String(length=255), nullable=False),
    sa.Column('model', sa.String(length=255), nullable=False),
    sa.Column('manufacturer', sa.String(length=255), nullable=False),
    sa.Column('os', sa.String(length=64), nullable=False),
    sa.Column('os_version', sa.String(length=255), nullable=False),
    sa.Column('gpu_vendor', sa.String(length=255), nullable=False),
    sa.Column('gpu_architecture', sa.String(length=255), nullable=False),
    sa.Column('gpu_device', sa.String(length=255), nullable=False),
    sa.Column('gpu_driver', sa.String(length=255), nullable=False),
    sa.Column('gpu_backend', sa.String(length=64), nullable=False),
    sa.Column('virtual', sa.Boolean(), nullable=False),
    sa.Column('info', sa.JSON(), nullable=True),
    sa.Column('state', sa.Enum('available', 'busy', 'offline', 'unauthorized', 'quarantined', name='state', native_enum=False, create_constraint=True, length=20), nullable=False),
    sa.Column('state_reason', sa.Text(), nullable=False),
    sa.Column('last_seen', sa.DateTime(timezone=True), nullable=True),
    sa.Column('lease_holder', sa.String(length=255), nullable=True),
    sa.Column('lease_until', sa.DateTime(timezone=True), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['host_id'], ['hosts.id'], name=op.f('fk_devices_host_id_hosts'), ondelete='SET NULL'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_devices')),
    sa.UniqueConstraint('serial', name=op.f('uq_devices_serial'))
    )
    op.create_table('deployments',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('build_id', sa.Integer(), nullable=False),
    sa.Column('device_id', sa.Integer(), nullable=False),
    sa.Column('status', sa.Enum('pending', 'running', 'succeeded', 'failed', name='status', native_enum=False, create_constraint=True, length=17), nullable=False),
    sa.Column('bytes_sent', sa.BigInteger(), nullable=False),
    sa.Column('files_sent', sa.Integer(), nullable=False),
    sa.Column('files_skipped', sa.Integer(), nullable=False),
    sa.Column('duration_s', sa.Double(), nullable=True),
    sa.Column('error', sa.Text(), nullable=True),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['build_id'], ['builds.id'], name=op.f('fk_deployments_build_id_builds'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['device_id'], ['devices.id'], name=op.f('fk_deployments_device_id_devices'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_deployments'))
    )
    op.create_index('ix_deployments_device_build', 'deployments', ['device_id', 'build_id'], unique=False)
    op.create_table('jobs',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('kind', sa.Enum('generate', 'latency', 'tune', name='kind', native_enum=False, create_constraint=True, length=16), nullable=False),
    sa.Column('spec', sa.JSON(), nullable=False),
    sa.Column('device_id', sa.Integer(), nullable=False),
    sa.Column('build_id', sa.Integer(), nullable=True),
    sa.Column('schedule_id', sa.Integer(), nullable=True),
    sa.Column('state', sa.Enum('queued', 'running', 'succeeded', 'failed', 'infra_failed', 'cancelled', name='state', native_enum=False, create_constraint=True, length=20), nullable=False),
    sa.Column('attempts', sa.Integer(), nullable=False),
    sa.Column('idempotency_key', sa.String(length=255), nullable=True),
    sa.Column('worker', sa.String(length=255), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('heartbeat_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('log_tail', sa.Text(), nullable=False),
    sa.Column('error', sa.Text(), nullable=True),
    sa.ForeignKeyConstraint(['build_id'], ['builds.id'], name=op.f('fk_jobs_build_id_builds'), ondelete='SET NULL'),
    sa.ForeignKeyConstraint(['device_id'], ['devices.id'], name=op.f('fk_jobs_device_id_devices'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['schedule_id'], ['schedules.id'], name=op.f('fk_jobs_schedule_id_schedules'), ondelete='SET NULL'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_jobs')),
    sa.UniqueConstraint('idempotency_key', name=op.f('uq_jobs_idempotency_key'))
    )
    op.create_index('ix_jobs_device_created', 'jobs', ['device_id', 'created_at'], unique=False)
    op.create_index('ix_jobs_state_heartbeat', 'jobs', ['state', 'heartbeat_at'], unique=False)
    op.create_table('profiles',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=255), nullable=False),
    sa.Column('sha256', sa.String(length=64), nullable=False),
    sa.Column('gpu_vendor', sa.String(length=255), nullable=False),
    sa.Column('gpu_architecture', sa.String(length=255), nullable=False),
    sa.Column('gpu_device', sa.String(length=255), nullable=False),
    sa.Column('tuned_on_device_id', sa.Integer(), nullable=True),
    sa.Column('data', sa.JSON(), nullable=False),
    sa.Column('created', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['tuned_on_device_id'], ['devices.id'], name=op.f('fk_profiles_tuned_on_device_id_devices'), ondelete='SET NULL'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_profiles')),
    sa.UniqueConstraint('name', 'sha256', name=op.f('uq_profiles_name_sha256'))
    )
    op.create_table('runs',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('job_id', sa.Integer(), nullable=False),
    sa.Column('attempt', sa.Integer(), nullable=False),
    sa.Column('device_id', sa.Integer(), nullable=False),
    sa.Column('build_id', sa.Integer(), nullable=True),
    sa.Column('status', sa.Enum('succeeded', 'failed', name='status', native_enum=False, create_constraint=True, length=17), nullable=False),
    sa.Column('error', sa.Text(), nullable=True),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('adapter', sa.String(length=255), nullable=False),
    sa.Column('engine', sa.JSON(), nullable=False),
    sa.Column('cooldown_wait_s', sa.Double(), nullable=True),
    sa.Column('cooldown_timed_out', sa.Boolean(), nullable=False),
    sa.Column('artifacts', sa.JSON(), nullable=False),
    sa.Column('log_tail', sa.Text(), nullable=False),
    sa.ForeignKeyConstraint(['build_id'], ['builds.id'], name=op.f('fk_runs_build_id_builds'), ondelete='SET NULL'),
    sa.ForeignKeyConstraint(['device_id'], ['devices.id'], name=op.f('fk_runs_device_id_devices'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_runs_job_id_jobs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_runs')),
    sa.UniqueConstraint('job_id', 'attempt', name=op.f('uq_runs_job_id_attempt'))
    )
    op.create_index('ix_runs_build', 'runs', ['build_id'], unique=False)
    op.create_index('ix_runs_device_build', 'runs', ['device_id', 'build_id'], unique=False)
    op.create_table('images',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('path', sa.String(length=1024), nullable=False),
    sa.Column('sha256', sa.String(length=64), nullable=False),
    sa.Column('size', sa.BigInteger(), nullable=False),
    sa.Column('prompt', sa.Text(), nullable=False),
    sa.Column('seed', sa.BigInteger(), nullable=True),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_images_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_images'))
    )
    op.create_index('ix_images_run', 'images', ['run_id'], unique=False)
    op.create_table('kernel_timings',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('kernel', sa.String(length=255), nullable=False),
    sa.Column('calls', sa.Integer(), nullable=False),
    sa.Column('total_ms', sa.Double(), nullable=False),
    sa.Column('repetition', sa.Integer(), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_kernel_timings_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_kernel_timings'))
    )
    op.create_index('ix_kernel_timings_kernel_run', 'kernel_timings', ['kernel', 'run_id'], unique=False)
    op.create_index('ix_kernel_timings_run', 'kernel_timings', ['run_id'], unique=False)
    op.create_table('samples',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('metric', sa.String(length=128), nullable=False),
    sa.Column('unit', sa.String(length=32), nullable=False),
    sa.Column('value', sa.Double(), nullable=False),
    sa.Column('repetition', sa.Integer(), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_samples_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_samples'))
    )
    op.create_index('ix_samples_metric_run', 'samples', ['metric', 'run_id'], unique=False)
    op.create_index('ix_samples_run', 'samples', ['run_id'], unique=False)
    op.create_table('thermal_readings',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('phase', sa.String(length=16), nullable=False),
    sa.Column('zone', sa.String(length=255), nullable=False),
    sa.Column('celsius', sa.Double(), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_thermal_readings_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_thermal_readings'))
    )
    op.create_index('ix_thermal_readings_run', 'thermal_readings', ['run_id'], unique=False)


def downgrade() -> None:
    # Written by autogenerate from orchestrator.store.models, reviewed by hand.
    op.drop_index('ix_thermal_readings_run', table_name='thermal_readings')
    op.drop_table('thermal_readings')
    op.drop_index('ix_samples_run', table_name='samples')
    op.drop_index('ix_samples_metric_run', table_name='samples')
    op.drop_table('samples')
    op.drop_index('ix_kernel_timings_run', table_name='kernel_timings')
    op.drop_index('ix_kernel_timings_kernel_run', table_name='kernel_timings')
    op.drop_table('kernel_timings')
    op.drop_index('ix_images_run', table_name='images')
    op.drop_table('images')
    op.drop_index('ix_runs_device_build', table_name='runs')
    op.drop_index('ix_runs_build', table_name='runs')
    op.drop_table('runs')
    op.drop_table('profiles')
    op.drop_index('ix_jobs_state_heartbeat', table_name='jobs')
    op.drop_index('ix_jobs_device_created', table_name='jobs')
    op.drop_table('jobs')
    op.drop_index('ix_deployments_device_build', table_name='deployments')
    op.drop_table('deployments')
    op.drop_table('devices')
    op.drop_index(op.f('ix_build_files_sha256'), table_name='build_files')
    op.drop_table('build_files')
    op.drop_table('schedules')
    op.drop_table('hosts')
    op.drop_table('builds')
