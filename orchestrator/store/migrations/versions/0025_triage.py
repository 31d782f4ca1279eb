"""triage for people: a build's short label; alert groups (one regression: the alerts of one
build pair, with an owner, a bug link and a note) and each alert's group; device reservations
(who holds a device until when); device screenshots (the newest a device page shows). The
alerts already stored join their build pair's group here, as the analysis puts new ones
(orchestrator/store/alerts.py save_alert): one group per (build, baseline) of a regression,
improvement or fidelity alert; a data stoppage has no build and stays alone.

Create Date: 2026-12-06 11:00:00
"""

import sqlalchemy as sa
from alembic import op

revision, down_revision, branch_labels, depends_on = '0025', '0024', None, None


def upgrade() -> None:
    with op.batch_alter_table('builds', schema=None) as batch_op:
        batch_op.add_column(sa.Column('label', sa.String(length=32), nullable=True))
        batch_op.create_unique_constraint(batch_op.f('uq_builds_label'), ['label'])
    op.create_table(
        'alert_groups',
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('build_id', sa.Integer(), nullable=True),
        sa.Column('baseline_build_id', sa.Integer(), nullable=True),
        sa.Column('owner', sa.String(length=255), nullable=False),
        sa.Column('bug_url', sa.String(length=1024), nullable=False),
        sa.Column('note', sa.Text(), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(['build_id'], ['builds.id'], name=op.f('fk_alert_groups_build_id_builds'),
                                ondelete='CASCADE'),
        sa.ForeignKeyConstraint(['baseline_build_id'], ['builds.id'],
                                name=op.f('fk_alert_groups_baseline_build_id_builds'), ondelete='SET NULL'),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_alert_groups')),
    )
    op.create_index('ix_alert_groups_build', 'alert_groups', ['build_id', 'baseline_build_id'])
    with op.batch_alter_table('alerts', schema=None) as batch_op:
        batch_op.add_column(sa.Column('group_id', sa.Integer(), nullable=True))
        batch_op.create_foreign_key(batch_op.f('fk_alerts_group_id_alert_groups'), 'alert_groups',
                                    ['group_id'], ['id'], ondelete='SET NULL')
        batch_op.create_index(batch_op.f('ix_alerts_group_id'), ['group_id'], unique=False)
    _group_stored_alerts()
    op.create_table(
        'device_reservations',
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('device_id', sa.Integer(), nullable=False),
        sa.Column('holder', sa.String(length=255), nullable=False),
        sa.Column('note', sa.Text(), nullable=False),
        sa.Column('starts_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('until', sa.DateTime(timezone=True), nullable=False),
        sa.Column('released_at', sa.DateTime(timezone=True), nullable=True),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(['device_id'], ['devices.id'],
                                name=op.f('fk_device_reservations_device_id_devices'), ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_device_reservations')),
    )
    op.create_index('ix_device_reservations_device_until', 'device_reservations', ['device_id', 'until'])
    op.create_table(
        'device_screenshots',
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('device_id', sa.Integer(), nullable=False),
        sa.Column('path', sa.String(length=1024), nullable=False),
        sa.Column('sha256', sa.String(length=64), nullable=False),
        sa.Column('size', sa.BigInteger(), nullable=False),
        sa.Column('width', sa.Integer(), nullable=False),
        sa.Column('height', sa.Integer(), nullable=False),
        sa.Column('source', sa.String(length=16), nullable=False),
        sa.Column('taken_at', sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(['device_id'], ['devices.id'],
                                name=op.f('fk_device_screenshots_device_id_devices'), ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_device_screenshots')),
    )
    op.create_index('ix_device_screenshots_device_taken', 'device_screenshots', ['device_id', 'taken_at'])


GROUPED_KINDS = ('regression', 'improvement', 'fidelity')


def _group_stored_alerts() -> None:
    conn = op.get_bind()
    alerts = sa.table('alerts', sa.column('id'), sa.column('kind'), sa.column('build_id'),
                      sa.column('baseline_build_id'), sa.column('group_id'), sa.column('created_at'))
    groups = sa.table('alert_groups', sa.column('id'), sa.column('build_id'), sa.column('baseline_build_id'),
                      sa.column('owner'), sa.column('bug_url'), sa.column('note'), sa.column('created_at'),
                      sa.column('updated_at'))
    grouped = sa.and_(alerts.c.build_id.is_not(None), alerts.c.kind.in_(GROUPED_KINDS))
    pairs = conn.execute(sa.select(alerts.c.build_id, alerts.c.baseline_build_id, sa.func.min(alerts.c.created_at))
                         .where(grouped).group_by(alerts.c.build_id, alerts.c.baseline_build_id)
                         .order_by(sa.func.min(alerts.c.id))).all()
    for build_id, baseline_build_id, first in pairs:
        group_id = conn.execute(groups.insert().values(
            build_id=build_id, baseline_build_id=baseline_build_id, owner='', bug_url='', note='',
            created_at=first, updated_at=first).returning(groups.c.id)).scalar_one()
        same_baseline = (alerts.c.baseline_build_id.is_(None) if baseline_build_id is None
                         else alerts.c.baseline_build_id == baseline_build_id)
        conn.execute(alerts.update().where(grouped, alerts.c.build_id == build_id, same_baseline)
                     .values(group_id=group_id))


def downgrade() -> None:
    op.drop_index('ix_device_screenshots_device_taken', table_name='device_screenshots')
    op.drop_table('device_screenshots')
    op.drop_index('ix_device_reservations_device_until', table_name='device_reservations')
    op.drop_table('device_reservations')
    with op.batch_alter_table('alerts', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_alerts_group_id'))
        batch_op.drop_constraint(batch_op.f('fk_alerts_group_id_alert_groups'), type_='foreignkey')
        batch_op.drop_column('group_id')
    op.drop_index('ix_alert_groups_build', table_name='alert_groups')
    op.drop_table('alert_groups')
    with op.batch_alter_table('builds', schema=None) as batch_op:
        batch_op.drop_constraint(batch_op.f('uq_builds_label'), type_='unique')
        batch_op.drop_column('label')
