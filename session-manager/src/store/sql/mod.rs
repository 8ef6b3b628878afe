//! The one SQL implementation of the [`Store`] for both databases, compiled once per backend.
//!
//! [`crate::store::sqlite`] and `crate::store::postgres` each include this folder as their module `sql`
//! (`#[path = "sql/mod.rs"]`), after naming what it is compiled against: `Db` (the sqlx
//! database), `DbRow`, `DbConnection`, `SqlStore` (the backend's store type, whose `write`
//! begins a write transaction and whose `read_snapshot` begins a read of one snapshot), and the
//! few SQL words the two spell differently (`GREATEST`, the JSON functions of `JOB_HISTORY`).
//! Every statement here is written once, in the SQL both databases take: `$1`-style parameters
//! (SQLite numbers `$N` as PostgreSQL does), `TRUE`/`FALSE`, `ON CONFLICT ... DO UPDATE`,
//! `RETURNING`, `CAST(1 AS BIGINT)`.
//!
//! Why inclusion rather than one generic type: sqlx's generic `Database` API would need every
//! function to carry bounds for each type it binds and decodes (`for<'q> i64: Encode<'q, DB> +
//! Type<DB>`, one per type, and the executor bounds), and sqlx's `Any` driver converts every
//! value at run time and decodes SQLite's integer booleans as integers. Compiled once per
//! backend, this code keeps each driver's own types and checks, and is still written once.
//!
//! Session states change only through [`change_lifecycle`] (for one change in a write of its
//! own, [`apply_change`]; for many in one write, [`SqlStore::write_changes`]), on the stored
//! history replayed into an [`ongrid_core::Lifecycle`]; the new history rows and states are
//! written together by `history::NewRows::insert`, so a session's row is read after it, not
//! before; times are stored as fixed-width RFC 3339 text with nanoseconds, so they round-trip
//! exactly and sort as text (in `TEXT COLLATE "C"` columns on PostgreSQL).

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use chrono::{DateTime, SecondsFormat, Utc};
use futures::future::BoxFuture;
use ongrid_core::{
    Dn, GpuHealth, GpuId, GpuInfo, GpuMode, GpuUuid, Lifecycle, NodeName, SessionId, SessionName,
    Transition, UserName,
};
use sqlx::{QueryBuilder, Row, Transaction};

use ongrid_core::api::{AuditRecord, ConnectionEvent, UserEvent};
use ongrid_core::{Institute, InstituteName};

use super::{Db, DbConnection, DbRow, SqlStore, GREATEST, JOB_HISTORY};
use crate::domain::grid_jobs::EngineJobId;
use crate::domain::images::{ImageChange, ImageRecord};
use crate::domain::jobs::{JobChange, JobRecord, NewJob};
use crate::domain::sessions::holds::{LifecycleConfig, LifecycleFacts};
use crate::domain::sessions::{connections, rendered_reason, Change, SessionRecord};
use crate::domain::users::{Removal, Removed};
use crate::store::{
    AuditFilter, ConnectionRecorded, DesiredReads, FactsScope, GpuRecord, Heartbeat, ImageDeleted,
    ImageFilter, JobFilter, KeyAdded, KeyRecord, NewImage, NewKey, NewSession, NodeRecord,
    NodeRegistration, NodeWork, PlanningNodes, RoundOutcomes, SessionFilter, StateCounts, Store,
    StoreError, StoreResult, UserRecord,
};
use ongrid_core::gpu::Drain;
use ongrid_core::holds::{ContainerActivity, HoldReason};
use ongrid_core::job::JobId;
use ongrid_core::store_identity::StoreIdentity;

use crate::store::NodeRemoval;

/// One caller's changes of sessions and of jobs (each job's with the next job of its chain when
/// the change makes one), written by [`SqlStore::write_changes`].
#[derive(Debug)]
pub struct Changes {
    sessions: Vec<(SessionId, Change)>,
    jobs: jobs::JobChanges,
}

/// The callers' changes waiting for a write, each answered with its changes' outcomes.
pub type ChangeQueue = together::WriteQueue<Changes, RoundOutcomes>;

impl SqlStore {
    /// Applies the changes of sessions and of jobs, each through its replayed lifecycle, in the
    /// write of every caller's changes waiting with them ([`together`], [`ChangeQueue`]): the
    /// scheduler's rounds, the nodes' syncs reporting sessions started and jobs ended, people
    /// removing their sessions and cancelling their jobs. On a large site these come by the
    /// hundred a minute, and one write each kept the writer that creates wait for busy (on
    /// PostgreSQL, by the fleet bench's statement log, the write lock was held 92% of the run,
    /// a third of that by syncs' reports of one session each and another third by removals).
    ///
    /// In the write, the sessions' changes of every caller come first, in the callers' order,
    /// then the jobs' (no change of a session reads a job, nor the other way round); each
    /// kind's outcomes are given in order. A refused change is left out and the others are
    /// stored; an error of the database fails the write, and each caller's changes are then
    /// written alone, so that error is only the failing caller's.
    pub(super) async fn write_changes(
        &self,
        sessions: Vec<(SessionId, Change)>,
        jobs: jobs::JobChanges,
    ) -> StoreResult<RoundOutcomes> {
        if sessions.is_empty() && jobs.is_empty() {
            return Ok(RoundOutcomes::default());
        }
        self.changes
            .write(
                self,
                Changes { sessions, jobs },
                together::Lock::Site,
                |_, tx, batches| Box::pin(write_changes_in(tx, batches)),
            )
            .await
    }
}

