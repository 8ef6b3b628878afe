//! Writes made together: the requests that arrive while a write waits for its turn are written
//! in that write, all of them, instead of one write each (a group commit). Sessions' creates
//! ([`super::creates`]), jobs' submits ([`super::jobs`]), the changes of both
//! (`SqlStore::write_changes`), and the records of nodes' syncs ([`super::sync_records`]:
//! heartbeats, activity samples, jobs' output records) go through it.
//!
//! Every write of the site queues for one lock (SQLite's writer, PostgreSQL's advisory lock),
//! and a class opening its sessions at once put one create after the other in that queue, each
//! its own transaction: on PostgreSQL 32 creates at once waited 26 ms each for the lock on
//! average. A request joins a [`WriteQueue`] and starts a task that waits for the kind's turn;
//! whichever task gets it begins the transaction (waiting for the lock) and only then takes
//! every request waiting, so those that came while it waited for the lock are in it; those that
//! come while it writes are in the next.
//! The writes run on a thread of their own ([`write_thread`]), apart from the requests' tasks:
//! a write sends its statements one after the other, each once the one before is answered, and
//! holds the write lock throughout, so one that waits its turn among ready requests between two
//! statements keeps every other write waiting too.
//! The request only waits for its answer, so one that goes away (its client disconnected) never
//! takes a write with it, its own or the others': what it asked for is stored all the same, as
//! it would be had it gone away just after its commit, and asked again with the same idempotency
//! key (as `devctl` does), the request finds it.
//! Each request keeps its own answer: the batch's write decides a refusal of one (an owner
//! removed, a name taken) before anything of it is written; an error of the database fails the
//! write of all, and each is then written again alone, so each gets its own error and none is
//! lost to another's.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use futures::future::BoxFuture;
use sqlx::Transaction;
use tokio::sync::oneshot;

use super::{Db, SqlStore};
use crate::store::{StoreError, StoreResult};

/// The most requests one write takes; those beyond wait for the next.
const PER_WRITE: usize = 64;

/// Writes `items` in the transaction begun for them and commits it: each one's outcome, in
/// order.
pub(super) type WriteAll<W, O> = for<'a> fn(
    &'a SqlStore,
    Transaction<'static, Db>,
    &'a [W],
) -> BoxFuture<'a, StoreResult<Vec<StoreResult<O>>>>;

/// The transaction a kind's writes run in.
#[derive(Debug, Clone, Copy)]
pub(super) enum Lock {
    /// [`SqlStore::write`]'s, holding the site's write lock.
    Site,
    /// A plain one where statements that write outside the lock run
    /// ([`SqlStore::writes`]: SQLite's one writer, PostgreSQL's pool), for writes that move
    /// nothing of the site.
    Outside,
}

impl Lock {
    async fn begin(self, store: &SqlStore) -> StoreResult<Transaction<'static, Db>> {
        match self {
            Self::Site => store.write().await,
            Self::Outside => Ok(store.writes().begin().await?),
        }
    }
}

/// The requests waiting for a write, and the turn to write them; `O` is what a request's write
/// answers besides its error. Cheap to clone (shared).
#[derive(Debug)]
pub struct WriteQueue<W, O = ()>(Arc<Queue<W, O>>);

impl<W, O> Default for WriteQueue<W, O> {
    fn default() -> Self {
        Self(Arc::new(Queue {
            waiting: Mutex::default(),
            turn: Arc::default(),
        }))
    }
}

impl<W, O> Clone for WriteQueue<W, O> {
    fn clone(&self) -> Self {
        Self(Arc::clone(&self.0))
    }
}

#[derive(Debug)]
struct Queue<W, O> {
    waiting: Mutex<VecDeque<Waiting<W, O>>>,
    /// Held while one write runs; its waiters are served in order.
    turn: Arc<tokio::sync::Mutex<()>>,
}

/// A request in the queue and where its answer goes.
#[derive(Debug)]
struct Waiting<W, O> {
    item: W,
    answer: oneshot::Sender<StoreResult<O>>,
}

