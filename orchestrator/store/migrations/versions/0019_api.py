"""the farm API: bearer tokens (only their sha256 and a short prefix kept) with a scope, and the
checks started through it, with their state, progress, exit code and report

Create Date: 2026-11-28 14:00:00
"""

import sqlalchemy as sa
from alembic import op

revision, down_revision, branch_labels, depends_on = '0019', '0018', None, None


def upgrade() -> None:
    op.create_table(
        'api_tokens',
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('name', sa.String(length=255), nullable=False),
        sa.Column('scope', sa.Enum('read', 'triage', 'run', name='scope', native_enum=False,
                                   create_constraint=True, length=14), nullable=False),
        sa.Column('prefix', sa.String(length=16), nullable=False),
        sa.Column('sha256', sa.String(length=64), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('last_used_at', sa.DateTime(timezone=True), nullable=True),
        sa.Column('revoked_at', sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_api_tokens')),
        sa.UniqueConstraint('sha256', name=op.f('uq_api_tokens_sha256')),
    )
    op.create_table(
        'check_runs',
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('state', sa.Enum('running', 'done', 'bad_input', 'failed', 'interrupted', name='state',
                                   native_enum=False, create_constraint=True, length=19), nullable=False),
        sa.Column('request', sa.JSON(), nullable=False),
        sa.Column('progress', sa.Text(), nullable=False),
        sa.Column('exit_code', sa.Integer(), nullable=True),
        sa.Column('outcome', sa.String(length=32), nullable=True),
        sa.Column('report', sa.JSON(), nullable=True),
        sa.Column('error', sa.Text(), nullable=True),
        sa.Column('token_id', sa.Integer(), nullable=True),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(['token_id'], ['api_tokens.id'], name=op.f('fk_check_runs_token_id_api_tokens'),
                                ondelete='SET NULL'),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_check_runs')),
    )
    op.create_index('ix_check_runs_state', 'check_runs', ['state'], unique=False)


def downgrade() -> None:
    op.drop_index('ix_check_runs_state', table_name='check_runs')
    op.drop_table('check_runs')
    op.drop_table('api_tokens')