/// Writes the changes of every caller in `batches` in `tx` and commits: each caller's outcomes
/// ([`SqlStore::write_changes`]).
async fn write_changes_in(
    mut tx: Transaction<'static, Db>,
    batches: &[Changes],
) -> StoreResult<Vec<StoreResult<RoundOutcomes>>> {
    // One change number for the sessions and the jobs: they commit together.
    let mut stamp = planning::Stamp::default();
    let sessions = batches.iter().flat_map(|b| b.sessions.iter().cloned());
    let mut sessions = transitions_in(&mut tx, sessions.collect(), &mut stamp)
        .await?
        .into_iter();
    let jobs = batches.iter().flat_map(|b| b.jobs.iter().cloned());
    let mut jobs = jobs::job_transitions_in(&mut tx, jobs.collect(), &mut stamp)
        .await?
        .into_iter();
    debug_assert_eq!(
        (sessions.len(), jobs.len()),
        batches
            .iter()
            .fold((0, 0), |(s, j), b| (s + b.sessions.len(), j + b.jobs.len())),
        "one outcome per change"
    );
    tx.commit().await?;
    Ok(batches
        .iter()
        .map(|batch| {
            Ok(RoundOutcomes {
                sessions: sessions.by_ref().take(batch.sessions.len()).collect(),
                jobs: jobs.by_ref().take(batch.jobs.len()).collect(),
            })
        })
        .collect())
}

const SESSION_COLUMNS: &str = "s.id, s.name, s.owner, u.user_name, u.uid, s.state, s.reason, \
     s.hold_reason, \
     s.request, s.image, s.node, s.gpus, s.created_at, s.queued_at, s.preferred_node \
     FROM sessions s JOIN users u ON u.dn = s.owner";

impl SqlStore {
    async fn user(&self, dn: &Dn, first_uid: u32) -> StoreResult<UserRecord> {
        if let Some(user) = find_user(&self.pool, dn).await? {
            return Ok(user);
        }
        let mut tx = self.write().await?;
        // Another request may have created it between the read and the lock.
        if let Some(user) = find_user(&mut *tx, dn).await? {
            return Ok(user);
        }
        let base = UserName::derive_from_dn(dn);
        let mut user_name = base.clone();
        for n in 2u32.. {
            let taken: Option<i64> =
                sqlx::query_scalar("SELECT CAST(1 AS BIGINT) FROM users WHERE user_name = $1")
                    .bind(user_name.as_str())
                    .fetch_optional(&mut *tx)
                    .await?;
            if taken.is_none() {
                break;
            }
            user_name = UserName::parse(&format!("{base}-{n}"))
                .map_err(|e| StoreError::Corrupt(format!("cannot number user name: {e}")))?;
        }
        let max_uid: Option<i64> = sqlx::query_scalar("SELECT MAX(uid) FROM users")
            .fetch_one(&mut *tx)
            .await?;
        let uid = match max_uid {
            Some(max) => u32::try_from(max + 1)
                .map_err(|_| StoreError::Corrupt(format!("UID {max} is out of range")))?
                .max(first_uid),
            None => first_uid,
        };
        sqlx::query("INSERT INTO users (dn, user_name, uid, created_at) VALUES ($1, $2, $3, $4)")
            .bind(dn.as_str())
            .bind(user_name.as_str())
            .bind(i64::from(uid))
            .bind(timestamp(Utc::now()))
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        tracing::info!(dn = %dn, user = %user_name, uid, "New user.");
        Ok(UserRecord {
            dn: dn.clone(),
            user_name,
            uid,
            removed: None,
        })
    }

    async fn session(&self, id: SessionId) -> StoreResult<Option<SessionRecord>> {
        find_session(&self.pool, id).await
    }

    async fn session_by_name(
        &self,
        owner: &Dn,
        name: &SessionName,
    ) -> StoreResult<Option<SessionRecord>> {
        let sql = format!(
            "SELECT {SESSION_COLUMNS} WHERE s.owner = $1 AND s.name = $2 \
             ORDER BY s.state = 'ENDED', s.created_at DESC LIMIT 1"
        );
        let row = sqlx::query(&sql)
            .bind(owner.as_str())
            .bind(name.as_str())
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(session_from_row).transpose()
    }

    /// How many sessions (not ended) and jobs are in each state, as the database keeps them
    /// (`state_counts`, migration 0028: its triggers count every row written), and the GPUs in
    /// use: the two at once.
    async fn state_counts(&self) -> StoreResult<StateCounts> {
        let counts = async {
            let rows = sqlx::query(
                "SELECT kind, state, n FROM state_counts \
                 WHERE n <> 0 AND NOT (kind = 'session' AND state = 'ENDED') \
                 ORDER BY kind, state",
            )
            .fetch_all(&self.pool)
            .await?;
            let (mut sessions, mut jobs) = (Vec::new(), Vec::new());
            for row in &rows {
                let count = (row.try_get::<String, _>("state")?, row.try_get("n")?);
                match row.try_get::<&str, _>("kind")? {
                    "session" => sessions.push(count),
                    "job" => jobs.push(count),
                    other => return Err(StoreError::Corrupt(format!("state counts of {other:?}"))),
                }
            }
            StoreResult::Ok((sessions, jobs))
        };
        let ((sessions, jobs), gpus_in_use) = tokio::try_join!(counts, self.gpus_in_use())?;
        Ok(StateCounts {
            sessions,
            jobs,
            gpus_in_use,
        })
    }

    /// The GPUs held by sessions and jobs in a state that holds GPUs, from the copies kept for
    /// planning (which hold every such record), brought up to date with the records changed
    /// since: no holder's row is read again. The two copies are two reads, not one snapshot: a
    /// GPU going from a session to a job between them may count as free in one scrape.
    async fn gpus_in_use(&self) -> StoreResult<BTreeSet<GpuId>> {
        let (sessions, jobs) = tokio::try_join!(self.planning_sessions(), self.planning_jobs())?;
        let sessions = sessions
            .iter()
            .filter(|session| session.state.holds_gpus())
            .flat_map(|session| session.gpus.iter());
        let jobs = jobs
            .iter()
            .filter(|job| job.state().holds_gpus())
            .flat_map(|job| job.gpus.iter());
        Ok(sessions.chain(jobs).cloned().collect())
    }

    async fn sessions(&self, filter: SessionFilter) -> StoreResult<Vec<SessionRecord>> {
        read_sessions(&self.pool, filter).await
    }

    async fn transitions(&self, id: SessionId) -> StoreResult<Vec<Transition>> {
        let mut conn = self.pool.acquire().await?;
        load_transitions(&mut conn, id).await
    }

    async fn transition(&self, id: SessionId, change: Change) -> StoreResult<SessionRecord> {
        for outcome in self.transition_all(vec![(id, change)]).await? {
            outcome?;
        }
        self.session(id).await?.ok_or(StoreError::NoSuchSession(id))
    }

