//! The planning read of the sessions ([`Store::planning_sessions`](crate::store::Store::planning_sessions)):
//! the PENDING sessions and those holding GPUs, kept in memory and brought up to date with the
//! sessions changed since the last read. The queue's order and a waiting session's place
//! (`pending_order`, `pending_place`) are read from them too.
//!
//! Every write transaction that creates or changes sessions stamps them with the next number
//! of `session_change_seq` (migration 0024, [`next_change`], [`Stamp`]). Writers are serialised
//! (SQLite's write lock, PostgreSQL's advisory write lock, both held until the commit), so the
//! numbers commit in order: a read that sees a session stamped `n` sees every change numbered
//! below `n`, and the other sessions stamped `n`, which committed with it. The first read takes
//! the highest number, then every session in a planning state; each later read takes the sessions
//! stamped above the highest it has seen, in one statement (one snapshot), and keeps, replaces or
//! lets go of each by its state. Sessions are never deleted (ended ones stay, ENDED). Replicas on
//! one PostgreSQL database each keep their own copy and see each other's writes through the
//! numbers.
//!
//! The jobs QUEUED or holding GPUs are kept the same way ([`KeptJobs`], migration 0026): every
//! write that creates a job, changes its state or its chain's links stamps it from the same
//! counter ([`super::jobs`]). A job is deleted only once it has ended, but a copy that did not
//! read since may still keep it: a write that deletes jobs records its number
//! (`job_deletion_seq`), and a copy older than that reads the jobs whole again. Its output's
//! size and a grid engine's fields are written outside the write lock and not stamped: the kept
//! copy has them as of the job's last stamped change. Each kept record's own number is kept with
//! it, so a node's jobs (read at every sync and long-poll answer, with every column) take the
//! lifecycle of each job the copy holds as the row's number says from the copy instead of
//! reading its history again ([`KeptRecords::as_stamped`]).

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use chrono::{DateTime, Utc};
use ongrid_core::job::{JobId, JobState};
use ongrid_core::{SessionId, SessionState};
use sqlx::{Row, Transaction};

use super::{session_from_row, states_listed, Db, SqlStore, SESSION_COLUMNS};
use crate::domain::jobs::JobRecord;
use crate::domain::sessions::SessionRecord;
use crate::store::StoreResult;

/// The records a manager plans with (sessions, jobs), as of the highest change number it has
/// seen; shared by the clones of one store, one read at a time. Callers at once share reads: a
/// read that began after a caller's call sees every commit before it, so a caller that waited
/// while such a read ran takes its result instead of reading again (a round and the creates
/// answering at the same time took the lock one after the other, a statement each).
#[derive(Debug)]
pub struct KeptRecords<R: Planned> {
    /// Held by the read that brings the copy up to date, across its statements.
    reading: Arc<tokio::sync::Mutex<()>>,
    /// The copy, locked only to look at it or to change it, never across a statement: who only
    /// looks at it as it stands ([`Self::as_stamped`]) never waits for a read of the database
    /// (a node's jobs at every sync waited for the rounds' reads, in a convoy on PostgreSQL).
    kept: Arc<std::sync::Mutex<Option<Kept<R>>>>,
    /// Reads begun, counted under `reading`: each read's ticket.
    reads: Arc<AtomicU64>,
    /// The records [`Self::as_stamped`] found as wanted, and those it did not.
    stamped: Arc<[AtomicU64; 2]>,
}

/// The sessions kept for planning.
pub type KeptSessions = KeptRecords<SessionRecord>;

/// The jobs QUEUED or holding GPUs, kept for planning ([`super::jobs`]).
pub type KeptJobs = KeptRecords<JobRecord>;

// By hand: a derived `Clone` and `Default` would ask them of `R`.
impl<R: Planned> Clone for KeptRecords<R> {
    fn clone(&self) -> Self {
        Self {
            reading: self.reading.clone(),
            kept: self.kept.clone(),
            reads: self.reads.clone(),
            stamped: self.stamped.clone(),
        }
    }
}

impl<R: Planned> Default for KeptRecords<R> {
    fn default() -> Self {
        Self {
            reading: Default::default(),
            kept: Default::default(),
            reads: Default::default(),
            stamped: Default::default(),
        }
    }
}

/// A record kept for planning: its key, its place in the order its readers take them in, and
/// whether it is planned with in its state.
pub trait Planned: std::fmt::Debug {
    type Key: std::hash::Hash + Eq + Copy + std::fmt::Debug;
    /// Unique among the records (it ends with the key).
    type Order: Ord + std::fmt::Debug;
    fn key(&self) -> Self::Key;
    fn order(&self) -> Self::Order;
    fn planned(&self) -> bool;
}

