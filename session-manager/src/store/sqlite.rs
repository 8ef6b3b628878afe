//! The SQLite [`Store`](super::Store): one file, WAL journal, foreign keys on, migrations from
//! `session-manager/migrations/` applied when the file is opened. The statements are the
//! shared ones of [`sql`](super::sql) (this module compiles that folder against SQLite); what is
//! SQLite's own is here: opening the file, beginning a write, `MAX` for `GREATEST` and its
//! JSON functions for a job's history.
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
use sqlx::{Connection, Database, Sqlite, Transaction, TransactionManager};

use super::StoreResult;

/// How long a statement waits for another connection's write lock before giving up.
const BUSY_TIMEOUT: Duration = Duration::from_secs(10);

/// How long closing the store waits for connections still in use or on their way back to the
/// pool ([`SqliteStore::close`]).
const CLOSE_WAIT: Duration = Duration::from_secs(2);

/// How many rows a connection's thread may read ahead of the task that collects them. With
/// sqlx's 50, a read of thousands of rows (the planning reads of a large site) on a busy
/// machine stops the thread whenever the task is not running, and wakes it again for each row
/// taken. Every read here collects its whole result anyway (`fetch_all`, `fetch_one`), so a
/// buffer larger than any result costs no memory beyond that result's.
const ROW_BUFFER: usize = 1 << 16;

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

/// What the shared statements of [`sql`] are compiled against here.
type Db = Sqlite;
type DbRow = sqlx::sqlite::SqliteRow;
type DbConnection = sqlx::SqliteConnection;
type SqlStore = SqliteStore;
/// The larger of two values: SQLite's two-argument `MAX`.
const GREATEST: &str = "MAX";
/// A job's history as one JSON array, oldest first, of `[from, to, at, reason]`
/// (`sql::jobs::read_stamped_jobs`).
const JOB_HISTORY: &str = "(SELECT json_group_array(json_array(t.from_state, t.to_state, t.at, \
     json(t.reason)) ORDER BY t.seq) FROM job_transitions t WHERE t.job_id = j.id)";

// The one SQL implementation, compiled here against SQLite (and in the other backend module
// against the other database): loading the same files twice is the point (see sql/mod.rs).
#[allow(clippy::duplicate_mod)]
#[path = "sql/mod.rs"]
mod sql;

/// Whether a connection coming back to the pool holds no transaction, so it may be handed out
/// again. A request dropped while its `BEGIN` was under way (a client that disconnects, a
/// timeout) can leave the connection inside a transaction nobody owns: sqlx counts it begun but
/// never hands out the `Transaction` that would roll it back. Such a connection is closed instead
/// of pooled (closing rolls the transaction back); reused, it would refuse every later write with
/// "begin_with at non-zero transaction depth", and a read would nest in a stale snapshot.
fn outside_any_transaction(connection: &DbConnection) -> bool {
    let depth = transaction_depth(connection);
    if depth > 0 {
        tracing::warn!(
            depth,
            "A database connection came back inside a transaction its request left behind; closing it."
        );
    }
    depth == 0
}

/// A pool of connections: as many as `connections`, each checked on its way back
/// ([`outside_any_transaction`]). Not pinged on the way out, as sqlx does by default to find
/// connections a server dropped: a SQLite connection is a thread of this process, and the ping,
/// a round trip to that thread, came before every read the pool handed out. A connection whose
/// thread died (a panic in sqlx's worker) fails the statements sent to it, where the ping would
/// have replaced it, until the pool retires it (sqlx's `max_lifetime`, 30 minutes).
fn pool_options(connections: u32) -> SqlitePoolOptions {
    SqlitePoolOptions::new()
        .max_connections(connections)
        .test_before_acquire(false)
        .after_release(|connection, _| {
            Box::pin(async move {
                // A dropped transaction's rollback is queued to the connection's worker: once a
                // ping came back after it, what is left was never rolled back. Without a
                // transaction counted, nothing queued can leave one (sqlx rolls back a BEGIN
                // whose caller went away itself), so this ping, a round trip to the connection's
                // thread, is spared for the common case. sqlx pings every connection on its way
                // back once more after this hook, whatever it answers (`return_to_pool` in
                // sqlx-core 0.8): that round trip no option spares.
                if transaction_depth(connection) > 0 {
                    connection.ping().await?;
                }
                Ok(outside_any_transaction(connection))
            })
        })
}