    async fn transition_all(
        &self,
        changes: Vec<(SessionId, Change)>,
    ) -> StoreResult<Vec<StoreResult<()>>> {
        Ok(self.write_changes(changes, Vec::new()).await?.sessions)
    }

    /// A scheduling round's placements and job changes in one write
    /// ([`crate::store::Store::round_changes`]).
    async fn round_changes(
        &self,
        sessions: Vec<(SessionId, Change)>,
        jobs: Vec<(JobId, JobChange, Option<NewJob>)>,
    ) -> StoreResult<RoundOutcomes> {
        self.write_changes(sessions, jobs).await
    }

    async fn register_node(
        &self,
        node: NodeRegistration,
        gpus: &[GpuInfo],
        at: DateTime<Utc>,
    ) -> StoreResult<()> {
        let mut tx = self.write().await?;
        sqlx::query(
            "INSERT INTO nodes (name, gpu_backend, agent_version, stream_url, registered_at, \
             last_seen) VALUES ($1, $2, $3, $4, $5, $6) \
             ON CONFLICT (name) DO UPDATE SET gpu_backend = excluded.gpu_backend, \
             agent_version = excluded.agent_version, stream_url = excluded.stream_url, \
             last_seen = excluded.last_seen, \
             drain = CASE WHEN nodes.removed_at IS NULL THEN nodes.drain END, removed_at = NULL",
        )
        .bind(node.name.as_str())
        .bind(&node.gpu_backend)
        .bind(&node.agent_version)
        .bind(&node.stream_url)
        .bind(timestamp(at))
        .bind(timestamp(at))
        .execute(&mut *tx)
        .await?;
        // The node's row changed (its stream, its agent's version, a drain or removal ended):
        // the planning read takes it again, with the GPUs when they changed too.
        if !update_gpus(&mut tx, &node.name, gpus, &node.start_modes, at).await? {
            inventory::bump(&mut tx).await?;
        }
        tx.commit().await?;
        Ok(())
    }

    async fn record_sync(
        &self,
        node: &NodeName,
        gpus: &[GpuInfo],
        at: DateTime<Utc>,
    ) -> StoreResult<Option<Heartbeat>> {
        if let Some(heartbeat) = self.heartbeat_only(node, gpus, at).await? {
            return Ok(Some(heartbeat));
        }
        let mut tx = self.write().await?;
        let Some(last_seen) = nodes::last_seen(&mut tx, node).await? else {
            return Ok(None);
        };
        sqlx::query("UPDATE nodes SET last_seen = $1 WHERE name = $2")
            .bind(timestamp(at))
            .bind(node.as_str())
            .execute(&mut *tx)
            .await?;
        let gpus_changed = update_gpus(&mut tx, node, gpus, &BTreeMap::new(), at).await?;
        tx.commit().await?;
        Ok(Some(Heartbeat {
            last_seen,
            gpus_changed,
        }))
    }

    /// A sync's heartbeat when the node reports its GPUs exactly as stored (the common case
    /// wherever nothing reports a changing utilisation): read first, then the one `UPDATE` of
    /// its `last_seen`, written with the other syncs' records waiting then
    /// ([`sync_records`]), one statement in their write instead of a transaction of five.
    /// `None` when the GPUs differ, or the node is not registered: then [`Self::record_sync`]
    /// compares and writes them under the write lock.
    async fn heartbeat_only(
        &self,
        node: &NodeName,
        gpus: &[GpuInfo],
        at: DateTime<Utc>,
    ) -> StoreResult<Option<Heartbeat>> {
        // The node's last sync and its GPUs in one statement: one row per GPU, or one without
        // a GPU; none when the node is not registered.
        let rows: Vec<(String, Option<String>)> = sqlx::query_as(
            "SELECT n.last_seen, g.info FROM nodes n LEFT JOIN gpus g ON g.node = n.name \
             WHERE n.name = $1 AND n.removed_at IS NULL",
        )
        .bind(node.as_str())
        .fetch_all(&self.pool)
        .await?;
        let Some((last_seen, _)) = rows.first() else {
            return Ok(None);
        };
        let stored = rows
            .iter()
            .filter_map(|(_, info)| info.as_deref())
            .map(|info| from_json::<GpuInfo>(info, "GPU info"))
            .collect::<StoreResult<Vec<_>>>()?;
        let as_stored = stored.len() == gpus.len()
            && gpus
                .iter()
                .all(|gpu| stored.iter().any(|known| known == gpu));
        if !as_stored {
            return Ok(None);
        }
        if !self.write_heartbeat(node, at).await? {
            return Ok(None);
        }
        Ok(Some(Heartbeat {
            last_seen: parse_timestamp(last_seen)?,
            gpus_changed: false,
        }))
    }

    /// Every registered node with its GPUs, ordered by name; only `only` when given.
    async fn node_records(&self, only: Option<&NodeName>) -> StoreResult<Vec<NodeRecord>> {
        let node_rows = self.node_rows(only).await?;
        let mut gpus = self.gpus_by_node(only).await?;
        node_rows
            .iter()
            .map(|row| {
                let mut node = node_from_row(row)?;
                node.gpus = gpus.remove(&node.name).unwrap_or_default();
                Ok(node)
            })
            .collect()
    }

    /// The rows of the registered nodes (of `only` when given), ordered by name.
    async fn node_rows(&self, only: Option<&NodeName>) -> StoreResult<Vec<DbRow>> {
        let which = match only {
            None => "ORDER BY name",
            Some(_) => "AND name = $1",
        };
        let sql = format!(
            "SELECT name, gpu_backend, agent_version, stream_url, last_seen, drain FROM nodes \
             WHERE removed_at IS NULL {which}"
        );
        Ok(query_with(&sql, only.map(NodeName::as_str))
            .fetch_all(&self.pool)
            .await?)
    }

    /// The GPUs of every node (of `only` when given), each node's ordered by PCI bus id.
    async fn gpus_by_node(&self, only: Option<&NodeName>) -> StoreResult<inventory::GpusByNode> {
        read_gpus_by_node(&self.pool, only).await
    }

