//! The SQL of session activity: the facts the hold policy is computed from
//! (`session_lifecycle`, one row per session, created on first need) and the last report time of
//! each open SSH connection (`connections.last_report_at`).
//!
//! Facts are written in the same transaction as what causes them: [`after_transition`] runs
//! inside every state change, the connection hooks inside
//! [`super::SqlStore::record_connection`]. What a state change or an activity sample does to
//! the facts is decided by [`crate::domain::sessions::facts`]; this module stores it. Every time
//! is the manager's clock.

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use ongrid_core::api::{ConnectionEvent, ConnectionEventKind};
use ongrid_core::holds::HoldReason;
use ongrid_core::{NodeName, SessionId, Transition};
use sqlx::{QueryBuilder, Row, Transaction};

use super::samples::{sampled_from_row, Measure};
use super::{
    clamp, history, parse, parse_timestamp, states_listed, timestamp, Db, DbConnection, DbRow,
    SqlStore, GREATEST,
};
use crate::domain::sessions::facts::{self, FactsChange};
use crate::domain::sessions::holds::{due_hold, LifecycleConfig, LifecycleFacts};
use crate::domain::sessions::SessionRecord;
use crate::store::{FactsScope, StoreError, StoreResult};

const FACT_COLUMNS: &str = "s.id, s.state, \
     (SELECT t.at FROM session_transitions t WHERE t.session_id = s.id \
      ORDER BY t.seq DESC LIMIT 1) AS state_since, \
     l.idle_timeout_secs, l.max_duration_secs, l.first_started_at, l.ready_at, l.last_close_at, \
     l.last_traffic_at, l.cpu_active_at, l.cpu_sampled_at, l.cpu_percent, l.gpu_active_at, \
     l.gpu_sampled_at, l.gpu_percent, l.keep_until \
     FROM sessions s LEFT JOIN session_lifecycle l ON l.session_id = s.id";

impl SqlStore {
    pub(super) async fn lifecycle_facts(
        &self,
        scope: FactsScope,
    ) -> StoreResult<Vec<LifecycleFacts>> {
        let mut conn = self.pool.acquire().await?;
        facts_in(&mut conn, scope).await
    }

    pub(super) async fn resuming_on(&self, node: &NodeName) -> StoreResult<Vec<SessionId>> {
        read_resuming(&self.pool, node).await
    }

    pub(super) async fn hold_if_due(
        &self,
        id: SessionId,
        config: &LifecycleConfig,
        now: DateTime<Utc>,
    ) -> StoreResult<Option<(SessionRecord, HoldReason)>> {
        let mut tx = self.write().await?;
        let facts = facts_in(&mut tx, FactsScope::Session(id)).await?;
        let Some((change, reason)) = facts.first().and_then(|f| due_hold(f, config, now)) else {
            return Ok(None);
        };
        super::apply_change(&mut tx, id, change).await?;
        let session = super::find_session(&mut *tx, id)
            .await?
            .ok_or(StoreError::NoSuchSession(id))?;
        tx.commit().await?;
        Ok(Some((session, reason)))
    }

    pub(super) async fn set_keep_until(
        &self,
        id: SessionId,
        until: DateTime<Utc>,
    ) -> StoreResult<()> {
        let mut tx = self.write().await?;
        ensure_row(&mut tx, id).await?;
        sqlx::query("UPDATE session_lifecycle SET keep_until = $1 WHERE session_id = $2")
            .bind(timestamp(until))
            .bind(id.to_string())
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }
}

/// Keeps the lifecycle facts in step with a state change, inside its transaction: stores what
/// [`facts::after_transition`] decides (a start makes the session ready, a release re-queues it).
/// A start is added to `rows`, written with the change's own rows by their
/// [`history::NewRows::insert`] (a node's sync reporting its sessions started writes them in one
/// statement, not a read and a write each).
pub(super) async fn after_transition(
    tx: &mut Transaction<'static, Db>,
    id: SessionId,
    transition: &Transition,
    rows: &mut history::NewRows,
) -> StoreResult<()> {
    match facts::after_transition(transition) {
        Some(FactsChange::Ready { ready_at }) => rows.ready(id, ready_at),
        Some(FactsChange::Requeued { queued_at }) => {
            sqlx::query("UPDATE sessions SET queued_at = $1 WHERE id = $2")
                .bind(timestamp(queued_at))
                .bind(id.to_string())
                .execute(&mut **tx)
                .await?;
            sqlx::query(
                "UPDATE session_lifecycle SET ready_at = NULL, keep_until = NULL \
                 WHERE session_id = $1",
            )
            .bind(id.to_string())
            .execute(&mut **tx)
            .await?;
        }
        None => {}
    }
    Ok(())
}

