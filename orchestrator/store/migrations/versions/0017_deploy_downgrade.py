"""deployments: whether a build older than the device's current one may become current
(`farm deploy --allow-downgrade`), and a note on what an install did besides succeeding
(an older build installed beside the current one, which stays)

Create Date: 2026-11-27 18:45:00
"""

import sqlalchemy as sa
from alembic import op

revision, down_revision, branch_labels, depends_on = '0017', '0016', None, None


def upgrade() -> None:
    with op.batch_alter_table('deployments', schema=None) as batch_op:
        batch_op.add_column(sa.Column('allow_downgrade', sa.Boolean(), nullable=False, server_default=sa.false()))
        batch_op.add_column(sa.Column('note', sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('deployments', schema=None) as batch_op:
        batch_op.drop_column('note')
        batch_op.drop_column('allow_downgrade')
