"""series verdict: each series' newest comparison as the batch analysis made it (its verdict,
ratio and interval against its baseline: orchestrator/analysis/series_state.py record_verdict),
so that the overview and the series pages show inconclusive and unchanged series as they are
without comparing anything when a page loads. Filled here from the comparisons the analysed
batches' summaries hold (summary.analysis.comparisons), the newest build's per series; a series
none of them compared reads "not analysed" until its next batch is analysed.

Create Date: 2026-12-06 11:10:00
"""

import hashlib
import json

import sqlalchemy as sa
from alembic import op

revision, down_revision, branch_labels, depends_on = '0026', '0025', None, None

DECIDED_OR_NOT = ("regression", "improvement", "same", "inconclusive")


def upgrade() -> None:
    with op.batch_alter_table('series', schema=None) as batch_op:
        batch_op.add_column(sa.Column('verdict', sa.JSON(), nullable=True))
    _fill(op.get_bind())


def _series_id(key: dict) -> str:
    """A series' id from its key as a comparison stores it (SeriesKey.as_dict): this revision's
    copy of analysis.keys.series_ident (the store's migrations import no analysis)."""
    if not isinstance(key, dict) or not key.get("device") or not key.get("metric"):
        raise ValueError(f"not a series key: {key!r}")
    data = {k: v for k, v in key.items() if k != "environment" or v}
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def _fill(bind) -> None:
    """Each series' newest verdict from the stored batch summaries, as record_verdict keeps it."""
    from orchestrator.store.models import UTCDateTime
    from orchestrator.store.series_state import newer_verdict, verdict_of

    batches = sa.table('batches', sa.column('id', sa.Integer()), sa.column('summary', sa.JSON()))
    builds = sa.table('builds', sa.column('id', sa.Integer()), sa.column('name', sa.String()),
                      sa.column('created', UTCDateTime()))
    series = sa.table('series', sa.column('id', sa.String()), sa.column('verdict', sa.JSON()))
    by_name = {name: (build_id, name, created)
               for build_id, name, created in bind.execute(sa.select(builds.c.id, builds.c.name, builds.c.created))}
    known = set(bind.scalars(sa.select(series.c.id)))
    newest: dict[str, dict] = {}
    for (summary,) in bind.execute(sa.select(batches.c.summary).where(batches.c.summary.isnot(None))
                                   .order_by(batches.c.id)):
        analysis = summary.get("analysis") if isinstance(summary, dict) else None
        if not isinstance(analysis, dict):
            continue
        for result in analysis.get("comparisons", []):
            candidate, baseline = by_name.get(result.get("candidate_build")), by_name.get(result.get("baseline_build"))
            if result.get("verdict") not in DECIDED_OR_NOT or not candidate or not baseline:
                continue
            try:
                ident, verdict = _series_id(result.get("series")), verdict_of(result, candidate, baseline[:2])
            except (KeyError, TypeError, ValueError):  # a summary an older version wrote differently
                continue
            if ident in known and newer_verdict(newest.get(ident), verdict):
                newest[ident] = verdict
    for ident, verdict in newest.items():
        bind.execute(series.update().where(series.c.id == ident).values(verdict=verdict))


def downgrade() -> None:
    with op.batch_alter_table('series', schema=None) as batch_op:
        batch_op.drop_column('verdict')
