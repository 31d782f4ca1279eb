"""web transport: browser devices that open the farm's hub over HTTPS themselves (iPhones,
iPads, any browser on the network)

Create Date: 2026-11-25 12:00:00
"""

from alembic import op

revision, down_revision, branch_labels, depends_on = '0014', '0013', None, None


def _transports(*values: str) -> None:
    with op.batch_alter_table('devices', schema=None, recreate='auto') as batch_op:
        batch_op.drop_constraint(op.f('ck_devices_transport'), type_='check')
        batch_op.create_check_constraint(op.f('ck_devices_transport'),
                                         "transport IN (" + ", ".join(f"'{v}'" for v in values) + ")")


def upgrade() -> None:
    _transports('adb', 'http', 'local', 'web')


def downgrade() -> None:
    op.execute("DELETE FROM devices WHERE transport = 'web'")
    _transports('adb', 'http', 'local')
