"""Engines and sessions for the store. SQLite gets the settings that make it a safe multi-process
store: WAL (readers never block the writer), foreign keys enforced, a busy timeout instead of
instant "database is locked", and BEGIN IMMEDIATE so a transaction takes the write lock up front
(pysqlite's deferred BEGIN lets a read-then-write transaction fail with SQLITE_BUSY without
waiting, and leaves SAVEPOINTs broken).

The price of BEGIN IMMEDIATE: on SQLite every open transaction, even one that only reads, holds
the write lock until it ends. Keep transactions short and never hold one across a device
operation (a deploy, a job): commit, talk to the device, then open a new one. That is the rule
for PostgreSQL too, where an idle transaction holds its row locks."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, DataError, SQLAlchemyError, StatementError
from sqlalchemy.orm import Session, sessionmaker

SQLITE_BUSY_TIMEOUT_MS = 30_000
# What a database that cannot be reached or read raises, named for the layers above the store.
DatabaseError = SQLAlchemyError
# The layers above the store name a session and a session factory by these (they import no SQL).
SessionFactory = sessionmaker
# StatementError (imported above, named for the layers above the store) is what a statement the
# database could not run raises, a DatabaseError; refused_value tells the request's fault (a bad
# value) from the server's.


def refused_value(error: StatementError) -> str | None:
    """What the database said, in one line, when `error` is a value of the statement it cannot take
    (out of range, a character it refuses: DataError, or the driver's ValueError or OverflowError
    before the statement was sent); None when `error` is about anything else."""
    if isinstance(error, DataError) or isinstance(error.orig, ValueError | OverflowError):
        return str(error.orig).splitlines()[0]
    return None


def check_url(url: str) -> None:
    """ValueError unless `url` is a database URL the store can read."""
    try:
        make_url(url)
    except ArgumentError:
        raise ValueError(f"{url!r} is not a database URL") from None


def safe_url(url: str) -> str:
    """`url` with any password hidden (as given when it cannot be read as a URL)."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001
        return url


def make_unpooled_engine(url: str, timeout_s: float) -> Engine:
    """An engine that keeps no connection between transactions and, on PostgreSQL, gives up
    connecting, or waiting on the network, after `timeout_s`: for a thread of a process that
    forks (a Celery worker's main process: no pooled connection for a child to inherit) and that
    must not hang on a network that drops everything (a host cut off from the database)."""
    from sqlalchemy.pool import NullPool

    kwargs: dict = {"poolclass": NullPool}
    if make_url(url).get_backend_name() == "postgresql":
        kwargs["connect_args"] = {"connect_timeout": max(1, round(timeout_s)),
                                  "tcp_user_timeout": round(timeout_s * 1000)}
    return make_engine(url, **kwargs)


def make_engine(url: str, *, idle_transaction_s: float | None = None, **kwargs) -> Engine:
    """An engine for `url`; a SQLite file's folder is created when missing. With
    `idle_transaction_s`, on PostgreSQL, the server ends any session of this engine that sits
    idle inside a transaction that long (idle_in_transaction_session_timeout), releasing its row
    locks: a process cut off from the database between two statements of a transaction (a host's
    link down after its COMMIT left and before the answer came back) otherwise keeps the rows
    it wrote locked until the server's TCP keepalive gives up, hours later, and every other
    worker's reconciler and health check waits on them meanwhile. On SQLite a dead process's
    lock goes with the process."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        kwargs.setdefault("pool_pre_ping", True)
        if idle_transaction_s is not None:
            connect_args = kwargs.setdefault("connect_args", {})
            timeout = f"-c idle_in_transaction_session_timeout={max(1, round(idle_transaction_s * 1000))}"
            connect_args["options"] = f"{connect_args.get('options', '')} {timeout}".strip()
        return create_engine(parsed, **kwargs)

    database = parsed.database or ""
    if database and database != ":memory:" and not database.startswith("file:"):
        Path(database).expanduser().parent.mkdir(parents=True, exist_ok=True)
    connect_args = kwargs.pop("connect_args", {})
    connect_args.setdefault("timeout", SQLITE_BUSY_TIMEOUT_MS / 1000)
    engine = create_engine(parsed, connect_args=connect_args, **kwargs)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection, _record):
        dbapi_connection.isolation_level = None  # we issue BEGIN ourselves (see below)
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA synchronous=NORMAL")  # durable with WAL except on power loss
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection):
        # A read-only snapshot (read_snapshot) begins deferred: under WAL it reads a consistent
        # snapshot and takes no lock, so long reads never keep a writer waiting.
        connection.exec_driver_sql("BEGIN" if connection.get_execution_options().get(SNAPSHOT_OPTION)
                                   else "BEGIN IMMEDIATE")

    return engine


SNAPSHOT_OPTION = "farm_read_snapshot"


def read_snapshot(session: Session) -> None:
    """Make the session's transaction a read-only snapshot: call it first thing inside
    `session.begin()`, before any statement. On SQLite it then begins deferred and holds no write lock
    while it reads (a write in it would fail rather than wait: read only); on PostgreSQL every
    transaction reads a snapshot anyway. For long reads, such as an analysis' scan of a whole
    history; what they find is written afterwards in a short transaction of its own."""
    session.connection(execution_options={SNAPSHOT_OPTION: True})


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    """Sessions that keep loaded objects usable after commit (the CLI prints them)."""
    return sessionmaker(engine, expire_on_commit=False)
