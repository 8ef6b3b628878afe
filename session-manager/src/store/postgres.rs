//! The PostgreSQL [`Store`](super::Store), for sites that run the manager beside a database
//! server (or several manager replicas against one): the same tables, columns and behaviour as
//! [`super::sqlite`], with the migrations of `session-manager/migrations-postgres/` (each the port
//! of the SQLite file of the same name) applied when the store is opened. The statements are the
//! shared ones of [`sql`] (this module compiles that folder against PostgreSQL); what is
//! PostgreSQL's own is here: connecting, the write lock, snapshots, the replicas' notifications
//! and the active-manager lock ([`active`]).
//!
//! Writers are serialised as in SQLite: every write transaction first takes one transaction-scoped
//! advisory lock ([`WRITE_LOCK`]), the counterpart of SQLite's `BEGIN IMMEDIATE`, so a
//! read-then-write transaction (a placement, a hold, a connection event) decides on exactly what it
//! writes over, across every connection and every manager replica using the database; a GPU can
//! never be handed out twice. The transactions run at PostgreSQL's default READ COMMITTED, so each
//! statement after the lock sees everything committed before it; reads outside a write never wait.
//! A write transaction runs on one of the writers' connections ([`WRITE_CONNECTIONS`]), waiting for
//! one as long as sqlx's pool lets it (30 s), then at most `lock_timeout` ([`LOCK_TIMEOUT`]) for
//! the lock, like SQLite's busy timeout. Times are the same fixed-width RFC 3339 text, in `TEXT
//! COLLATE "C"` columns so that they and every other text sort byte-wise, as in SQLite.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::{Connection, Postgres, Transaction};

use super::StoreResult;

/// What the shared statements of [`sql`] are compiled against here.
type Db = Postgres;
type DbRow = sqlx::postgres::PgRow;
type DbConnection = sqlx::PgConnection;
type SqlStore = PostgresStore;
/// The larger of two values.
const GREATEST: &str = "GREATEST";
/// A job's history as one JSON array, oldest first, of `[from, to, at, reason]`
/// (`sql::jobs::read_stamped_jobs`).
const JOB_HISTORY: &str = "(SELECT json_agg(json_build_array(t.from_state, t.to_state, t.at, \
     t.reason::json) ORDER BY t.seq)::text FROM job_transitions t WHERE t.job_id = j.id)";

// The one SQL implementation, compiled here against PostgreSQL (and in the other backend module
// against the other database): loading the same files twice is the point (see sql/mod.rs).
#[allow(clippy::duplicate_mod)]
#[path = "sql/mod.rs"]
mod sql;

/// How long a statement waits for a lock (the write lock, mostly) before giving up: SQLite's
/// busy timeout.
const LOCK_TIMEOUT: Duration = Duration::from_secs(10);

/// The advisory lock every write transaction holds ("ongrid" and 1): one writer at a time.
pub const WRITE_LOCK: i64 = 0x6f6e_6772_6964_0001;

/// Connections per manager for reads, and for the statements that write without the write lock.
const MAX_CONNECTIONS: u32 = 8;

/// Connections per manager for write transactions ([`PostgresStore::write`]). A transaction waits
/// for [`WRITE_LOCK`] holding its connection, so writers on the read pool would take every
/// connection from the API's reads while they queue for the lock; here they queue in the
/// writers' pool instead. Two, so that the next writer already waits in the lock's queue when one
/// commits, and the lock does not stand idle for the next one's `BEGIN`.
const WRITE_CONNECTIONS: u32 = 2;

/// A pooled connection idle for this long is pinged before the pool hands it out, to find one
/// the server or the network dropped meanwhile; one used more recently is handed out as it is.
const PING_WHEN_IDLE_FOR: Duration = Duration::from_secs(1);

/// A pool of `connections`. sqlx pings every idle connection before handing it out (a round trip
/// to the server), which under load doubled the round trips of the API's reads; here only one
/// idle for [`PING_WHEN_IDLE_FOR`] is. A connection the server dropped within that second fails
/// its next statement (that request answers an error to retry) and is closed on its way back,
/// where sqlx's own ping on release fails.
fn pool_options(connections: u32) -> PgPoolOptions {
    PgPoolOptions::new()
        .max_connections(connections)
        .test_before_acquire(false)
        .before_acquire(|connection, meta| {
            Box::pin(async move {
                if meta.idle_for >= PING_WHEN_IDLE_FOR {
                    connection.ping().await?;
                }
                Ok(true)
            })
        })
}

pub use active::ActiveLock;
pub mod active;

/// The channel on which manager replicas tell each other what they committed
/// ([`crate::notify::Remote`] payloads).
pub const REPLICA_CHANNEL: &str = "ongrid_replicas";

/// A connection listening on [`REPLICA_CHANNEL`].
pub struct ReplicaListener {
    listener: sqlx::postgres::PgListener,
}

impl fmt::Debug for ReplicaListener {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ReplicaListener")
    }
}

impl ReplicaListener {
    /// The next notification's payload; `None` when the connection was lost, so notifications
    /// may have been missed (the next call connects again and listens anew).
    pub async fn recv(&mut self) -> StoreResult<Option<String>> {
        Ok(self
            .listener
            .try_recv()
            .await?
            .map(|notification| notification.payload().to_owned()))
    }
}

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations-postgres");