impl<W: Send + Sync + 'static, O: Send + 'static> WriteQueue<W, O> {
    fn waiting(&self) -> MutexGuard<'_, VecDeque<Waiting<W, O>>> {
        self.0
            .waiting
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn take(&self) -> Vec<Waiting<W, O>> {
        let mut waiting = self.waiting();
        let count = waiting.len().min(PER_WRITE);
        waiting.drain(..count).collect()
    }

    /// Writes `item` with every request waiting with it, by `write_all` in a transaction of
    /// `lock`; its own outcome.
    pub(super) async fn write(
        &self,
        store: &SqlStore,
        item: W,
        lock: Lock,
        write_all: WriteAll<W, O>,
    ) -> StoreResult<O> {
        let (answer, answered) = oneshot::channel();
        let writes = write_thread();
        self.waiting().push_back(Waiting { item, answer });
        let queue = self.clone();
        let store = store.clone();
        writes.spawn(async move {
            let _turn = queue.0.turn.clone().lock_owned().await;
            // Empty when the write of an earlier task took this request with it: no
            // transaction begun for nothing.
            if !queue.waiting().is_empty() {
                queue.write_waiting(&store, lock, write_all).await;
            }
        });
        // Only a panic of the write's task drops the answer unsent.
        answered
            .await
            .map_err(|_| StoreError::Database(sqlx::Error::WorkerCrashed))?
    }

    /// Begins a transaction of `lock`, then writes in it every request waiting by then and
    /// answers each; when that write fails, writes each alone.
    async fn write_waiting(&self, store: &SqlStore, lock: Lock, write_all: WriteAll<W, O>) {
        let begun = lock.begin(store).await;
        let (items, answers): (Vec<W>, Vec<_>) = self
            .take()
            .into_iter()
            .map(|waiting| (waiting.item, waiting.answer))
            .unzip();
        let written = match begun {
            Ok(tx) => write_all(store, tx, &items).await,
            Err(error) => Err(error),
        };
        let outcomes = match written {
            Ok(outcomes) => outcomes,
            Err(error) if items.len() == 1 => vec![Err(error)],
            Err(error) => {
                tracing::warn!(%error, requests = items.len(), "A write of requests made together failed; writing each alone.");
                let mut outcomes = Vec::with_capacity(items.len());
                for item in &items {
                    outcomes.push(write_alone(store, lock, write_all, item).await);
                }
                outcomes
            }
        };
        for (answer, outcome) in answers.into_iter().zip(outcomes) {
            // Its request went away: what it asked for is stored all the same.
            let _ = answer.send(outcome);
        }
    }
}

/// The runtime, on a thread of its own, where every write made together runs: started with the
/// first of them, for the life of the process. Where the thread cannot be started, the writes
/// run on the caller's runtime, as tasks of their own.
///
/// Why a thread of its own: on a loaded manager the runtime's workers each have many tasks ready
/// (requests, long-polls, rounds), and a write's task woken by the database's answer to one
/// statement waited its turn among them before it sent the next, all the while holding the write
/// lock. Timed on the fleet bench (`bench/run.sh --only fleet`, SQLite, a build that timed the
/// writer's connection from taken to given back), a write of these kinds held SQLite's one writer
/// for 2.5 to 3.5 ms on average, and the writer was busy 78 to 86% of the time. On this thread
/// the next statement goes as soon as the system runs the thread, which sleeps between writes.
/// (On PostgreSQL a connection opened on the requests' runtime still hears of its answers
/// there; the measurement was of SQLite.) The store of each backend has its thread.
fn write_thread() -> tokio::runtime::Handle {
    static WRITE_THREAD: std::sync::OnceLock<Option<tokio::runtime::Handle>> =
        std::sync::OnceLock::new();
    let started = WRITE_THREAD.get_or_init(|| match start_write_thread() {
        Ok(handle) => Some(handle),
        Err(error) => {
            tracing::warn!(%error, "Cannot start the thread of the store's writes; they run beside the requests.");
            None
        }
    });
    started
        .clone()
        .unwrap_or_else(tokio::runtime::Handle::current)
}