/// How many connections read at once.
const READERS: u32 = 4;

fn transaction_depth(connection: &DbConnection) -> usize {
    <Db as Database>::TransactionManager::get_transaction_depth(connection)
}

/// The embedded store. Cheap to clone (the pools are shared).
///
/// Reads go through `pool`; every write through `writer`, its one connection. SQLite lets one
/// connection write at a time: writers on several connections would meet its lock, and one
/// that finds it taken sleeps and retries (1, 2, 5, 10 ... 100 ms), unfairly, so a write's wait
/// under load grew far beyond the writes ahead of it. The writer's pool queues them instead, in
/// order, each starting as the one before commits.
#[derive(Debug, Clone)]
pub struct SqliteStore {
    pool: SqlitePool,
    writer: SqlitePool,
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
            .busy_timeout(BUSY_TIMEOUT)
            .row_buffer_size(ROW_BUFFER)
            // SQLite's temporary files (a write's statement journal once it outgrows 64 KiB,
            // the sorts and groupings of a statement) in memory: as files, each was made and
            // unlinked under /var/tmp, twelve a second by the writer in the fleet.
            .pragma("temp_store", "memory");
        let pool = pool_options(READERS).connect_with(options.clone()).await?;
        let writer = pool_options(1).connect_with(options).await?;
        MIGRATOR.run(&pool).await?;
        Ok(Self {
            pool,
            writer,
            inventory: Default::default(),
            planning: Default::default(),
            planned_jobs: Default::default(),
            creates: Default::default(),
            submits: Default::default(),
            changes: Default::default(),
            sync_records: Default::default(),
            samples: Default::default(),
        })
    }

    /// Writes the agents' activity not written yet ([`sql::samples`]), then closes every
    /// connection (checkpointing the WAL). Called on shutdown.
    ///
    /// Waits (at most [`CLOSE_WAIT`]) for the connections still on their way back to the pool
    /// first: sqlx 0.8's `Pool::close` stops looking for idle connections once it holds every
    /// permit, and one handed back just after (its `after_release` ping still running) stays
    /// open, the WAL with it, until the pool is dropped.
    pub async fn close(&self) {
        sql::samples::write_before_closing(self).await;
        let deadline = tokio::time::Instant::now() + CLOSE_WAIT;
        for pool in [&self.pool, &self.writer] {
            while pool.size() as usize > pool.num_idle() && tokio::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            pool.close().await;
        }
    }

    /// The pool, for the copy to PostgreSQL and the tests that look at rows directly.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    /// Where a statement that writes outside [`Self::write`] runs: the writer's connection.
    fn writes(&self) -> &SqlitePool {
        &self.writer
    }

    /// Begins a write: a transaction holding SQLite's write lock, on the writer's connection.
    async fn write(&self) -> StoreResult<Transaction<'static, Sqlite>> {
        Ok(self.writer.begin_with("BEGIN IMMEDIATE").await?)
    }

    /// Begins a read that sees one snapshot throughout.
    async fn read_snapshot(&self) -> StoreResult<Transaction<'static, Sqlite>> {
        Ok(self.pool.begin().await?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::fixtures;

    /// Planning reads asked for at once share one: those that waited while a read that began
    /// after their call ran take its result instead of reading again.
    #[tokio::test]
    async fn planning_reads_asked_for_at_once_are_shared() {
        let (_dir, store) = fixtures::sqlite().await;
        assert_eq!(
            crate::store::Store::pending_order(&*store).await.unwrap(),
            vec![]
        );
        assert_eq!(store.planning.reads_begun(), 1);
        let held = store.planning.hold().await;
        let asking: Vec<_> = (0..10)
            .map(|_| {
                let store = store.clone();
                tokio::spawn(async move { crate::store::Store::pending_order(&*store).await })
            })
            .collect();
        // This test's runtime has one thread: each task runs until it waits for the lock.
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        assert_eq!(store.planning.reads_begun(), 1);
        drop(held);
        for asked in asking {
            assert_eq!(asked.await.unwrap().unwrap(), vec![]);
        }
        assert_eq!(store.planning.reads_begun(), 2, "ten callers, one read");
        // A call after that read reads again.
        crate::store::Store::pending_order(&*store).await.unwrap();
        assert_eq!(store.planning.reads_begun(), 3);
    }

    /// A node's desired state and work are read on one connection of the pool
    /// ([`crate::store::Store::desired_reads_and_work`]): with every reader but one taken
    /// elsewhere, the read still answers (one that took a second connection while holding the
    /// first would wait until the pool gave up).
    #[tokio::test]
    async fn a_nodes_desired_state_and_work_take_one_reader() {
        use crate::store::Store;

        let (_dir, store) = fixtures::sqlite().await;
        let node = ongrid_core::NodeName::parse("node1").unwrap();
        let registration = fixtures::registration("node1");
        let now = chrono::Utc::now();
        let gpus = [fixtures::gpu(1)];
        store.register_node(registration, &gpus, now).await.unwrap();
        let mut taken = Vec::new();
        for _ in 1..READERS {
            taken.push(store.pool().acquire().await.unwrap());
        }
        let read = tokio::time::timeout(
            std::time::Duration::from_secs(10),
            store.desired_reads_and_work(&node, now),
        )
        .await
        .expect("read on the one connection left");
        let (reads, work) = read.unwrap().expect("registered");
        assert_eq!(reads.gpus.len(), 1);
        assert_eq!((work.sessions.len(), work.jobs.len()), (0, 0));
    }

    /// A connection handed back with a transaction begun and never owned (what a request
    /// dropped during its `BEGIN` leaves) is closed, and the writes after it go through; one
    /// whose transaction was dropped (and so rolled back) is kept.
    #[tokio::test]
    async fn a_connection_left_inside_a_transaction_is_not_reused() {
        let (_dir, store) = fixtures::sqlite().await;
        let pool = store.pool().clone();
        // The pool takes a released connection back (or closes it) on a task of its own.
        let settled = || async {
            while (pool.num_idle() as u32) < pool.size() {
                tokio::task::yield_now().await;
            }
        };
        // A read dropped without a commit is rolled back and its connection kept.
        settled().await;
        let before = pool.size();
        drop(store.read_snapshot().await.unwrap());
        settled().await;
        assert_eq!(
            pool.size(),
            before,
            "a dropped read's connection was closed"
        );
        let mut connection = pool.acquire().await.unwrap();
        let open = pool.size();
        <Db as Database>::TransactionManager::begin(&mut connection, None)
            .await
            .unwrap();
        drop(connection);
        while pool.size() == open && pool.num_idle() < open as usize {
            tokio::task::yield_now().await;
        }
        assert_eq!(
            pool.size(),
            open - 1,
            "the connection went back to the pool"
        );
        // Every connection left is handed out in turn.
        for _ in 0..3 {
            let write = store
                .write()
                .await
                .expect("a write after the leftover transaction");
            write.commit().await.unwrap();
            let read = store.read_snapshot().await.unwrap();
            read.rollback().await.unwrap();
        }
    }

    /// A reader connection and the writer keep SQLite's temporary files in memory (`temp_store`
    /// 2); the readers' pool gives each of its connections the same options.
    #[tokio::test]
    async fn temporary_files_stay_in_memory_on_the_readers_and_the_writer() {
        let (_dir, store) = fixtures::sqlite().await;
        for pool in [&store.pool, &store.writer] {
            let temp_store: i64 = sqlx::query_scalar("PRAGMA temp_store")
                .fetch_one(pool)
                .await
                .unwrap();
            assert_eq!(temp_store, 2);
        }
    }
}
