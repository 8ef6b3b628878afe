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

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use chrono::{DateTime, Utc};
use ongrid_core::{SessionId, SessionState};
use sqlx::{Row, Transaction};

use super::{session_from_row, states_listed, Db, SqlStore, SESSION_COLUMNS};
use crate::domain::sessions::SessionRecord;
use crate::store::StoreResult;

/// The sessions a manager plans with, as of the highest change number it has seen; shared by the
/// clones of one store, one read at a time. Callers at once share reads: a read that began
/// after a caller's call sees every commit before it, so a caller that waited while such a read
/// ran takes its result instead of reading again (a round and the creates answering at the
/// same time took the lock one after the other, a statement each).
#[derive(Debug, Clone, Default)]
pub struct KeptSessions {
    kept: Arc<tokio::sync::Mutex<Option<Kept>>>,
    /// Reads begun, counted under the lock: each read's ticket.
    reads: Arc<AtomicU64>,
}

#[cfg(test)]
#[allow(
    dead_code,
    reason = "the SQLite store's tests use them; this module is compiled for PostgreSQL too"
)]
impl KeptSessions {
    /// How many reads have begun.
    pub(crate) fn reads_begun(&self) -> u64 {
        self.reads.load(Ordering::SeqCst)
    }

    /// Holds the lock of the reads until the returned guard is dropped.
    pub(crate) async fn hold(&self) -> impl Sized + '_ {
        self.kept.lock().await
    }
}

#[derive(Debug)]
struct Kept {
    /// The ticket of the last read that succeeded: it saw every commit before it began.
    ticket: u64,
    seen: i64,
    /// Shared with the rounds that planned with them: a round takes every session without
    /// copying one.
    sessions: HashMap<SessionId, Arc<SessionRecord>>,
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

/// The change number of one write transaction: taken at its first change of a session and
/// given to every session it changes, so a round's placements take one number, not one each.
/// They commit together, so a read sees all of them or none.
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
        let mut sessions: Vec<Arc<SessionRecord>> = self
            .with_planned(|sessions| sessions.values().cloned().collect())
            .await?;
        // As `sessions` orders them.
        sessions.sort_by_key(|session| (session.created_at, session.id.0));
        Ok(sessions)
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
        read: impl FnOnce(&HashMap<SessionId, Arc<SessionRecord>>) -> T,
    ) -> StoreResult<T> {
        let called_at = self.planning.reads.load(Ordering::SeqCst);
        let mut guard = self.planning.kept.lock().await;
        if let Some(kept) = guard.as_mut() {
            if kept.ticket <= called_at {
                let ticket = self.planning.reads.fetch_add(1, Ordering::SeqCst) + 1;
                self.read_changes(kept).await?;
                kept.ticket = ticket;
            }
            return Ok(read(&kept.sessions));
        }
        let ticket = self.planning.reads.fetch_add(1, Ordering::SeqCst) + 1;
        let kept = guard.insert(self.read_planned(ticket).await?);
        Ok(read(&kept.sessions))
    }

    /// Every session in a planning state, and the highest change number before the read.
    async fn read_planned(&self, ticket: u64) -> StoreResult<Kept> {
        let seen: Option<i64> = sqlx::query_scalar("SELECT MAX(change_seq) FROM sessions")
            .fetch_one(&self.pool)
            .await?;
        let states = SessionState::ALL.into_iter().filter(|s| planned(*s));
        let sql = format!(
            "SELECT {SESSION_COLUMNS} WHERE s.state IN ({})",
            states_listed(states)
        );
        let rows = sqlx::query(&sql).fetch_all(&self.pool).await?;
        let sessions = rows
            .iter()
            .map(|row| session_from_row(row).map(|s| (s.id, Arc::new(s))))
            .collect::<StoreResult<_>>()?;
        Ok(Kept {
            ticket,
            seen: seen.unwrap_or(0),
            sessions,
        })
    }

    /// Brings `kept` up to date with the sessions changed since it was.
    async fn read_changes(&self, kept: &mut Kept) -> StoreResult<()> {
        let sql = format!("SELECT s.change_seq, {SESSION_COLUMNS} WHERE s.change_seq > $1");
        let rows = sqlx::query(&sql)
            .bind(kept.seen)
            .fetch_all(&self.pool)
            .await?;
        // Every row read before any is kept: one that failed after `seen` had passed a row not
        // yet kept would lose that row for good.
        let changed = rows
            .iter()
            .map(|row| Ok((row.try_get::<i64, _>("change_seq")?, session_from_row(row)?)))
            .collect::<StoreResult<Vec<_>>>()?;
        for (seq, session) in changed {
            kept.seen = kept.seen.max(seq);
            if planned(session.state) {
                kept.sessions.insert(session.id, Arc::new(session));
            } else {
                kept.sessions.remove(&session.id);
            }
        }
        Ok(())
    }
}
