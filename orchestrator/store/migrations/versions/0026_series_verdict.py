"""series verdict: each series' newest comparison as the batch analysis made it (its verdict,
ratio and interval against its baseline: orchestrator/analysis/series_state.py record_verdict),
so that the overview and the series pages show inconclusive and unchanged series as they are
without comparing anything when a page loads. Empty until a batch is analysed after this
migration: until then a series with several builds reads "not analysed".

Create Date: 2026-12-06 11:10:00
"""

import sqlalchemy as sa
from alembic import op

revision, down_revision, branch_labels, depends_on = '0026', '0025', None, None


def upgrade() -> None:
    with op.batch_alter_table('series', schema=None) as batch_op:
        batch_op.add_column(sa.Column('verdict', sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('series', schema=None) as batch_op:
        batch_op.drop_column('verdict')