impl Planned for SessionRecord {
    type Key = SessionId;
    /// As [`crate::store::Store::sessions`] orders them.
    type Order = (DateTime<Utc>, uuid::Uuid);
    fn key(&self) -> SessionId {
        self.id
    }
    fn order(&self) -> Self::Order {
        (self.created_at, self.id.0)
    }
    fn planned(&self) -> bool {
        planned(self.state)
    }
}

impl Planned for JobRecord {
    type Key = JobId;
    /// As the other filters of [`crate::store::Store::jobs`] order them.
    type Order = (DateTime<Utc>, uuid::Uuid);
    fn key(&self) -> JobId {
        self.id
    }
    fn order(&self) -> Self::Order {
        (self.queued_at(), self.id.0)
    }
    /// QUEUED or holding GPUs ([`crate::store::JobFilter::Active`]).
    fn planned(&self) -> bool {
        let state = self.state();
        state == JobState::Queued || state.holds_gpus()
    }
}

#[cfg(test)]
#[allow(
    dead_code,
    reason = "the SQLite store's tests use them; this module is compiled for PostgreSQL too"
)]
impl<R: Planned> KeptRecords<R> {
    /// How many reads have begun.
    pub(crate) fn reads_begun(&self) -> u64 {
        self.reads.load(Ordering::SeqCst)
    }

    /// How many records [`Self::as_stamped`] found as wanted, and how many it did not.
    pub(crate) fn stamped_found(&self) -> (u64, u64) {
        let [found, missed] = &*self.stamped;
        (found.load(Ordering::SeqCst), missed.load(Ordering::SeqCst))
    }

    /// Holds the lock of the reads until the returned guard is dropped.
    pub(crate) async fn hold(&self) -> impl Sized + '_ {
        self.reading.lock().await
    }
}

#[derive(Debug)]
struct Kept<R: Planned> {
    /// The ticket of the last read that succeeded: it saw every commit before it began.
    ticket: u64,
    seen: i64,
    records: Records<R>,
}

/// The kept records, by key with the change number each was read with, and in their order
/// ([`Planned::order`]), kept in order as they
/// change instead of sorted for each reader: sorting 20,000 jobs for each round and each job's
/// view took 1.4% of the manager's CPU in the fleet bench (`tests/examples/fleet.rs`). Shared
/// with the rounds that planned with them: a round takes every record without copying one.
#[derive(Debug)]
pub(super) struct Records<R: Planned> {
    by_key: HashMap<R::Key, (i64, Arc<R>)>,
    in_order: BTreeMap<R::Order, Arc<R>>,
}

// By hand: a derived `Default` would ask it of `R`.
impl<R: Planned> Default for Records<R> {
    fn default() -> Self {
        Self {
            by_key: HashMap::new(),
            in_order: BTreeMap::new(),
        }
    }
}

impl<R: Planned> Records<R> {
    fn with_capacity(capacity: usize) -> Self {
        Self {
            by_key: HashMap::with_capacity(capacity),
            in_order: BTreeMap::new(),
        }
    }

    pub(super) fn get(&self, key: &R::Key) -> Option<&Arc<R>> {
        self.by_key.get(key).map(|(_, record)| record)
    }

    /// `key`'s record when it was read with change number `seq`.
    fn stamped(&self, key: &R::Key, seq: i64) -> Option<&Arc<R>> {
        self.by_key
            .get(key)
            .filter(|(stamp, _)| *stamp == seq)
            .map(|(_, record)| record)
    }

    /// In no order.
    pub(super) fn values(&self) -> impl Iterator<Item = &Arc<R>> {
        self.by_key.values().map(|(_, record)| record)
    }

    /// In their order ([`Planned::order`]).
    pub(super) fn in_order(&self) -> impl Iterator<Item = &Arc<R>> {
        self.in_order.values()
    }

    /// Keeps `record`, read with change number `seq`, in place of the one of its key.
    fn insert(&mut self, seq: i64, record: R) {
        self.remove(&record.key());
        let record = Arc::new(record);
        let taken = self.in_order.insert(record.order(), Arc::clone(&record));
        debug_assert!(
            taken.is_none(),
            "an order key ends with the record's own key"
        );
        self.by_key.insert(record.key(), (seq, record));
    }

    fn remove(&mut self, key: &R::Key) {
        if let Some((_, old)) = self.by_key.remove(key) {
            self.in_order.remove(&old.order());
        }
    }
}