/// A runtime of one thread, `store-writes`, driven for the life of the process. Built on that
/// thread, so that none is dropped on the caller's runtime (which tokio refuses) when the thread
/// cannot be started; the caller waits for it once, for as long as a thread takes to start.
fn start_write_thread() -> std::io::Result<tokio::runtime::Handle> {
    let (runtime_started, started) = std::sync::mpsc::sync_channel(1);
    std::thread::Builder::new()
        .name(WRITE_THREAD_NAME.to_owned())
        .spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build();
            match runtime {
                Ok(runtime) => {
                    let _ = runtime_started.send(Ok(runtime.handle().clone()));
                    runtime.block_on(std::future::pending::<()>());
                }
                Err(error) => {
                    let _ = runtime_started.send(Err(error));
                }
            }
        })?;
    started.recv().unwrap_or_else(|_| {
        Err(std::io::Error::other(
            "the thread of the store's writes ended before its runtime started",
        ))
    })
}

/// The name of [`write_thread`]'s thread.
const WRITE_THREAD_NAME: &str = "store-writes";

/// Writes `item` by `write_all` in a transaction of its own; its outcome.
async fn write_alone<W, O>(
    store: &SqlStore,
    lock: Lock,
    write_all: WriteAll<W, O>,
    item: &W,
) -> StoreResult<O> {
    let tx = lock.begin(store).await?;
    write_all(store, tx, std::slice::from_ref(item))
        .await
        .and_then(|mut outcome| outcome.remove(0))
}

#[cfg(test)]
use crate::store::Together;

#[cfg(test)]
impl SqlStore {
    /// Holds the turn of the writes of `kind`: nothing is written until the guard is dropped, so
    /// the requests that join meanwhile are written together.
    pub(crate) async fn hold_together(&self, kind: Together) -> tokio::sync::OwnedMutexGuard<()> {
        self.turn_of(kind).clone().lock_owned().await
    }

    /// The turn of the writes of `kind`.
    fn turn_of(&self, kind: Together) -> &Arc<tokio::sync::Mutex<()>> {
        match kind {
            Together::Creates => &self.creates.0.turn,
            Together::Submits => &self.submits.0.turn,
            Together::Changes => &self.changes.0.turn,
            Together::SyncRecords => &self.sync_records.0.turn,
        }
    }

    /// Whether a task holds the turn of the writes of `kind` (writing, or waiting for the lock
    /// to).
    pub(crate) fn turn_taken(&self, kind: Together) -> bool {
        self.turn_of(kind).try_lock().is_err()
    }

    /// How many of the kept jobs a node's jobs took from the copy, and how many they did not
    /// find there as wanted ([`super::planning::KeptRecords::as_stamped`]).
    pub(crate) fn kept_jobs_found(&self) -> (u64, u64) {
        self.planned_jobs.stamped_found()
    }

    /// The name of the thread a write made together runs on.
    pub(crate) async fn thread_of_writes(&self) -> Option<String> {
        let queue: WriteQueue<(), Option<String>> = WriteQueue::default();
        queue
            .write(self, (), Lock::Outside, |_, tx, items| {
                Box::pin(async move {
                    let thread = std::thread::current().name().map(str::to_owned);
                    tx.commit().await?;
                    Ok(items.iter().map(|()| Ok(thread.clone())).collect())
                })
            })
            .await
            .expect("a write")
    }

    /// Holds the site's write lock until the transaction is dropped.
    pub(crate) async fn hold_write_lock(&self) -> Transaction<'static, Db> {
        self.write().await.expect("the write lock")
    }

    /// How many requests of `kind` wait for a write.
    pub(crate) fn waiting_together(&self, kind: Together) -> usize {
        match kind {
            Together::Creates => self.creates.waiting().len(),
            Together::Submits => self.submits.waiting().len(),
            Together::Changes => self.changes.waiting().len(),
            Together::SyncRecords => self.sync_records.waiting().len(),
        }
    }
}
