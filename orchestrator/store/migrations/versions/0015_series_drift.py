"""series drift: a per-series prior on the run-to-run drift, used until the series' history is
long enough to estimate its own (a series setting may now hold a drift, a minimum effect or both)

Create Date: 2026-11-27 15:00:00
"""

import sqlalchemy as sa
from alembic import op

revision, down_revision, branch_labels, depends_on = '0015', '0014', None, None


def upgrade() -> None:
    with op.batch_alter_table('series_settings', schema=None) as batch_op:
        batch_op.add_column(sa.Column('drift', sa.Double(), nullable=True))
        batch_op.alter_column('min_effect', existing_type=sa.Double(), nullable=True)


def downgrade() -> None:
    op.execute("DELETE FROM series_settings WHERE min_effect IS NULL")
    with op.batch_alter_table('series_settings', schema=None) as batch_op:
        batch_op.alter_column('min_effect', existing_type=sa.Double(), nullable=False)
        batch_op.drop_column('drift')
