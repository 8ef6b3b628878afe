//! Session histories (`session_transitions`) read and written by the many in one statement: a
//! round that places forty sessions reads their histories together and adds their forty rows in
//! one `INSERT`, where one session's change takes a statement for each.

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use ongrid_core::holds::HoldReason;
use ongrid_core::{Lifecycle, SessionId, SessionState, Transition};
use sqlx::{QueryBuilder, Row, Transaction};

use super::{parse, timestamp, to_json, transition_from_row, Db, TRANSITION_COLUMNS};
use crate::domain::sessions::Placement;
use crate::store::{StoreError, StoreResult};

/// Rows or values per statement: SQLite takes at most 32,766 values, PostgreSQL 65,535.
pub(super) const PER_STATEMENT: usize = 500;

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
        let rows = prepared_if_one(&mut query, chunk.len())
            .fetch_all(&mut **tx)
            .await?;
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

/// Transitions to add to the sessions' histories, the sessions' new states, and the starts
/// their facts record, written together by [`Self::insert`]: a round's forty placements in one
/// `INSERT` and one `UPDATE`.
#[derive(Debug, Default)]
pub(super) struct NewRows {
    rows: Vec<NewRow>,
    states: Vec<NewState>,
    /// The sessions that became ready, and when ([`super::activity::after_transition`]).
    ready: Vec<(SessionId, String)>,
}

/// What follows the values of [`NewRows::insert`]'s `INSERT` of the starts: ready from now on,
/// first started now unless a first start is already stored (a restart after a release keeps
/// it: max-duration counts from the first).
const SET_READY: &str = " ON CONFLICT (session_id) DO UPDATE SET ready_at = excluded.ready_at, \
     first_started_at = COALESCE(session_lifecycle.first_started_at, excluded.first_started_at)";

/// A session's row as a change leaves it.
#[derive(Debug)]
struct NewState {
    id: SessionId,
    state: SessionState,
    reason: String,
    hold: Option<HoldReason>,
    /// [`KEEP`], [`PLACE`] or [`CLEAR`]: what happens to the node and GPUs.
    placement: &'static str,
    node: Option<String>,
    /// The GPUs given, as JSON, when placed.
    gpus: Option<String>,
    change_seq: i64,
}

/// The placements of [`NewState`], as [`SET_STATES`] tells them apart.
const KEEP: &str = "keep";
const PLACE: &str = "place";
const CLEAR: &str = "clear";

/// What follows the values of [`NewRows::insert`]'s `UPDATE` of the sessions' states.
const SET_STATES: &str = ") UPDATE sessions SET state = v.state, reason = v.reason, \
     hold_reason = v.hold_reason, change_seq = v.change_seq, \
     node = CASE v.placement WHEN 'place' THEN v.node WHEN 'clear' THEN NULL \
     ELSE sessions.node END, \
     gpus = CASE v.placement WHEN 'place' THEN v.gpus WHEN 'clear' THEN '[]' \
     ELSE sessions.gpus END \
     FROM v WHERE sessions.id = v.id";

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
        self.rows.push(NewRow {
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

    /// Sets session `id`'s state, reason and placement, stamped `change_seq`. At most one change
    /// of a session between two calls of [`Self::insert`] (one `UPDATE` cannot set a row twice):
    /// a caller changing a session again writes the first change before.
    pub(super) fn set_state(
        &mut self,
        id: SessionId,
        state: SessionState,
        (reason, hold): (&str, Option<HoldReason>),
        placement: &Placement,
        change_seq: i64,
    ) -> StoreResult<()> {
        if self.states.iter().any(|s| s.id == id) {
            return Err(StoreError::Corrupt(format!(
                "session {id} changed twice in one statement"
            )));
        }
        let (placement, node, gpus) = match placement {
            Placement::Keep => (KEEP, None, None),
            Placement::Place { node, gpus } => {
                (PLACE, Some(node.to_string()), Some(to_json(gpus)?))
            }
            Placement::Clear => (CLEAR, None, None),
        };
        self.states.push(NewState {
            id,
            state,
            reason: reason.to_owned(),
            hold,
            placement,
            node,
            gpus,
            change_seq,
        });
        Ok(())
    }

    /// Records that session `id` became ready at `at`: its facts' ready time, and its first
    /// start unless one is stored. With its change's state, so at most once between two calls
    /// of [`Self::insert`] (see [`Self::set_state`]).
    pub(super) fn ready(&mut self, id: SessionId, at: DateTime<Utc>) {
        self.ready.push((id, timestamp(at)));
    }

    /// Writes the rows, states and starts added since the last call.
    pub(super) async fn insert(&mut self, tx: &mut Transaction<'static, Db>) -> StoreResult<()> {
        for chunk in self.rows.chunks(PER_STATEMENT) {
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
            execute(query, chunk.len(), tx).await?;
        }
        self.rows.clear();
        for chunk in self.states.chunks(PER_STATEMENT) {
            let mut query = QueryBuilder::<Db>::new(
                "WITH v (id, state, reason, hold_reason, placement, node, gpus, change_seq) AS (",
            );
            query.push_values(chunk, |mut values, new| {
                values
                    .push_bind(new.id.to_string())
                    .push_bind(new.state.as_str())
                    .push_bind(new.reason.as_str())
                    .push_bind(new.hold.map(HoldReason::as_str))
                    .push_bind(new.placement)
                    .push_bind(new.node.as_deref())
                    .push_bind(new.gpus.as_deref())
                    .push_bind(new.change_seq);
            });
            query.push(SET_STATES);
            execute(query, chunk.len(), tx).await?;
        }
        self.states.clear();
        for chunk in self.ready.chunks(PER_STATEMENT) {
            let mut query = QueryBuilder::<Db>::new(
                "INSERT INTO session_lifecycle (session_id, ready_at, first_started_at) ",
            );
            query.push_values(chunk, |mut values, (id, at)| {
                values
                    .push_bind(id.to_string())
                    .push_bind(at.as_str())
                    .push_bind(at.as_str());
            });
            query.push(SET_READY);
            execute(query, chunk.len(), tx).await?;
        }
        self.ready.clear();
        Ok(())
    }
}

/// Runs `query`, built for `rows` rows ([`prepared_if_one`]).
pub(super) async fn execute(
    mut query: QueryBuilder<'_, Db>,
    rows: usize,
    tx: &mut Transaction<'static, Db>,
) -> StoreResult<()> {
    prepared_if_one(&mut query, rows).execute(&mut **tx).await?;
    Ok(())
}

/// `query`, built for `rows` rows (or ids). One, the common single change, is the same statement
/// every time: kept among the connection's prepared statements; more are not, since their
/// statements differ with their count and would push out the ones every request runs.
fn prepared_if_one<'q>(
    query: &'q mut QueryBuilder<'_, Db>,
    rows: usize,
) -> sqlx::query::Query<'q, Db, <Db as sqlx::Database>::Arguments<'q>> {
    let query = query.build();
    if rows == 1 {
        query
    } else {
        query.persistent(false)
    }
}