/// The PostgreSQL store. Cheap to clone (the pools are shared).
#[derive(Debug, Clone)]
pub struct PostgresStore {
    pool: PgPool,
    /// Where the write transactions run ([`WRITE_CONNECTIONS`]).
    writer: PgPool,
    /// Where this replica's notifications to the others go ([`Self::publish`]): a connection of
    /// their own, so that a wake of the leader, or its answer, does not wait for one of the
    /// pool's, all taken by the API's reads when a class opens its sessions at once.
    notifier: PgPool,
    /// The nodes and GPUs last read for planning ([`Store::planning_nodes`](super::Store::planning_nodes)).
    inventory: sql::inventory::KeptInventory,
    /// The sessions last read for planning ([`Store::planning_sessions`](super::Store::planning_sessions)).
    planning: sql::planning::KeptSessions,
    /// The jobs last read for planning ([`Store::planning_jobs`](super::Store::planning_jobs)).
    planned_jobs: sql::planning::KeptJobs,
    /// The creates waiting for a write ([`sql::creates`]).
    creates: sql::creates::CreateQueue,
    /// The submits waiting for a write ([`sql::together`]).
    submits: sql::together::WriteQueue<crate::domain::jobs::NewJob>,
    /// The changes of sessions and jobs waiting for a write ([`sql::ChangeQueue`]).
    changes: sql::ChangeQueue,
    /// The syncs' heartbeats, activity samples and jobs' output records waiting for a write
    /// ([`sql::sync_records`]).
    sync_records: sql::sync_records::SyncRecordQueue,
    /// The agents' activity not written yet ([`sql::samples`]).
    samples: sql::samples::Samples,
    /// For the connection that holds [`active::MANAGER_LOCK`].
    options: std::sync::Arc<PgConnectOptions>,
}

impl PostgresStore {
    /// Connects to the database `url` names (`postgres://user@host/db`; libpq's environment
    /// variables and password file fill in what it leaves out) and brings its schema up to date.
    /// The database must exist; the user needs the right to create tables in it.
    pub async fn open(url: &str) -> StoreResult<Self> {
        let options = PgConnectOptions::from_str(url)?.options([
            ("lock_timeout", format!("{}s", LOCK_TIMEOUT.as_secs())),
            // Not the server's notices ("relation ... already exists, skipping") in our log.
            ("client_min_messages", "warning".to_owned()),
        ]);
        let pool = pool_options(MAX_CONNECTIONS)
            .connect_with(options.clone())
            .await?;
        MIGRATOR.run(&pool).await?;
        let writer = pool_options(WRITE_CONNECTIONS)
            .connect_with(options.clone())
            .await?;
        let notifier = pool_options(1).connect_lazy_with(options.clone());
        Ok(Self {
            pool,
            writer,
            notifier,
            inventory: Default::default(),
            planning: Default::default(),
            planned_jobs: Default::default(),
            creates: Default::default(),
            submits: Default::default(),
            changes: Default::default(),
            sync_records: Default::default(),
            samples: Default::default(),
            options: options.into(),
        })
    }

    /// Writes the agents' activity not written yet ([`sql::samples`]), then closes every
    /// connection. Called on shutdown.
    pub async fn close(&self) {
        sql::samples::write_before_closing(self).await;
        self.notifier.close().await;
        self.writer.close().await;
        self.pool.close().await;
    }

    /// Listens on [`REPLICA_CHANNEL`] on a connection of its own (not one of the pool's).
    pub async fn listen(&self) -> StoreResult<ReplicaListener> {
        let own = PgPoolOptions::new()
            .max_connections(1)
            .connect_lazy_with((*self.options).clone());
        let mut listener = sqlx::postgres::PgListener::connect_with(&own).await?;
        listener.listen(REPLICA_CHANNEL).await?;
        Ok(ReplicaListener { listener })
    }

    /// Sends `payloads` to every listener of [`REPLICA_CHANNEL`] (this replica's too), in one
    /// statement, on the notifications' own connection.
    pub async fn publish(&self, payloads: &[String]) -> StoreResult<()> {
        sqlx::query("SELECT pg_notify($1, payload) FROM unnest($2::text[]) AS payload")
            .bind(REPLICA_CHANNEL)
            .bind(payloads)
            .execute(&self.notifier)
            .await?;
        Ok(())
    }

    /// The pool, for the copy from SQLite and the tests that look at rows directly.
    pub(crate) fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Where a statement that writes outside [`Self::write`] runs: the pool, as every statement.
    fn writes(&self) -> &PgPool {
        &self.pool
    }

    /// Begins a write: a transaction holding [`WRITE_LOCK`], on a writer's connection.
    async fn write(&self) -> StoreResult<Transaction<'static, Postgres>> {
        let mut tx = self.writer.begin().await?;
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(WRITE_LOCK)
            .execute(&mut *tx)
            .await?;
        Ok(tx)
    }

    /// Begins a read that sees one snapshot throughout.
    async fn read_snapshot(&self) -> StoreResult<Transaction<'static, Postgres>> {
        Ok(self
            .pool
            .begin_with("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
            .await?)
    }
}
