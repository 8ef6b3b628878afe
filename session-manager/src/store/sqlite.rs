//! The SQLite [`Store`](super::Store): one file, WAL journal, foreign keys on, migrations from
//! `session-manager/migrations/` applied when the file is opened. The statements are the
//! shared ones of [`sql`](super::sql) (this module compiles that folder against SQLite); what is
//! SQLite's own is here: opening the file, beginning a write, and `MAX` for `GREATEST`.
//!
//! Every write runs in a `BEGIN IMMEDIATE` transaction, which takes SQLite's write lock up front:
//! a read-then-write transaction can then never fail half-way on a lock upgrade, and concurrent
//! writers simply wait (up to the busy timeout). A read of one snapshot is a deferred transaction,
//! which in WAL mode sees one snapshot from its first read on.

use std::path::Path;
use std::time::Duration;

use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};
use sqlx::{Sqlite, Transaction};

use super::StoreResult;

/// How long a statement waits for another connection's write lock before giving up.
const BUSY_TIMEOUT: Duration = Duration::from_secs(10);

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

/// What the shared statements of [`sql`] are compiled against here.
type Db = Sqlite;
type DbRow = sqlx::sqlite::SqliteRow;
type DbConnection = sqlx::SqliteConnection;
type SqlStore = SqliteStore;
/// The larger of two values: SQLite's two-argument `MAX`.
const GREATEST: &str = "MAX";

// The one SQL implementation, compiled here against SQLite (and in the other backend module
// against the other database): loading the same files twice is the point (see sql/mod.rs).
#[allow(clippy::duplicate_mod)]
#[path = "sql/mod.rs"]
mod sql;

/// The embedded store. Cheap to clone (the pool is shared).
#[derive(Debug, Clone)]
pub struct SqliteStore {
    pool: SqlitePool,
}

impl SqliteStore {
    /// Opens (creating if missing) the database file and brings its schema up to date.
    pub async fn open(path: &Path) -> StoreResult<Self> {
        let options = SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Normal)
            .foreign_keys(true)
            .busy_timeout(BUSY_TIMEOUT);
        let pool = SqlitePoolOptions::new()
            .max_connections(4)
            .connect_with(options)
            .await?;
        MIGRATOR.run(&pool).await?;
        Ok(Self { pool })
    }

    /// Closes every connection (checkpointing the WAL). Called on shutdown.
    pub async fn close(&self) {
        self.pool.close().await;
    }

    /// The pool, for the copy to PostgreSQL and the tests that look at rows directly.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    /// Begins a write: a transaction holding SQLite's write lock.
    async fn write(&self) -> StoreResult<Transaction<'static, Sqlite>> {
        Ok(self.pool.begin_with("BEGIN IMMEDIATE").await?)
    }

    /// Begins a read that sees one snapshot throughout.
    async fn read_snapshot(&self) -> StoreResult<Transaction<'static, Sqlite>> {
        Ok(self.pool.begin().await?)
    }
}