    async fn set_gpu_mode(&self, uuid: &GpuUuid, mode: GpuMode) -> StoreResult<Option<GpuRecord>> {
        let mut tx = self.write().await?;
        let row = sqlx::query(
            "UPDATE gpus SET mode = $1 WHERE uuid = $2 RETURNING node, info, mode, drain",
        )
        .bind(mode.to_string())
        .bind(uuid.as_str())
        .fetch_optional(&mut *tx)
        .await?;
        if row.is_some() {
            inventory::bump(&mut tx).await?;
        }
        tx.commit().await?;
        row.as_ref().map(gpu_from_row).transpose()
    }
}

/// Trait methods that box the future of [`SqlStore`]'s inherent method of the same name (which
/// a method call finds first): `fn name(arg: T) -> R;` stands for
/// `fn name<'a>(&'a self, arg: T) -> BoxFuture<'a, StoreResult<R>>`, so an argument borrowed for
/// the call is written `&'a`.
macro_rules! boxed {
    ($(fn $name:ident($($arg:ident: $type:ty),* $(,)?) -> $out:ty;)*) => {
        $(
            fn $name<'a>(&'a self, $($arg: $type),*) -> BoxFuture<'a, StoreResult<$out>> {
                Box::pin(SqlStore::$name(self, $($arg),*))
            }
        )*
    };
}

impl Store for SqlStore {
    fn dashboard(&self) -> &dyn crate::store::DashboardStore {
        self
    }

    fn gpu_policy(&self) -> &dyn crate::store::gpu_policy::GpuPolicyStore {
        self
    }

