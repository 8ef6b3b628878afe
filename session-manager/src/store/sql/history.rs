//! Session histories (`session_transitions`) read and written by the many in one statement: a
//! round that places forty sessions reads their histories together and adds their forty rows in
//! one `INSERT`, where one session's change takes a statement for each.

use std::collections::HashMap;

use ongrid_core::holds::HoldReason;
use ongrid_core::{Lifecycle, SessionId, SessionState, Transition};
use sqlx::{QueryBuilder, Row, Transaction};

use super::{parse, timestamp, transition_from_row, Db, TRANSITION_COLUMNS};
use crate::store::{StoreError, StoreResult};

/// Rows or values per statement: SQLite takes at most 32,766 values, PostgreSQL 65,535.
const PER_STATEMENT: usize = 500;

/// The lifecycles of `ids` as stored, each replayed from its history; a session without one
/// (there is no such session) is left out.
pub(super) async fn lifecycles(
    tx: &mut Transaction<'static, Db>,
    ids: &[SessionId],
) -> StoreResult<HashMap<SessionId, Lifecycle>> {
    let mut histories: HashMap<SessionId, Vec<Transition>> = HashMap::new();
    for chunk in ids.chunks(PER_STATEMENT) {
        let mut query = QueryBuilder::<Db>::new(format!(
            "SELECT session_id, {TRANSITION_COLUMNS} FROM session_transitions \
             WHERE session_id IN ("
        ));
        let mut listed = query.separated(", ");
        for id in chunk {
            listed.push_bind(id.to_string());
        }
        query.push(") ORDER BY session_id, seq");
        // A statement for this many ids only: kept out of the connection's statement cache.
        let rows = query.build().persistent(false).fetch_all(&mut **tx).await?;
        for row in &rows {
            let id: SessionId = parse(&row.try_get::<String, _>("session_id")?, "session id")?;
            histories
                .entry(id)
                .or_default()
                .push(transition_from_row(row)?);
        }
    }
    histories
        .into_iter()
        .map(|(id, history)| Ok((id, lifecycle_of(id, history)?)))
        .collect()
}

/// The lifecycle a session's stored `history` replays to; an empty history is a session that
/// does not exist.
pub(super) fn lifecycle_of(id: SessionId, history: Vec<Transition>) -> StoreResult<Lifecycle> {
    if history.is_empty() {
        return Err(StoreError::NoSuchSession(id));
    }
    Lifecycle::from_history(history)
        .map_err(|e| StoreError::Corrupt(format!("history of session {id}: {e}")))
}

/// Transitions to add to the sessions' histories, written together by [`Self::insert`].
#[derive(Debug, Default)]
pub(super) struct NewRows(Vec<NewRow>);

#[derive(Debug)]
struct NewRow {
    id: SessionId,
    seq: i64,
    from: Option<SessionState>,
    to: SessionState,
    at: String,
    /// The words as stored and, for a hold, its typed reason (the transition's reason is
    /// rendered from both).
    reason: String,
    hold: Option<HoldReason>,
}

impl NewRows {
    /// Adds `transition` as number `seq` of session `id`'s history.
    pub(super) fn push(
        &mut self,
        id: SessionId,
        seq: usize,
        transition: &Transition,
        (reason, hold): (&str, Option<HoldReason>),
    ) -> StoreResult<()> {
        self.0.push(NewRow {
            id,
            seq: i64::try_from(seq)
                .map_err(|_| StoreError::Corrupt("history too long".to_owned()))?,
            from: transition.from,
            to: transition.to,
            at: timestamp(transition.at),
            reason: reason.to_owned(),
            hold,
        });
        Ok(())
    }

    /// Writes the rows added since the last call.
    pub(super) async fn insert(&mut self, tx: &mut Transaction<'static, Db>) -> StoreResult<()> {
        for chunk in self.0.chunks(PER_STATEMENT) {
            let mut query = QueryBuilder::<Db>::new(
                "INSERT INTO session_transitions (session_id, seq, from_state, to_state, at, \
                 reason, hold_reason) ",
            );
            query.push_values(chunk, |mut values, row| {
                values
                    .push_bind(row.id.to_string())
                    .push_bind(row.seq)
                    .push_bind(row.from.map(SessionState::as_str))
                    .push_bind(row.to.as_str())
                    .push_bind(row.at.as_str())
                    .push_bind(row.reason.as_str())
                    .push_bind(row.hold.map(HoldReason::as_str));
            });
            let query = query.build();
            // One row, the common single change, is the same statement every time: cached.
            let query = if chunk.len() == 1 {
                query
            } else {
                query.persistent(false)
            };
            query.execute(&mut **tx).await?;
        }
        self.0.clear();
        Ok(())
    }
}
