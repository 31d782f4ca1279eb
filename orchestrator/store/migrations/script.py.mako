"""${message}

Create Date: ${create_date}
"""

import sqlalchemy as sa
from alembic import op
${imports if imports else ""}

revision, down_revision, branch_labels, depends_on = ${repr(up_revision)}, ${repr(down_revision)}, ${repr(branch_labels)}, ${repr(depends_on)}


def upgrade() -> None:
    ${upgrades if upgrades else "pass"}


def downgrade() -> None:
    ${downgrades if downgrades else "pass"}