/// Before a connection event changes the connection's row: bytes the client sent since the
/// last report are SSH traffic, seen at `at`. Output alone is not (a busy process shows as CPU;
/// a terminal printing a clock should not keep a session), nor are keep-alives, which the
/// gateway never counts as channel data.
pub(super) async fn note_traffic(
    tx: &mut Transaction<'static, Db>,
    event: &ConnectionEvent,
    at: DateTime<Utc>,
) -> StoreResult<()> {
    if event.event == ConnectionEventKind::Open {
        return Ok(());
    }
    let before: Option<(i64, i64)> =
        sqlx::query_as("SELECT bytes_in, bytes_out FROM connections WHERE id = $1")
            .bind(event.connection_id.to_string())
            .fetch_optional(&mut **tx)
            .await?;
    let (old_in, _) = before.unwrap_or((0, 0));
    let grew = clamp(event.bytes_in) > old_in;
    if grew {
        ensure_row(tx, event.session_id).await?;
        sqlx::query("UPDATE session_lifecycle SET last_traffic_at = $1 WHERE session_id = $2")
            .bind(timestamp(at))
            .bind(event.session_id.to_string())
            .execute(&mut **tx)
            .await?;
    }
    Ok(())
}

/// A periodic report of an open connection: its byte totals and that it is still there.
/// Returns the rows changed (0 when the connection is unknown or closed).
pub(super) async fn record_activity_report(
    tx: &mut Transaction<'static, Db>,
    event: &ConnectionEvent,
    at: DateTime<Utc>,
) -> StoreResult<u64> {
    let sql = format!(
        "UPDATE connections SET bytes_in = {GREATEST}(bytes_in, $1), \
         bytes_out = {GREATEST}(bytes_out, $2), last_report_at = $3 \
         WHERE id = $4 AND closed_at IS NULL"
    );
    Ok(sqlx::query(&sql)
        .bind(clamp(event.bytes_in))
        .bind(clamp(event.bytes_out))
        .bind(timestamp(at))
        .bind(event.connection_id.to_string())
        .execute(&mut **tx)
        .await?
        .rows_affected())
}

/// After a connection event is stored: an open (or a report) says the connection is there now;
/// a close is when the session was last used over SSH.
pub(super) async fn after_connection_event(
    tx: &mut Transaction<'static, Db>,
    event: &ConnectionEvent,
    at: DateTime<Utc>,
) -> StoreResult<()> {
    match event.event {
        ConnectionEventKind::Open | ConnectionEventKind::Activity => {
            sqlx::query(
                "UPDATE connections SET last_report_at = $1 WHERE id = $2 AND closed_at IS NULL",
            )
            .bind(timestamp(at))
            .bind(event.connection_id.to_string())
            .execute(&mut **tx)
            .await?;
        }
        ConnectionEventKind::Close => {
            ensure_row(tx, event.session_id).await?;
            sqlx::query("UPDATE session_lifecycle SET last_close_at = $1 WHERE session_id = $2")
                .bind(timestamp(at))
                .bind(event.session_id.to_string())
                .execute(&mut **tx)
                .await?;
        }
    }
    Ok(())
}

/// The lifecycle facts of the sessions in `scope`, read on `conn` (a pool connection, or a write
/// transaction that acts on them).
async fn facts_in(conn: &mut DbConnection, scope: FactsScope) -> StoreResult<Vec<LifecycleFacts>> {
    let rows = match &scope {
        FactsScope::Session(id) => {
            sqlx::query(&format!("SELECT {FACT_COLUMNS} WHERE s.id = $1"))
                .bind(id.to_string())
                .fetch_all(&mut *conn)
                .await?
        }
        FactsScope::States(states) => {
            if states.is_empty() {
                return Ok(Vec::new());
            }
            sqlx::query(&format!(
                "SELECT {FACT_COLUMNS} WHERE s.state IN ({}) ORDER BY s.created_at, s.id",
                states_listed(states.iter())
            ))
            .fetch_all(&mut *conn)
            .await?
        }
    };
    let open: Vec<(String, String)> = match &scope {
        FactsScope::Session(id) => {
            sqlx::query_as(
                "SELECT session_id, COALESCE(last_report_at, opened_at) FROM connections \
                     WHERE session_id = $1 AND closed_at IS NULL",
            )
            .bind(id.to_string())
            .fetch_all(&mut *conn)
            .await?
        }
        FactsScope::States(_) => {
            sqlx::query_as(
                "SELECT session_id, COALESCE(last_report_at, opened_at) FROM connections \
                     WHERE closed_at IS NULL",
            )
            .fetch_all(&mut *conn)
            .await?
        }
    };
    let mut reports: HashMap<SessionId, Vec<DateTime<Utc>>> = HashMap::new();
    for (session, at) in &open {
        reports
            .entry(parse(session, "session id")?)
            .or_default()
            .push(parse_timestamp(at)?);
    }
    rows.iter()
        .map(|row| {
            let mut facts = facts_from_row(row)?;
            let mut open = reports.remove(&facts.session_id).unwrap_or_default();
            open.sort();
            facts.open_connections = open;
            Ok(facts)
        })
        .collect()
}

