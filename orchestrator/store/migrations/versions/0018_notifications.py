"""notifications: subscriptions (`farm notify add`: a webhook, Slack or email target and its
filters) and one delivery row per event and subscription, unique, with its state, attempts,
last error and back-off

Create Date: 2026-11-28 09:50:00
"""

import sqlalchemy as sa
from alembic import op

revision, down_revision, branch_labels, depends_on = '0018', '0017', None, None


def upgrade() -> None:
    op.create_table(
        'notification_subscriptions',
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('kind', sa.Enum('webhook', 'slack', 'email', name='kind', native_enum=False,
                                  create_constraint=True, length=15), nullable=False),
        sa.Column('target', sa.Text(), nullable=False),
        sa.Column('secret', sa.String(length=128), nullable=False),
        sa.Column('devices', sa.JSON(), nullable=False),
        sa.Column('metrics', sa.JSON(), nullable=False),
        sa.Column('alert_kinds', sa.JSON(), nullable=False),
        sa.Column('min_severity', sa.String(length=16), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_notification_subscriptions')),
    )
    op.create_table(
        'notification_deliveries',
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('subscription_id', sa.Integer(), nullable=False),
        sa.Column('event_key', sa.String(length=255), nullable=False),
        sa.Column('event', sa.JSON(), nullable=False),
        sa.Column('state', sa.Enum('pending', 'delivered', 'failed', name='state', native_enum=False,
                                   create_constraint=True, length=17), nullable=False),
        sa.Column('attempts', sa.Integer(), nullable=False),
        sa.Column('last_error', sa.Text(), nullable=False),
        sa.Column('next_attempt_at', sa.DateTime(timezone=True), nullable=True),
        sa.Column('claimed_until', sa.DateTime(timezone=True), nullable=True),
        sa.Column('delivered_at', sa.DateTime(timezone=True), nullable=True),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(['subscription_id'], ['notification_subscriptions.id'],
                                name=op.f('fk_notification_deliveries_subscription_id_notification_subscriptions'),
                                ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_notification_deliveries')),
        sa.UniqueConstraint('event_key', 'subscription_id',
                            name=op.f('uq_notification_deliveries_event_key_subscription_id')),
    )
    op.create_index('ix_notification_deliveries_state_next', 'notification_deliveries',
                    ['state', 'next_attempt_at'], unique=False)
    op.create_index(op.f('ix_notification_deliveries_subscription_id'), 'notification_deliveries',
                    ['subscription_id'], unique=False)


def downgrade() -> None:
    op.drop_index(op.f('ix_notification_deliveries_subscription_id'), table_name='notification_deliveries')
    op.drop_index('ix_notification_deliveries_state_next', table_name='notification_deliveries')
    op.drop_table('notification_deliveries')
    op.drop_table('notification_subscriptions')