impl<R: Planned> KeptRecords<R> {
    /// `read` of the kept records, first brought up to date: read whole the first time
    /// (`read_all`: the highest change number before the read, then every record planned
    /// with, each with its change number), then only those changed since
    /// (`read_changed(seen)`: each with its change number; `None` when records were deleted
    /// since, which leave nothing to read: read whole again).
    pub(super) async fn with_kept<T, All, Changed>(
        &self,
        read_all: impl FnOnce() -> All,
        read_changed: impl FnOnce(i64) -> Changed,
        read: impl FnOnce(&Records<R>) -> T,
    ) -> StoreResult<T>
    where
        All: std::future::Future<Output = StoreResult<(i64, Vec<(i64, R)>)>>,
        Changed: std::future::Future<Output = StoreResult<Option<Vec<(i64, R)>>>>,
    {
        let called_at = self.reads.load(Ordering::SeqCst);
        let _reading = self.reading.lock().await;
        let kept_as = self.copy().as_ref().map(|kept| (kept.ticket, kept.seen));
        match kept_as {
            // A read that began after the call has brought the copy up to date.
            Some((ticket, _)) if ticket > called_at => {}
            kept_as => {
                let ticket = self.reads.fetch_add(1, Ordering::SeqCst) + 1;
                // No copy yet, or records deleted since (`None`): read whole.
                let changed = match kept_as {
                    Some((_, seen)) => read_changed(seen).await?,
                    None => None,
                };
                match changed {
                    Some(changed) => {
                        // Every record read before any is kept: one that failed after `seen`
                        // had passed a record not yet kept would lose that record for good.
                        if let Some(kept) = self.copy().as_mut() {
                            for (seq, record) in changed {
                                kept.seen = kept.seen.max(seq);
                                kept.keep(seq, record);
                            }
                            kept.ticket = ticket;
                        }
                    }
                    None => {
                        let whole = Kept::whole(ticket, read_all().await?);
                        *self.copy() = Some(whole);
                    }
                }
            }
        }
        let copy = self.copy();
        Ok(match copy.as_ref() {
            Some(kept) => read(&kept.records),
            None => read(&Records::default()),
        })
    }

    /// The copy, locked for a look or a change (no statement under it).
    fn copy(&self) -> std::sync::MutexGuard<'_, Option<Kept<R>>> {
        self.kept
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The highest change number the kept copy has seen, as it stands (not brought up to date);
    /// `None` before its first read.
    pub(super) fn seen(&self) -> Option<i64> {
        self.copy().as_ref().map(|kept| kept.seen)
    }

    /// The kept records among `wanted` (each key with the change number a reader found on its
    /// row) that were read with that same number, as the copy stands (not brought up to date):
    /// one changed since, or not kept, is left out.
    pub(super) fn as_stamped(&self, wanted: &[(R::Key, i64)]) -> HashMap<R::Key, Arc<R>> {
        let found: HashMap<R::Key, Arc<R>> = match self.copy().as_ref() {
            Some(kept) => wanted
                .iter()
                .filter_map(|(key, seq)| Some((*key, kept.records.stamped(key, *seq)?.clone())))
                .collect(),
            None => HashMap::new(),
        };
        let [hits, misses] = &*self.stamped;
        hits.fetch_add(found.len() as u64, Ordering::Relaxed);
        misses.fetch_add((wanted.len() - found.len()) as u64, Ordering::Relaxed);
        found
    }
}

impl<R: Planned> Kept<R> {
    /// What a whole read (`(seen, stamped records)`) keeps, as of the read with `ticket`.
    fn whole(ticket: u64, (seen, records): (i64, Vec<(i64, R)>)) -> Self {
        let mut kept = Self {
            ticket,
            seen,
            records: Records::with_capacity(records.len()),
        };
        for (seq, record) in records {
            kept.keep(seq, record);
        }
        kept
    }

    /// Keeps `record`, read with change number `seq`, when it is planned with; lets go of it
    /// otherwise.
    fn keep(&mut self, seq: i64, record: R) {
        if record.planned() {
            self.records.insert(seq, record);
        } else {
            self.records.remove(&record.key());
        }
    }
}

/// Whether the scheduler plans with a session in `state`: it waits (PENDING) or holds GPUs.
fn planned(state: SessionState) -> bool {
    state == SessionState::Pending || state.holds_gpus()
}

/// A PENDING session's key in the queue, `(queued_at, id)`; `None` for one that is not waiting.
fn queued(session: &SessionRecord) -> Option<(DateTime<Utc>, uuid::Uuid)> {
    (session.state == SessionState::Pending).then_some((session.queued_at, session.id.0))
}