    fn nodes(&self) -> BoxFuture<'_, StoreResult<Vec<NodeRecord>>> {
        Box::pin(self.node_records(None))
    }

    fn node<'a>(&'a self, name: &'a NodeName) -> BoxFuture<'a, StoreResult<Option<NodeRecord>>> {
        Box::pin(async move { Ok(self.node_records(Some(name)).await?.pop()) })
    }

    boxed! {
        fn identity() -> StoreIdentity;
        fn mark_restored(at_least: Option<u64>) -> StoreIdentity;
        fn token_link(issuer: &'a str, subject: &'a str) -> Option<Dn>;
        fn link_token(link: &'a crate::store::TokenLink) -> bool;
        fn unlink_token(issuer: &'a str, subject: &'a str) -> Option<crate::store::TokenLink>;
        fn token_links() -> Vec<crate::store::TokenLink>;
        fn user(dn: &'a Dn, first_uid: u32) -> UserRecord;
        fn user_and_group(
            dn: &'a Dn,
            first_uid: u32,
        ) -> (UserRecord, Option<crate::domain::policy::GroupName>);
        fn create_session(new: NewSession) -> SessionRecord;
        fn session(id: SessionId) -> Option<SessionRecord>;
        fn session_by_name(owner: &'a Dn, name: &'a SessionName) -> Option<SessionRecord>;
        fn sessions(filter: SessionFilter) -> Vec<SessionRecord>;
        fn state_counts() -> StateCounts;
        fn pending_order() -> Vec<SessionId>;
        fn pending_place(id: SessionId) -> Option<u32>;
        fn transitions(id: SessionId) -> Vec<Transition>;
        fn transition(id: SessionId, change: Change) -> SessionRecord;
        fn transition_all(changes: Vec<(SessionId, Change)>) -> Vec<StoreResult<()>>;
        fn round_changes(
            sessions: Vec<(SessionId, Change)>,
            jobs: Vec<(JobId, JobChange, Option<NewJob>)>,
        ) -> RoundOutcomes;
        fn register_node(node: NodeRegistration, gpus: &'a [GpuInfo], at: DateTime<Utc>) -> ();
        fn record_sync(node: &'a NodeName, gpus: &'a [GpuInfo], at: DateTime<Utc>) -> Option<Heartbeat>;
        fn planning_nodes(seen_since: DateTime<Utc>) -> PlanningNodes;
        fn desired_reads(node: &'a NodeName, images_removed_since: DateTime<Utc>) -> Option<DesiredReads>;
        fn desired_reads_and_work(
            node: &'a NodeName,
            images_removed_since: DateTime<Utc>,
        ) -> Option<(DesiredReads, NodeWork)>;
        fn planning_sessions() -> Vec<std::sync::Arc<SessionRecord>>;
        fn set_gpu_mode(uuid: &'a GpuUuid, mode: GpuMode) -> Option<GpuRecord>;
        fn set_node_drain(node: &'a NodeName, drain: Option<Drain>) -> bool;
        fn set_gpu_drain(uuid: &'a GpuUuid, drain: Option<Drain>) -> Option<GpuRecord>;
        fn remove_node(node: &'a NodeName, at: DateTime<Utc>, node_timeout: Duration) -> NodeRemoval;
        fn add_key(key: NewKey, max_per_owner: usize) -> KeyAdded;
        fn key(fingerprint: &'a str) -> Option<KeyRecord>;
        fn keys(owner: Option<&'a Dn>) -> Vec<KeyRecord>;
        fn remove_key(fingerprint: &'a str, owner: Option<&'a Dn>) -> Option<KeyRecord>;
        fn add_institute(institute: &'a Institute, at: DateTime<Utc>) -> ();
        fn institute(name: &'a InstituteName) -> Option<Institute>;
        fn institutes() -> Vec<Institute>;
        fn remove_institute(name: &'a InstituteName) -> Option<Institute>;
        fn record_connection(event: &'a ConnectionEvent, at: DateTime<Utc>) -> ConnectionRecorded;
        fn audit(filter: AuditFilter) -> Vec<AuditRecord>;
        fn prune_connections(closed_before: DateTime<Utc>, limit: u32) -> u64;
        fn create_job(new: NewJob) -> JobRecord;
        fn job(id: JobId) -> Option<JobRecord>;
        fn jobs(filter: JobFilter) -> Vec<JobRecord>;
        fn planning_jobs() -> Vec<std::sync::Arc<JobRecord>>;
        fn job_transition(id: JobId, change: JobChange, next: Option<NewJob>) -> JobRecord;
        fn job_transition_all(
            changes: Vec<(JobId, JobChange, Option<NewJob>)>,
        ) -> Vec<StoreResult<()>>;
        fn record_job_logs(logs: Vec<crate::store::OutputKept>) -> ();
        fn remove_job(
            id: JobId,
            output_grace: Duration,
            now: DateTime<Utc>,
        ) -> crate::store::JobRemoval;
        fn prune_jobs(ended_before: DateTime<Utc>, limit: u32) -> Vec<JobId>;
        fn set_engine_id(id: JobId, engine_id: &'a EngineJobId) -> ();
        fn mark_submit_started(id: JobId, at: Option<DateTime<Utc>>) -> ();
        fn record_engine_poll(id: JobId, poll: crate::domain::engine_job::EnginePoll<'a>) -> ();
        fn grid_jobs_to_mirror() -> Vec<JobRecord>;
        fn create_image(new: NewImage) -> ImageRecord;
        fn image(id: uuid::Uuid) -> Option<ImageRecord>;
        fn images(filter: ImageFilter) -> Vec<ImageRecord>;
        fn record_freeze(
            node: &'a NodeName,
            id: uuid::Uuid,
            change: &'a ImageChange,
            at: DateTime<Utc>,
        ) -> Option<ImageRecord>;
        fn set_image_shared(id: uuid::Uuid, shared_at: Option<DateTime<Utc>>) -> Option<ImageRecord>;
        fn delete_image(id: uuid::Uuid, at: DateTime<Utc>) -> Option<ImageDeleted>;
        fn lifecycle_facts(scope: FactsScope) -> Vec<LifecycleFacts>;
        fn resuming_on(node: &'a NodeName) -> Vec<SessionId>;
        fn set_keep_until(id: SessionId, until: DateTime<Utc>) -> ();
        fn record_activity(
            node: &'a NodeName,
            samples: &'a [ContainerActivity],
            at: DateTime<Utc>,
            lifecycle: &'a LifecycleConfig,
        ) -> usize;
        fn hold_if_due(
            id: SessionId,
            config: &'a LifecycleConfig,
            now: DateTime<Utc>,
        ) -> Option<(SessionRecord, HoldReason)>;
        fn existing_user(dn: &'a Dn) -> Option<UserRecord>;
        fn users() -> Vec<UserRecord>;
        fn set_accounting_group(
            dn: &'a Dn,
            group: &'a crate::domain::policy::GroupName,
            now: DateTime<Utc>,
        ) -> ();
        fn usage_accounts() -> Vec<crate::domain::policy::fairshare::Account>;
        fn save_usage(accounts: &'a [crate::domain::policy::fairshare::Account]) -> ();
        fn user_events(dn: Option<&'a Dn>) -> Vec<(Dn, UserEvent)>;
        fn remove_user(
            dn: &'a Dn,
            by: &'a Dn,
            at: DateTime<Utc>,
            removal: &'a Removal,
        ) -> Option<Vec<KeyRecord>>;
        fn restore_user(dn: &'a Dn, by: &'a Dn, at: DateTime<Utc>) -> Option<UserRecord>;
    }
}

/// Refuses, inside a write transaction, to give anything new to `dn` once an admin removed
/// them: a request that authenticated just before the removal must not leave a key, a session
/// or an image behind it.
pub(super) async fn refuse_removed(tx: &mut Transaction<'static, Db>, dn: &Dn) -> StoreResult<()> {
    let removed: Option<Option<String>> =
        sqlx::query_scalar("SELECT removed_at FROM users WHERE dn = $1")
            .bind(dn.as_str())
            .fetch_optional(&mut **tx)
            .await?;
    match removed.flatten() {
        Some(_) => Err(StoreError::UserRemoved(dn.clone())),
        None => Ok(()),
    }
}

/// Those of `owners` an admin removed.
pub(super) async fn removed_among(
    tx: &mut Transaction<'static, Db>,
    owners: &BTreeSet<&Dn>,
) -> StoreResult<HashSet<Dn>> {
    let mut query =
        QueryBuilder::<Db>::new("SELECT dn FROM users WHERE removed_at IS NOT NULL AND dn IN (");
    let mut listed = query.separated(", ");
    for owner in owners {
        listed.push_bind(owner.as_str());
    }
    query.push(")");
    let rows: Vec<String> = query
        .build_query_scalar()
        .persistent(false)
        .fetch_all(&mut **tx)
        .await?;
    rows.iter()
        .map(|dn| Dn::parse(dn).map_err(|e| StoreError::Corrupt(format!("stored DN: {e}"))))
        .collect()
}

/// The owner's first default name that no live session of theirs has: `dev`, then `dev-2`,
/// `dev-3`, ... Only names exactly of that form count ([`default_name_number`]): `dev-1`,
/// `dev-02` or `dev-x` take no number. The database hands back the owner's live names of the
/// family and they are counted here: counted by SQL (each name cut and cast there, the numbers
/// matched against themselves) the statement cost 2.5 times the reading of the names, and it
/// ran once per create, 2 ms each under load for an owner with 200 sessions.
async fn first_free_name<'e, E>(executor: E, owner: &Dn) -> StoreResult<SessionName>
where
    E: sqlx::Executor<'e, Database = Db>,
{
    let names: Vec<String> = sqlx::query_scalar(
        "SELECT name FROM sessions WHERE owner = $1 AND state <> 'ENDED' \
         AND (name = 'dev' OR SUBSTR(name, 1, 4) = 'dev-')",
    )
    .bind(owner.as_str())
    .fetch_all(executor)
    .await?;
    let taken: HashSet<u32> = names
        .iter()
        .filter_map(|n| default_name_number(n))
        .collect();
    let n = (1..=u32::MAX)
        .find(|n| !taken.contains(n))
        .ok_or_else(|| StoreError::Corrupt("every default name is taken".to_owned()))?;
    let name = if n == 1 {
        "dev".to_owned()
    } else {
        format!("dev-{n}")
    };
    SessionName::parse(&name).map_err(|e| StoreError::Corrupt(e.to_string()))
}

/// The number a default name takes: 1 for `dev`, n for `dev-n` (n from 2, digits only, no
/// leading zero, at most nine of them); `None` for any other name.
fn default_name_number(name: &str) -> Option<u32> {
    if name == "dev" {
        return Some(1);
    }
    let digits = name.strip_prefix("dev-")?;
    let numeral = (1..=9).contains(&digits.len())
        && digits.bytes().all(|b| b.is_ascii_digit())
        && !digits.starts_with('0');
    match digits.parse() {
        Ok(n) if numeral && n >= 2 => Some(n),
        _ => None,
    }
}

async fn find_user<'e, E>(executor: E, dn: &Dn) -> StoreResult<Option<UserRecord>>
where
    E: sqlx::Executor<'e, Database = Db>,
{
    let row =
        sqlx::query("SELECT dn, user_name, uid, removed_at, removed_by FROM users WHERE dn = $1")
            .bind(dn.as_str())
            .fetch_optional(executor)
            .await?;
    row.as_ref().map(user_from_row).transpose()
}

/// A user from `dn, user_name, uid, removed_at, removed_by`.
fn user_from_row(row: &DbRow) -> StoreResult<UserRecord> {
    let uid: i64 = row.try_get("uid")?;
    let removed_at: Option<String> = row.try_get("removed_at")?;
    let removed_by: Option<String> = row.try_get("removed_by")?;
    let removed = match (removed_at, removed_by) {
        (Some(at), Some(by)) => Some(Removed {
            at: parse_timestamp(&at)?,
            by: parse(&by, "admin DN")?,
        }),
        (None, None) => None,
        _ => return Err(StoreError::Corrupt("half a user removal".to_owned())),
    };
    Ok(UserRecord {
        dn: parse(&row.try_get::<String, _>("dn")?, "user DN")?,
        user_name: parse(&row.try_get::<String, _>("user_name")?, "user name")?,
        uid: u32::try_from(uid)
            .map_err(|_| StoreError::Corrupt(format!("UID {uid} is out of range")))?,
        removed,
    })
}

/// [`Store::sessions`] on `executor` (the pool, or a connection a read holds).
async fn read_sessions<'e, E>(executor: E, filter: SessionFilter) -> StoreResult<Vec<SessionRecord>>
where
    E: sqlx::Executor<'e, Database = Db>,
{
    let (condition, value) = match filter {
        SessionFilter::Owner(owner) => ("s.owner = $1".to_owned(), Some(owner.to_string())),
        SessionFilter::All => ("TRUE".to_owned(), None),
        SessionFilter::Node(node) => ("s.node = $1".to_owned(), Some(node.to_string())),
        SessionFilter::States(states) => {
            if states.is_empty() {
                return Ok(Vec::new());
            }
            (
                format!("s.state IN ({})", states_listed(states.iter())),
                None,
            )
        }
    };
    let sql = format!(
        "SELECT {SESSION_COLUMNS} WHERE s.state <> 'ENDED' AND {condition} \
         ORDER BY s.created_at, s.id"
    );
    let rows = query_with(&sql, value.as_deref())
        .fetch_all(executor)
        .await?;
    rows.iter().map(session_from_row).collect()
}

/// [`SqlStore::gpus_by_node`] on `executor` (the pool, or a connection a read holds).
async fn read_gpus_by_node<'e, E>(
    executor: E,
    only: Option<&NodeName>,
) -> StoreResult<inventory::GpusByNode>
where
    E: sqlx::Executor<'e, Database = Db>,
{
    let sql = match only {
        None => "SELECT node, info, mode, drain FROM gpus",
        Some(_) => "SELECT node, info, mode, drain FROM gpus WHERE node = $1",
    };
    let rows = query_with(sql, only.map(NodeName::as_str))
        .fetch_all(executor)
        .await?;
    let mut gpus: BTreeMap<NodeName, Vec<GpuRecord>> = BTreeMap::new();
    for row in &rows {
        let gpu = gpu_from_row(row)?;
        gpus.entry(gpu.node.clone()).or_default().push(gpu);
    }
    Ok(gpus
        .into_iter()
        .map(|(node, mut list)| {
            list.sort_by(|a, b| {
                (&a.info.pci_bus_id, &a.info.uuid).cmp(&(&b.info.pci_bus_id, &b.info.uuid))
            });
            (node, list.into())
        })
        .collect())
}

async fn find_session<'e, E>(executor: E, id: SessionId) -> StoreResult<Option<SessionRecord>>
where
    E: sqlx::Executor<'e, Database = Db>,
{
    let sql = format!("SELECT {SESSION_COLUMNS} WHERE s.id = $1");
    let row = sqlx::query(&sql)
        .bind(id.to_string())
        .fetch_optional(executor)
        .await?;
    row.as_ref().map(session_from_row).transpose()
}

/// Applies `change` to the session through its replayed [`Lifecycle`] inside `tx`: the new
/// transition, state, reason and placement. Returns the stored transition.
async fn apply_change(
    tx: &mut Transaction<'static, Db>,
    id: SessionId,
    change: Change,
) -> StoreResult<Transition> {
    let mut lifecycle = history::lifecycle_of(id, load_transitions(tx, id).await?)?;
    let mut rows = history::NewRows::default();
    let mut stamp = planning::Stamp::default();
    let transition =
        change_lifecycle(tx, id, &mut lifecycle, change, &mut stamp, &mut rows).await?;
    rows.insert(tx).await?;
    Ok(transition)
}

/// Applies each change through its session's replayed lifecycle in the write `tx`
/// ([`crate::store::Store::transition_all`]); each change's outcome, in order.
async fn transitions_in(
    tx: &mut Transaction<'static, Db>,
    changes: Vec<(SessionId, Change)>,
    stamp: &mut planning::Stamp,
) -> StoreResult<Vec<StoreResult<()>>> {
    let mut outcomes = Vec::with_capacity(changes.len());
    let ids: Vec<SessionId> = changes.iter().map(|(id, _)| *id).collect();
    let mut lifecycles = history::lifecycles(tx, &ids).await?;
    let mut rows = history::NewRows::default();
    for (id, change) in changes {
        // A session changed twice is read again, its first change's row and state written.
        let lifecycle = match lifecycles.remove(&id) {
            Some(lifecycle) => Ok(lifecycle),
            None => {
                rows.insert(tx).await?;
                history::lifecycle_of(id, load_transitions(tx, id).await?)
            }
        };
        // A refusal is decided before anything of the change is written.
        let changed = match lifecycle {
            Ok(mut lifecycle) => {
                change_lifecycle(tx, id, &mut lifecycle, change, stamp, &mut rows).await
            }
            Err(error) => Err(error),
        };
        match changed {
            Ok(_) => outcomes.push(Ok(())),
            Err(refused @ (StoreError::InvalidTransition(_) | StoreError::NoSuchSession(_))) => {
                outcomes.push(Err(refused))
            }
            Err(other) => return Err(other),
        }
    }
    rows.insert(tx).await?;
    Ok(outcomes)
}

/// [`apply_change`] to the session's `lifecycle` as stored, stamped with the write's `stamp`. Its
/// new history row and its new state are added to `rows`, for the caller to write (the
/// `sessions` row is as before until then); a change that folds into the rows before it (a
/// CONNECTED ⇄ IDLE flip) writes `rows` first, then folds.
async fn change_lifecycle(
    tx: &mut Transaction<'static, Db>,
    id: SessionId,
    lifecycle: &mut Lifecycle,
    change: Change,
    stamp: &mut planning::Stamp,
    rows: &mut history::NewRows,
) -> StoreResult<Transition> {
    let seq = lifecycle.history().len();
    let folded = connections::folds(lifecycle.history(), change.to);
    let sentence = change.sentence();
    let transition = lifecycle.transition(change.to, change.at, sentence)?;
    if folded {
        // The rows it folds into are written first.
        rows.insert(tx).await?;
        fold_transition(tx, id, seq, transition, &change.reason).await?;
    } else {
        rows.push(id, seq, transition, (&change.reason, change.hold))?;
    }
    activity::after_transition(tx, id, transition, rows).await?;
    let change_seq = stamp.get(tx).await?;
    rows.set_state(
        id,
        transition.to,
        (&change.reason, change.hold),
        &change.placement,
        change_seq,
    )?;
    Ok(transition.clone())
}

async fn load_transitions(conn: &mut DbConnection, id: SessionId) -> StoreResult<Vec<Transition>> {
    let sql = format!(
        "SELECT {TRANSITION_COLUMNS} FROM session_transitions WHERE session_id = $1 ORDER BY seq"
    );
    let rows = sqlx::query(&sql)
        .bind(id.to_string())
        .fetch_all(&mut *conn)
        .await?;
    rows.iter().map(transition_from_row).collect()
}

/// The columns of `session_transitions` that [`transition_from_row`] reads.
const TRANSITION_COLUMNS: &str = "from_state, to_state, at, reason, hold_reason, repeats";

/// A transition from [`TRANSITION_COLUMNS`].
fn transition_from_row(row: &DbRow) -> StoreResult<Transition> {
    let from: Option<String> = row.try_get("from_state")?;
    Ok(Transition {
        from: from.map(|f| parse(&f, "session state")).transpose()?,
        to: parse(&row.try_get::<String, _>("to_state")?, "session state")?,
        at: parse_timestamp(&row.try_get::<String, _>("at")?)?,
        reason: match row.try_get::<i64, _>("repeats")? {
            0 => reason_from_row(row)?,
            repeats => format!(
                "{} ({} times, the latest shown)",
                reason_from_row(row)?,
                repeats.saturating_add(1)
            ),
        },
    })
}

/// Folds `transition` (a CONNECTED ⇄ IDLE flip, see [`connections::folds`]) into the history
/// whose rows are numbered below `seq`: the last row (its reverse) goes, and the row before it
/// (the same flip) takes the new time and reason and counts one more repeat.
async fn fold_transition(
    tx: &mut Transaction<'static, Db>,
    id: SessionId,
    seq: usize,
    transition: &Transition,
    reason: &str,
) -> StoreResult<()> {
    let seq = i64::try_from(seq).map_err(|_| StoreError::Corrupt("history too long".to_owned()))?;
    let id_text = id.to_string();
    sqlx::query("DELETE FROM session_transitions WHERE session_id = $1 AND seq = $2")
        .bind(&id_text)
        .bind(seq - 1)
        .execute(&mut **tx)
        .await?;
    sqlx::query(
        "UPDATE session_transitions SET at = $1, reason = $2, repeats = repeats + 1 \
         WHERE session_id = $3 AND seq = $4",
    )
    .bind(timestamp(transition.at))
    .bind(reason)
    .bind(&id_text)
    .bind(seq - 2)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// Stores the GPUs `node` reports: a row is written only where the report differs from it (new
/// GPUs get their mode from `start_modes`, else exclusive; known ones keep the admin's). GPUs of
/// the node no longer reported are kept, marked failed. Whether anything but a GPU's
/// utilisation changed (the inventory version then moves on: [`inventory`]).
async fn update_gpus(
    tx: &mut Transaction<'static, Db>,
    node: &NodeName,
    gpus: &[GpuInfo],
    start_modes: &BTreeMap<GpuUuid, GpuMode>,
    at: DateTime<Utc>,
) -> StoreResult<bool> {
    let known = sqlx::query("SELECT node, info, mode, drain FROM gpus WHERE node = $1")
        .bind(node.as_str())
        .fetch_all(&mut **tx)
        .await?
        .iter()
        .map(|row| gpu_from_row(row).map(|gpu| (gpu.info.uuid.clone(), gpu.info)))
        .collect::<StoreResult<BTreeMap<GpuUuid, GpuInfo>>>()?;
    let mut changed = false;
    for gpu in gpus {
        let stored = known.get(&gpu.uuid);
        if stored == Some(gpu) {
            continue;
        }
        changed |= stored.is_none_or(|stored| !stored.same_inventory(gpu));
        let mode = start_modes
            .get(&gpu.uuid)
            .copied()
            .unwrap_or(GpuMode::Exclusive);
        sqlx::query(
            "INSERT INTO gpus (uuid, node, info, mode, updated_at) VALUES ($1, $2, $3, $4, $5) \
             ON CONFLICT (uuid) DO UPDATE SET node = excluded.node, info = excluded.info, \
             updated_at = excluded.updated_at",
        )
        .bind(gpu.uuid.as_str())
        .bind(node.as_str())
        .bind(to_json(gpu)?)
        .bind(mode.to_string())
        .bind(timestamp(at))
        .execute(&mut **tx)
        .await?;
    }
    let reported: BTreeSet<&GpuUuid> = gpus.iter().map(|g| &g.uuid).collect();
    for (uuid, mut info) in known {
        if reported.contains(&uuid) || !info.health.is_healthy() {
            continue;
        }
        info.health = GpuHealth::Failed(format!("no longer reported by node {node}'s agent"));
        sqlx::query("UPDATE gpus SET info = $1, updated_at = $2 WHERE uuid = $3")
            .bind(to_json(&info)?)
            .bind(timestamp(at))
            .bind(uuid.as_str())
            .execute(&mut **tx)
            .await?;
        changed = true;
    }
    if changed {
        inventory::bump(tx).await?;
    }
    Ok(changed)
}

/// States as an SQL list of quoted names, for `IN (...)`: the names are our own constants,
/// never user input.
fn states_listed(states: impl Iterator<Item = impl fmt::Display>) -> String {
    states
        .map(|state| format!("'{state}'"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// `$1, $2, ...`: `count` numbered parameters.
fn placeholders(count: usize) -> String {
    (1..=count)
        .map(|n| format!("${n}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// `sql` with `values` bound to its parameters in order (none for `None`).
fn query_with<'q>(
    sql: &'q str,
    values: impl IntoIterator<Item = &'q str>,
) -> sqlx::query::Query<'q, Db, <Db as sqlx::Database>::Arguments<'q>> {
    values
        .into_iter()
        .fold(sqlx::query(sql), |query, value| query.bind(value))
}

fn session_from_row(row: &DbRow) -> StoreResult<SessionRecord> {
    let text = |column: &str| row.try_get::<String, _>(column);
    let optional = |column: &str| row.try_get::<Option<String>, _>(column);
    Ok(SessionRecord {
        id: parse(&text("id")?, "session id")?,
        name: parse(&text("name")?, "session name")?,
        owner: parse(&text("owner")?, "owner DN")?,
        user_name: parse(&text("user_name")?, "user name")?,
        uid: u32::try_from(row.try_get::<i64, _>("uid")?)
            .map_err(|_| StoreError::Corrupt("UID out of range".to_owned()))?,
        state: parse(&text("state")?, "session state")?,
        reason: reason_from_row(row)?,
        request: from_json(&text("request")?, "GPU request")?,
        image: text("image")?,
        node: optional("node")?
            .map(|n| parse(&n, "node name"))
            .transpose()?,
        gpus: from_json(&text("gpus")?, "GPU list")?,
        created_at: parse_timestamp(&text("created_at")?)?,
        queued_at: parse_timestamp(&text("queued_at")?)?,
        preferred_node: optional("preferred_node")?
            .map(|n| parse(&n, "node name"))
            .transpose()?,
    })
}

/// A `nodes` row, without its GPUs.
fn node_from_row(row: &DbRow) -> StoreResult<NodeRecord> {
    Ok(NodeRecord {
        gpus: Default::default(),
        name: parse(&row.try_get::<String, _>("name")?, "node name")?,
        gpu_backend: row.try_get("gpu_backend")?,
        agent_version: row.try_get("agent_version")?,
        stream_url: row.try_get("stream_url")?,
        last_seen: parse_timestamp(&row.try_get::<String, _>("last_seen")?)?,
        drain: nodes::drain_from_row(row)?,
    })
}

fn gpu_from_row(row: &DbRow) -> StoreResult<GpuRecord> {
    Ok(GpuRecord {
        node: parse(&row.try_get::<String, _>("node")?, "node name")?,
        info: from_json(&row.try_get::<String, _>("info")?, "GPU info")?,
        mode: parse(&row.try_get::<String, _>("mode")?, "GPU mode")?,
        drain: nodes::drain_from_row(row)?,
    })
}

/// The reason of a stored session or transition as people read it: `reason`, with the typed
/// `hold_reason` of a hold rendered in front of it.
fn reason_from_row(row: &DbRow) -> StoreResult<String> {
    let reason: String = row.try_get("reason")?;
    let hold = row
        .try_get::<Option<String>, _>("hold_reason")?
        .map(|text| {
            HoldReason::parse(&text)
                .ok_or_else(|| StoreError::Corrupt(format!("hold reason {text:?}")))
        })
        .transpose()?;
    Ok(rendered_reason(&reason, hold))
}

/// Stored integers (BIGINT, SQLite's INTEGER) are signed: a count beyond 2^63 (never reached) is
/// kept at the maximum.
fn clamp(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

fn timestamp(at: DateTime<Utc>) -> String {
    at.to_rfc3339_opts(SecondsFormat::Nanos, true)
}

fn parse_timestamp(text: &str) -> StoreResult<DateTime<Utc>> {
    DateTime::parse_from_rfc3339(text)
        .map(|t| t.with_timezone(&Utc))
        .map_err(|e| StoreError::Corrupt(format!("timestamp {text:?}: {e}")))
}

fn parse<T>(text: &str, what: &str) -> StoreResult<T>
where
    T: FromStr,
    T::Err: fmt::Display,
{
    text.parse()
        .map_err(|e| StoreError::Corrupt(format!("{what} {text:?}: {e}")))
}

fn to_json<T: serde::Serialize>(value: &T) -> StoreResult<String> {
    serde_json::to_string(value).map_err(|e| StoreError::Corrupt(format!("encoding JSON: {e}")))
}

fn from_json<T: serde::de::DeserializeOwned>(text: &str, what: &str) -> StoreResult<T> {
    serde_json::from_str(text).map_err(|e| StoreError::Corrupt(format!("{what} {text:?}: {e}")))
}

mod activity;
pub(super) mod creates;
mod dashboard;
mod gateway;
mod gpu_policy;
mod grid_jobs;
mod heartbeats;
mod history;
mod identity;
mod images;
pub(super) mod inventory;
mod job_history;
mod job_logs;
pub(super) mod jobs;
mod nodes;
pub(super) mod planning;
pub(super) mod samples;
pub(super) mod sync_records;
pub(super) mod together;
mod token_links;
mod usage;
mod users;