/// The lifecycle row of a session being created, with its own idle timeout and maximum
/// lifetime, inside the creation's write `tx`.
pub(super) async fn insert_limits(
    tx: &mut Transaction<'static, Db>,
    limits: &[(SessionId, Option<u64>, Option<u64>)],
) -> StoreResult<()> {
    if limits.is_empty() {
        return Ok(());
    }
    let mut query = QueryBuilder::<Db>::new(
        "INSERT INTO session_lifecycle (session_id, idle_timeout_secs, max_duration_secs) ",
    );
    query.push_values(
        limits,
        |mut row, (id, idle_timeout_secs, max_duration_secs)| {
            row.push_bind(id.to_string())
                .push_bind(idle_timeout_secs.map(clamp))
                .push_bind(max_duration_secs.map(clamp));
        },
    );
    // Its text changes with the number of rows: not kept among the prepared statements.
    query.build().persistent(false).execute(&mut **tx).await?;
    Ok(())
}

async fn ensure_row(tx: &mut Transaction<'static, Db>, id: SessionId) -> StoreResult<()> {
    sqlx::query(
        "INSERT INTO session_lifecycle (session_id) SELECT id FROM sessions WHERE id = $1 \
         ON CONFLICT (session_id) DO NOTHING",
    )
    .bind(id.to_string())
    .execute(&mut **tx)
    .await?;
    Ok(())
}

fn facts_from_row(row: &DbRow) -> StoreResult<LifecycleFacts> {
    let time = |column: &str| -> StoreResult<Option<DateTime<Utc>>> {
        row.try_get::<Option<String>, _>(column)?
            .map(|t| parse_timestamp(&t))
            .transpose()
    };
    let secs = |column: &str| -> StoreResult<Option<u64>> {
        row.try_get::<Option<i64>, _>(column)?
            .map(|v| u64::try_from(v).map_err(|_| StoreError::Corrupt(format!("{column} {v}"))))
            .transpose()
    };
    let id: SessionId = parse(&row.try_get::<String, _>("id")?, "session id")?;
    Ok(LifecycleFacts {
        session_id: id,
        state: parse(&row.try_get::<String, _>("state")?, "session state")?,
        state_since: time("state_since")?
            .ok_or_else(|| StoreError::Corrupt(format!("session {id} has no history")))?,
        idle_timeout_secs: secs("idle_timeout_secs")?,
        max_duration_secs: secs("max_duration_secs")?,
        first_started_at: time("first_started_at")?,
        ready_at: time("ready_at")?,
        last_close_at: time("last_close_at")?,
        last_traffic_at: time("last_traffic_at")?,
        cpu: sampled_from_row(row, Measure::Cpu)?,
        gpu: sampled_from_row(row, Measure::Gpu)?,
        keep_until: time("keep_until")?,
        open_connections: Vec::new(),
    })
}

/// [`crate::store::Store::resuming_on`] on `executor` (the pool, or a connection a read holds).
pub(super) async fn read_resuming<'e, E>(
    executor: E,
    node: &NodeName,
) -> StoreResult<Vec<SessionId>>
where
    E: sqlx::Executor<'e, Database = Db>,
{
    let ids: Vec<String> = sqlx::query_scalar(
        "SELECT s.id FROM sessions s JOIN session_lifecycle l ON l.session_id = s.id \
         WHERE s.node = $1 AND s.state = 'STARTING' AND l.first_started_at IS NOT NULL",
    )
    .bind(node.as_str())
    .fetch_all(executor)
    .await?;
    ids.iter().map(|id| parse(id, "session id")).collect()
}
