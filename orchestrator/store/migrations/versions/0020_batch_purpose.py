"""a batch's purpose: "series" (its runs are the series' measurements, analysed when it ends) or
"check" (a farm check's runs, judged by the check alone and never part of a series)

Create Date: 2026-11-28 14:00:00
"""

import sqlalchemy as sa
from alembic import op

revision, down_revision, branch_labels, depends_on = '0020', '0019', None, None


def upgrade() -> None:
    with op.batch_alter_table('batches') as batch:
        batch.add_column(sa.Column('purpose', sa.String(length=16), server_default='series', nullable=False))
    # The checks made before this revision named their batches by their idempotency key.
    op.execute("UPDATE batches SET purpose = 'check' WHERE idempotency_key LIKE 'check:%'")


def downgrade() -> None:
    with op.batch_alter_table('batches') as batch:
        batch.drop_column('purpose')