/// The next change number, inside the write `tx`: the sessions the write creates or changes are
/// stamped with it (their `change_seq`), in the statements that write them.
pub(super) async fn next_change(tx: &mut Transaction<'static, Db>) -> StoreResult<i64> {
    Ok(sqlx::query_scalar(
        "INSERT INTO session_change_seq (id, seq) VALUES (1, 1) \
         ON CONFLICT (id) DO UPDATE SET seq = session_change_seq.seq + 1 RETURNING seq",
    )
    .fetch_one(&mut **tx)
    .await?)
}

/// The change number of one write transaction: taken at its first change of a session or a job
/// and given to every session and job it changes, so a round's placements take one number, not
/// one each. They commit together, so a read sees all of them or none.
#[derive(Debug, Default)]
pub(super) struct Stamp(Option<i64>);

impl Stamp {
    pub(super) async fn get(&mut self, tx: &mut Transaction<'static, Db>) -> StoreResult<i64> {
        match self.0 {
            Some(number) => Ok(number),
            None => {
                let number = next_change(tx).await?;
                self.0 = Some(number);
                Ok(number)
            }
        }
    }
}

impl SqlStore {
    pub(super) async fn planning_sessions(&self) -> StoreResult<Vec<Arc<SessionRecord>>> {
        self.with_planned(|sessions| sessions.in_order().cloned().collect())
            .await
    }

    /// The PENDING sessions, first queued first (`queued_at`, then id, as the scheduler serves
    /// them without fair share): from the kept sessions, brought up to date by one read of the
    /// changed ones, where a read of the table's PENDING rows scanned every row that was ever
    /// PENDING until PostgreSQL's vacuum had been.
    pub(super) async fn pending_order(&self) -> StoreResult<Vec<SessionId>> {
        self.with_planned(|sessions| {
            let mut pending: Vec<_> = sessions.values().filter_map(|s| queued(s)).collect();
            pending.sort_unstable();
            pending.into_iter().map(|(_, id)| SessionId(id)).collect()
        })
        .await
    }

    /// `id`'s 1-based place in [`Self::pending_order`]; `None` unless it is PENDING.
    pub(super) async fn pending_place(&self, id: SessionId) -> StoreResult<Option<u32>> {
        self.with_planned(|sessions| {
            let place = queued(sessions.get(&id)?)?;
            let ahead = sessions
                .values()
                .filter(|s| queued(s).is_some_and(|key| key <= place))
                .count();
            Some(u32::try_from(ahead).unwrap_or(u32::MAX))
        })
        .await
    }

    /// `read` of the kept sessions, first brought up to date (read whole the first time).
    async fn with_planned<T>(
        &self,
        read: impl FnOnce(&Records<SessionRecord>) -> T,
    ) -> StoreResult<T> {
        self.planning
            .with_kept(|| self.read_planned(), |seen| self.read_changes(seen), read)
            .await
    }

    /// Every session in a planning state, each with its change number, and the highest change
    /// number before the read.
    async fn read_planned(&self) -> StoreResult<(i64, Vec<(i64, SessionRecord)>)> {
        let seen: Option<i64> = sqlx::query_scalar("SELECT MAX(change_seq) FROM sessions")
            .fetch_one(&self.pool)
            .await?;
        let states = SessionState::ALL.into_iter().filter(|s| planned(*s));
        let sql = format!(
            "SELECT s.change_seq, {SESSION_COLUMNS} WHERE s.state IN ({})",
            states_listed(states)
        );
        let rows = sqlx::query(&sql).fetch_all(&self.pool).await?;
        let sessions = rows
            .iter()
            .map(stamped_session)
            .collect::<StoreResult<_>>()?;
        Ok((seen.unwrap_or(0), sessions))
    }

    /// The sessions changed since the change number `seen`, each with its own (sessions are
    /// never deleted).
    async fn read_changes(&self, seen: i64) -> StoreResult<Option<Vec<(i64, SessionRecord)>>> {
        let sql = format!("SELECT s.change_seq, {SESSION_COLUMNS} WHERE s.change_seq > $1");
        let rows = sqlx::query(&sql).bind(seen).fetch_all(&self.pool).await?;
        rows.iter()
            .map(stamped_session)
            .collect::<StoreResult<_>>()
            .map(Some)
    }
}

/// A session and its change number from a row of `s.change_seq, ` [`SESSION_COLUMNS`].
fn stamped_session(row: &super::DbRow) -> StoreResult<(i64, SessionRecord)> {
    Ok((row.try_get::<i64, _>("change_seq")?, session_from_row(row)?))
}
