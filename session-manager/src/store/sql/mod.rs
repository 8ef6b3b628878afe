//! The one SQL implementation of the [`Store`] for both databases, compiled once per backend.
//!
//! [`crate::store::sqlite`] and `crate::store::postgres` each include this folder as their module `sql`
//! (`#[path = "sql/mod.rs"]`), after naming what it is compiled against: `Db` (the sqlx
//! database), `DbRow`, `DbConnection`, `SqlStore` (the backend's store type, whose `write`
//! begins a write transaction and whose `read_snapshot` begins a read of one snapshot), and the
//! few SQL words the two spell differently (`GREATEST`). Every statement here is written once,
//! in the SQL both databases take: `$1`-style parameters (SQLite numbers `$N` as PostgreSQL
//! does), `TRUE`/`FALSE`, `ON CONFLICT ... DO UPDATE`, `RETURNING`, `CAST(1 AS BIGINT)`.
//!
//! Why inclusion rather than one generic type: sqlx's generic `Database` API would need every
//! function to carry bounds for each type it binds and decodes (`for<'q> i64: Encode<'q, DB> +
//! Type<DB>`, one per type, and the executor bounds), and sqlx's `Any` driver converts every
//! value at run time and decodes SQLite's integer booleans as integers. Compiled once per
//! backend, this code keeps each driver's own types and checks, and is still written once.
//!
//! Session states change only through [`apply_change`], which replays the stored history into an
//! [`ongrid_core::Lifecycle`]; times are stored as fixed-width RFC 3339 text with nanoseconds, so
//! they round-trip exactly and sort as text (in `TEXT COLLATE "C"` columns on PostgreSQL).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use chrono::{DateTime, SecondsFormat, Utc};
use futures::future::BoxFuture;
use ongrid_core::job::JobState;
use ongrid_core::{
    Dn, GpuHealth, GpuId, GpuInfo, GpuMode, GpuUuid, Lifecycle, NodeName, SessionId, SessionName,
    SessionState, Transition, UserName,
};
use sqlx::{Row, Transaction};

use ongrid_core::api::{AuditRecord, ConnectionEvent, UserEvent};
use ongrid_core::{Institute, InstituteName};

use super::{Db, DbConnection, DbRow, SqlStore, GREATEST};
use crate::domain::grid_jobs::EngineJobId;
use crate::domain::images::{ImageChange, ImageRecord};
use crate::domain::jobs::{JobChange, JobRecord, NewJob};
use crate::domain::sessions::holds::{ActivityThresholds, LifecycleConfig, LifecycleFacts};
use crate::domain::sessions::{connections, rendered_reason, Change, Placement, SessionRecord};
use crate::domain::users::{Removal, Removed};
use crate::store::{
    AuditFilter, ConnectionRecorded, FactsScope, GpuRecord, Heartbeat, ImageDeleted, ImageFilter,
    JobFilter, KeyAdded, KeyRecord, NewImage, NewKey, NewSession, NodeRecord, NodeRegistration,
    SessionFilter, StateCounts, Store, StoreError, StoreResult, UserRecord,
};
use ongrid_core::gpu::Drain;
use ongrid_core::holds::{ContainerActivity, HoldReason};
use ongrid_core::job::JobId;
use ongrid_core::store_identity::StoreIdentity;

use crate::store::NodeRemoval;

const SESSION_COLUMNS: &str = "s.id, s.name, s.owner, u.user_name, u.uid, s.state, s.reason, \
     s.hold_reason, \
     s.request, s.image, s.node, s.gpus, s.created_at, s.queued_at, s.preferred_node \
     FROM sessions s JOIN users u ON u.dn = s.owner";

impl SqlStore {
    async fn user_impl(&self, dn: &Dn, first_uid: u32) -> StoreResult<UserRecord> {
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

    async fn create_session_impl(&self, new: NewSession) -> StoreResult<SessionRecord> {
        let mut tx = self.write().await?;
        refuse_removed(&mut tx, &new.owner).await?;
        let live: Vec<(String, String)> = sqlx::query_as(
            "SELECT name, state FROM sessions WHERE owner = $1 AND state <> 'ENDED'",
        )
        .bind(new.owner.as_str())
        .fetch_all(&mut *tx)
        .await?;
        let name = match new.name {
            Some(name) => {
                if let Some((_, state)) = live.iter().find(|(n, _)| n == name.as_str()) {
                    return Err(StoreError::NameTaken {
                        name,
                        state: parse(state, "session state")?,
                    });
                }
                name
            }
            None => first_free_name(live.iter().map(|(n, _)| n.as_str()))?,
        };
        let lifecycle = Lifecycle::new(new.at, new.reason);
        let first = lifecycle.last();
        sqlx::query(
            "INSERT INTO sessions (id, name, owner, request, image, state, reason, gpus, \
             created_at, queued_at) VALUES ($1, $2, $3, $4, $5, $6, $7, '[]', $8, $9)",
        )
        .bind(new.id.to_string())
        .bind(name.as_str())
        .bind(new.owner.as_str())
        .bind(to_json(&new.request)?)
        .bind(&new.image)
        .bind(lifecycle.state().as_str())
        .bind(&first.reason)
        .bind(timestamp(new.at))
        .bind(timestamp(new.at))
        .execute(&mut *tx)
        .await?;
        planning::stamp(&mut tx, &new.id.to_string()).await?;
        insert_transition(&mut tx, new.id, 0, first, (&first.reason, None)).await?;
        if new.idle_timeout_secs.is_some() || new.max_duration_secs.is_some() {
            activity::insert_limits(
                &mut tx,
                new.id,
                new.idle_timeout_secs,
                new.max_duration_secs,
            )
            .await?;
        }
        tx.commit().await?;
        self.session_impl(new.id)
            .await?
            .ok_or(StoreError::NoSuchSession(new.id))
    }

    async fn session_impl(&self, id: SessionId) -> StoreResult<Option<SessionRecord>> {
        find_session(&self.pool, id).await
    }

    async fn session_by_name_impl(
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

    /// How many sessions (not ended) and jobs are in each state: counted by the database.
    async fn state_counts_impl(&self) -> StoreResult<StateCounts> {
        let count = |sql: &'static str| async move {
            let rows = sqlx::query(sql).fetch_all(&self.pool).await?;
            rows.iter()
                .map(|row| Ok((row.try_get::<String, _>(0)?, row.try_get::<i64, _>(1)?)))
                .collect::<StoreResult<Vec<(String, i64)>>>()
        };
        Ok(StateCounts {
            sessions: count(
                "SELECT state, COUNT(*) FROM sessions WHERE state <> 'ENDED' GROUP BY state",
            )
            .await?,
            jobs: count("SELECT state, COUNT(*) FROM jobs GROUP BY state").await?,
            gpus_in_use: self.gpus_in_use().await?,
        })
    }

    /// The GPUs held by sessions and jobs in a state that holds GPUs: their `gpus` columns
    /// only.
    async fn gpus_in_use(&self) -> StoreResult<BTreeSet<GpuId>> {
        let sessions = states_listed(SessionState::ALL.iter().filter(|s| s.holds_gpus()));
        let jobs = states_listed(JobState::ALL.iter().filter(|s| s.holds_gpus()));
        let sql = format!(
            "SELECT gpus FROM sessions WHERE state IN ({sessions}) \
             UNION ALL SELECT gpus FROM jobs WHERE state IN ({jobs})"
        );
        let lists: Vec<String> = sqlx::query_scalar(&sql).fetch_all(&self.pool).await?;
        let mut used = BTreeSet::new();
        for list in &lists {
            used.extend(from_json::<Vec<GpuId>>(list, "GPU list")?);
        }
        Ok(used)
    }

    async fn sessions_impl(&self, filter: SessionFilter) -> StoreResult<Vec<SessionRecord>> {
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
        let mut query = sqlx::query(&sql);
        if let Some(value) = value {
            query = query.bind(value);
        }
        let rows = query.fetch_all(&self.pool).await?;
        rows.iter().map(session_from_row).collect()
    }

    async fn pending_order_impl(&self) -> StoreResult<Vec<SessionId>> {
        let ids: Vec<String> = sqlx::query_scalar(
            "SELECT id FROM sessions WHERE state = 'PENDING' ORDER BY queued_at, id",
        )
        .fetch_all(&self.pool)
        .await?;
        ids.iter().map(|id| parse(id, "session id")).collect()
    }

    async fn transitions_impl(&self, id: SessionId) -> StoreResult<Vec<Transition>> {
        let mut conn = self.pool.acquire().await?;
        load_transitions(&mut conn, id).await
    }

    async fn transition_impl(&self, id: SessionId, change: Change) -> StoreResult<SessionRecord> {
        let mut tx = self.write().await?;
        apply_change(&mut tx, id, change).await?;
        tx.commit().await?;
        self.session_impl(id)
            .await?
            .ok_or(StoreError::NoSuchSession(id))
    }

    async fn transition_all_impl(
        &self,
        changes: Vec<(SessionId, Change)>,
    ) -> StoreResult<Vec<StoreResult<()>>> {
        let mut tx = self.write().await?;
        let mut outcomes = Vec::with_capacity(changes.len());
        for (id, change) in changes {
            // A refusal is decided before anything of the change is written.
            match apply_change(&mut tx, id, change).await {
                Ok(_) => outcomes.push(Ok(())),
                Err(
                    refused @ (StoreError::InvalidTransition(_) | StoreError::NoSuchSession(_)),
                ) => outcomes.push(Err(refused)),
                Err(other) => return Err(other),
            }
        }
        tx.commit().await?;
        Ok(outcomes)
    }

    async fn register_node_impl(
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
        update_gpus(&mut tx, &node.name, gpus, &node.start_modes, at).await?;
        tx.commit().await?;
        Ok(())
    }

    async fn record_sync_impl(
        &self,
        node: &NodeName,
        gpus: &[GpuInfo],
        at: DateTime<Utc>,
    ) -> StoreResult<Option<Heartbeat>> {
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

    /// Every registered node with its GPUs, ordered by name; only `only` when given.
    async fn nodes_impl(&self, only: Option<&NodeName>) -> StoreResult<Vec<NodeRecord>> {
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
        const COLUMNS: &str = "SELECT name, gpu_backend, agent_version, stream_url, last_seen, \
             drain FROM nodes WHERE removed_at IS NULL";
        Ok(match only {
            None => {
                sqlx::query(&format!("{COLUMNS} ORDER BY name"))
                    .fetch_all(&self.pool)
                    .await?
            }
            Some(name) => {
                sqlx::query(&format!("{COLUMNS} AND name = $1"))
                    .bind(name.as_str())
                    .fetch_all(&self.pool)
                    .await?
            }
        })
    }

    /// The GPUs of every node (of `only` when given), each node's ordered by PCI bus id.
    async fn gpus_by_node(&self, only: Option<&NodeName>) -> StoreResult<inventory::GpusByNode> {
        let rows = match only {
            None => {
                sqlx::query("SELECT node, info, mode, drain FROM gpus")
                    .fetch_all(&self.pool)
                    .await?
            }
            Some(name) => {
                sqlx::query("SELECT node, info, mode, drain FROM gpus WHERE node = $1")
                    .bind(name.as_str())
                    .fetch_all(&self.pool)
                    .await?
            }
        };
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

    async fn set_gpu_mode_impl(
        &self,
        uuid: &GpuUuid,
        mode: GpuMode,
    ) -> StoreResult<Option<GpuRecord>> {
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

impl Store for SqlStore {
    fn dashboard(&self) -> &dyn crate::store::DashboardStore {
        self
    }

    fn identity(&self) -> BoxFuture<'_, StoreResult<StoreIdentity>> {
        Box::pin(self.identity_impl())
    }

    fn mark_restored(&self, at_least: Option<u64>) -> BoxFuture<'_, StoreResult<StoreIdentity>> {
        Box::pin(self.mark_restored_impl(at_least))
    }

    fn token_link<'a>(
        &'a self,
        issuer: &'a str,
        subject: &'a str,
    ) -> BoxFuture<'a, StoreResult<Option<Dn>>> {
        Box::pin(self.token_link_impl(issuer, subject))
    }

    fn link_token<'a>(
        &'a self,
        link: &'a crate::store::TokenLink,
    ) -> BoxFuture<'a, StoreResult<bool>> {
        Box::pin(self.link_token_impl(link))
    }

    fn unlink_token<'a>(
        &'a self,
        issuer: &'a str,
        subject: &'a str,
    ) -> BoxFuture<'a, StoreResult<Option<crate::store::TokenLink>>> {
        Box::pin(self.unlink_token_impl(issuer, subject))
    }

    fn token_links(&self) -> BoxFuture<'_, StoreResult<Vec<crate::store::TokenLink>>> {
        Box::pin(self.token_links_impl())
    }

    fn gpu_policy(&self) -> &dyn crate::store::gpu_policy::GpuPolicyStore {
        self
    }

    fn user<'a>(&'a self, dn: &'a Dn, first_uid: u32) -> BoxFuture<'a, StoreResult<UserRecord>> {
        Box::pin(self.user_impl(dn, first_uid))
    }

    fn create_session(&self, new: NewSession) -> BoxFuture<'_, StoreResult<SessionRecord>> {
        Box::pin(self.create_session_impl(new))
    }

    fn session(&self, id: SessionId) -> BoxFuture<'_, StoreResult<Option<SessionRecord>>> {
        Box::pin(self.session_impl(id))
    }

    fn session_by_name<'a>(
        &'a self,
        owner: &'a Dn,
        name: &'a SessionName,
    ) -> BoxFuture<'a, StoreResult<Option<SessionRecord>>> {
        Box::pin(self.session_by_name_impl(owner, name))
    }

    fn sessions(&self, filter: SessionFilter) -> BoxFuture<'_, StoreResult<Vec<SessionRecord>>> {
        Box::pin(self.sessions_impl(filter))
    }

    fn state_counts(&self) -> BoxFuture<'_, StoreResult<StateCounts>> {
        Box::pin(self.state_counts_impl())
    }

    fn pending_order(&self) -> BoxFuture<'_, StoreResult<Vec<SessionId>>> {
        Box::pin(self.pending_order_impl())
    }

    fn transitions(&self, id: SessionId) -> BoxFuture<'_, StoreResult<Vec<Transition>>> {
        Box::pin(self.transitions_impl(id))
    }

    fn transition(
        &self,
        id: SessionId,
        change: Change,
    ) -> BoxFuture<'_, StoreResult<SessionRecord>> {
        Box::pin(self.transition_impl(id, change))
    }

    fn transition_all(
        &self,
        changes: Vec<(SessionId, Change)>,
    ) -> BoxFuture<'_, StoreResult<Vec<StoreResult<()>>>> {
        Box::pin(self.transition_all_impl(changes))
    }

    fn register_node<'a>(
        &'a self,
        node: NodeRegistration,
        gpus: &'a [GpuInfo],
        at: DateTime<Utc>,
    ) -> BoxFuture<'a, StoreResult<()>> {
        Box::pin(self.register_node_impl(node, gpus, at))
    }

    fn record_sync<'a>(
        &'a self,
        node: &'a NodeName,
        gpus: &'a [GpuInfo],
        at: DateTime<Utc>,
    ) -> BoxFuture<'a, StoreResult<Option<Heartbeat>>> {
        Box::pin(self.record_sync_impl(node, gpus, at))
    }

    fn node_registered<'a>(&'a self, node: &'a NodeName) -> BoxFuture<'a, StoreResult<bool>> {
        Box::pin(async move {
            let found = sqlx::query(
                "SELECT CAST(1 AS BIGINT) FROM nodes WHERE name = $1 AND removed_at IS NULL",
            )
            .bind(node.as_str())
            .fetch_optional(&self.pool)
            .await?;
            Ok(found.is_some())
        })
    }

    fn nodes(&self) -> BoxFuture<'_, StoreResult<Vec<NodeRecord>>> {
        Box::pin(self.nodes_impl(None))
    }

    fn planning_nodes(&self) -> BoxFuture<'_, StoreResult<Vec<NodeRecord>>> {
        Box::pin(self.planning_nodes_impl())
    }

    fn planning_sessions(&self) -> BoxFuture<'_, StoreResult<Vec<SessionRecord>>> {
        Box::pin(self.planning_sessions_impl())
    }

    fn node<'a>(&'a self, name: &'a NodeName) -> BoxFuture<'a, StoreResult<Option<NodeRecord>>> {
        Box::pin(async move { Ok(self.nodes_impl(Some(name)).await?.pop()) })
    }

    fn set_gpu_mode<'a>(
        &'a self,
        uuid: &'a GpuUuid,
        mode: GpuMode,
    ) -> BoxFuture<'a, StoreResult<Option<GpuRecord>>> {
        Box::pin(self.set_gpu_mode_impl(uuid, mode))
    }

    fn set_node_drain<'a>(
        &'a self,
        node: &'a NodeName,
        drain: Option<Drain>,
    ) -> BoxFuture<'a, StoreResult<bool>> {
        Box::pin(self.set_node_drain_impl(node, drain))
    }

    fn set_gpu_drain<'a>(
        &'a self,
        uuid: &'a GpuUuid,
        drain: Option<Drain>,
    ) -> BoxFuture<'a, StoreResult<Option<GpuRecord>>> {
        Box::pin(self.set_gpu_drain_impl(uuid, drain))
    }

    fn remove_node<'a>(
        &'a self,
        node: &'a NodeName,
        at: DateTime<Utc>,
        node_timeout: Duration,
    ) -> BoxFuture<'a, StoreResult<NodeRemoval>> {
        Box::pin(self.remove_node_impl(node, at, node_timeout))
    }

    fn add_key(&self, key: NewKey, max_per_owner: usize) -> BoxFuture<'_, StoreResult<KeyAdded>> {
        Box::pin(self.add_key_impl(key, max_per_owner))
    }

    fn key<'a>(&'a self, fingerprint: &'a str) -> BoxFuture<'a, StoreResult<Option<KeyRecord>>> {
        Box::pin(self.key_impl(fingerprint))
    }

    fn keys<'a>(&'a self, owner: Option<&'a Dn>) -> BoxFuture<'a, StoreResult<Vec<KeyRecord>>> {
        Box::pin(self.keys_impl(owner))
    }

    fn remove_key<'a>(
        &'a self,
        fingerprint: &'a str,
        owner: Option<&'a Dn>,
    ) -> BoxFuture<'a, StoreResult<Option<KeyRecord>>> {
        Box::pin(self.remove_key_impl(fingerprint, owner))
    }

    fn add_institute<'a>(
        &'a self,
        institute: &'a Institute,
        at: DateTime<Utc>,
    ) -> BoxFuture<'a, StoreResult<()>> {
        Box::pin(self.add_institute_impl(institute, at))
    }

    fn institute<'a>(
        &'a self,
        name: &'a InstituteName,
    ) -> BoxFuture<'a, StoreResult<Option<Institute>>> {
        Box::pin(self.institute_impl(name))
    }

    fn institutes(&self) -> BoxFuture<'_, StoreResult<Vec<Institute>>> {
        Box::pin(self.institutes_impl())
    }

    fn remove_institute<'a>(
        &'a self,
        name: &'a InstituteName,
    ) -> BoxFuture<'a, StoreResult<Option<Institute>>> {
        Box::pin(self.remove_institute_impl(name))
    }

    fn record_connection<'a>(
        &'a self,
        event: &'a ConnectionEvent,
        at: DateTime<Utc>,
    ) -> BoxFuture<'a, StoreResult<ConnectionRecorded>> {
        Box::pin(self.record_connection_impl(event, at))
    }

    fn audit(&self, filter: AuditFilter) -> BoxFuture<'_, StoreResult<Vec<AuditRecord>>> {
        Box::pin(self.audit_impl(filter))
    }

    fn prune_connections(
        &self,
        closed_before: DateTime<Utc>,
        limit: u32,
    ) -> BoxFuture<'_, StoreResult<u64>> {
        Box::pin(self.prune_connections_impl(closed_before, limit))
    }

    fn create_job(&self, new: NewJob) -> BoxFuture<'_, StoreResult<JobRecord>> {
        Box::pin(self.create_job_impl(new))
    }

    fn job(&self, id: JobId) -> BoxFuture<'_, StoreResult<Option<JobRecord>>> {
        Box::pin(self.job_impl(id))
    }

    fn jobs(&self, filter: JobFilter) -> BoxFuture<'_, StoreResult<Vec<JobRecord>>> {
        Box::pin(self.jobs_impl(filter))
    }

    fn job_transition(
        &self,
        id: JobId,
        change: JobChange,
        next: Option<NewJob>,
    ) -> BoxFuture<'_, StoreResult<JobRecord>> {
        Box::pin(self.job_transition_impl(id, change, next))
    }

    fn record_job_log(
        &self,
        id: JobId,
        size: u64,
        complete: bool,
    ) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(self.record_job_log_impl(id, size, complete))
    }

    fn remove_job(
        &self,
        id: JobId,
        output_grace: Duration,
        now: DateTime<Utc>,
    ) -> BoxFuture<'_, StoreResult<crate::store::JobRemoval>> {
        Box::pin(self.remove_job_impl(id, output_grace, now))
    }

    fn prune_jobs(
        &self,
        ended_before: DateTime<Utc>,
        limit: u32,
    ) -> BoxFuture<'_, StoreResult<Vec<JobId>>> {
        Box::pin(self.prune_jobs_impl(ended_before, limit))
    }

    fn set_engine_id<'a>(
        &'a self,
        id: JobId,
        engine_id: &'a EngineJobId,
    ) -> BoxFuture<'a, StoreResult<()>> {
        Box::pin(self.set_engine_id_impl(id, engine_id))
    }

    fn mark_submit_started(
        &self,
        id: JobId,
        at: Option<DateTime<Utc>>,
    ) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(self.mark_submit_started_impl(id, at))
    }

    fn record_engine_poll<'a>(
        &'a self,
        id: JobId,
        poll: crate::domain::engine_job::EnginePoll<'a>,
    ) -> BoxFuture<'a, StoreResult<()>> {
        Box::pin(self.record_engine_poll_impl(id, poll))
    }

    fn grid_jobs_to_mirror(&self) -> BoxFuture<'_, StoreResult<Vec<JobRecord>>> {
        Box::pin(self.grid_jobs_to_mirror_impl())
    }

    fn create_image(&self, new: NewImage) -> BoxFuture<'_, StoreResult<ImageRecord>> {
        Box::pin(self.create_image_impl(new))
    }

    fn image(&self, id: uuid::Uuid) -> BoxFuture<'_, StoreResult<Option<ImageRecord>>> {
        Box::pin(self.image_impl(id))
    }

    fn images(&self, filter: ImageFilter) -> BoxFuture<'_, StoreResult<Vec<ImageRecord>>> {
        Box::pin(self.images_impl(filter))
    }

    fn record_freeze<'a>(
        &'a self,
        node: &'a NodeName,
        id: uuid::Uuid,
        change: &'a ImageChange,
        at: DateTime<Utc>,
    ) -> BoxFuture<'a, StoreResult<Option<ImageRecord>>> {
        Box::pin(self.record_freeze_impl(node, id, change, at))
    }

    fn set_image_shared(
        &self,
        id: uuid::Uuid,
        shared_at: Option<DateTime<Utc>>,
    ) -> BoxFuture<'_, StoreResult<Option<ImageRecord>>> {
        Box::pin(self.set_image_shared_impl(id, shared_at))
    }

    fn delete_image(
        &self,
        id: uuid::Uuid,
        at: DateTime<Utc>,
    ) -> BoxFuture<'_, StoreResult<Option<ImageDeleted>>> {
        Box::pin(self.delete_image_impl(id, at))
    }

    fn lifecycle_facts(
        &self,
        scope: FactsScope,
    ) -> BoxFuture<'_, StoreResult<Vec<LifecycleFacts>>> {
        Box::pin(self.lifecycle_facts_impl(scope))
    }

    fn set_keep_until(
        &self,
        id: SessionId,
        until: DateTime<Utc>,
    ) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(self.set_keep_until_impl(id, until))
    }

    fn record_activity<'a>(
        &'a self,
        node: &'a NodeName,
        samples: &'a [ContainerActivity],
        at: DateTime<Utc>,
        thresholds: ActivityThresholds,
    ) -> BoxFuture<'a, StoreResult<usize>> {
        Box::pin(self.record_activity_impl(node, samples, at, thresholds))
    }

    fn hold_if_due<'a>(
        &'a self,
        id: SessionId,
        config: &'a LifecycleConfig,
        now: DateTime<Utc>,
    ) -> BoxFuture<'a, StoreResult<Option<(SessionRecord, HoldReason)>>> {
        Box::pin(self.hold_if_due_impl(id, config, now))
    }

    fn existing_user<'a>(&'a self, dn: &'a Dn) -> BoxFuture<'a, StoreResult<Option<UserRecord>>> {
        Box::pin(self.existing_user_impl(dn))
    }

    fn users(&self) -> BoxFuture<'_, StoreResult<Vec<UserRecord>>> {
        Box::pin(self.users_impl())
    }

    fn set_accounting_group<'a>(
        &'a self,
        dn: &'a Dn,
        group: &'a crate::domain::policy::GroupName,
        now: DateTime<Utc>,
    ) -> BoxFuture<'a, StoreResult<()>> {
        Box::pin(self.set_accounting_group_impl(dn, group, now))
    }

    fn usage_accounts(
        &self,
    ) -> BoxFuture<'_, StoreResult<Vec<crate::domain::policy::fairshare::Account>>> {
        Box::pin(self.usage_accounts_impl())
    }

    fn save_usage<'a>(
        &'a self,
        accounts: &'a [crate::domain::policy::fairshare::Account],
    ) -> BoxFuture<'a, StoreResult<()>> {
        Box::pin(self.save_usage_impl(accounts))
    }

    fn user_events<'a>(
        &'a self,
        dn: Option<&'a Dn>,
    ) -> BoxFuture<'a, StoreResult<Vec<(Dn, UserEvent)>>> {
        Box::pin(self.user_events_impl(dn))
    }

    fn remove_user<'a>(
        &'a self,
        dn: &'a Dn,
        by: &'a Dn,
        at: DateTime<Utc>,
        removal: &'a Removal,
    ) -> BoxFuture<'a, StoreResult<Option<Vec<KeyRecord>>>> {
        Box::pin(self.remove_user_impl(dn, by, at, removal))
    }

    fn restore_user<'a>(
        &'a self,
        dn: &'a Dn,
        by: &'a Dn,
        at: DateTime<Utc>,
    ) -> BoxFuture<'a, StoreResult<Option<UserRecord>>> {
        Box::pin(self.restore_user_impl(dn, by, at))
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

/// `dev`, then `dev-2`, `dev-3`, ...: the first not among `taken`.
fn first_free_name<'a>(taken: impl Iterator<Item = &'a str>) -> StoreResult<SessionName> {
    let taken: BTreeSet<&str> = taken.collect();
    let candidate = |n: usize| {
        if n == 1 {
            "dev".to_owned()
        } else {
            format!("dev-{n}")
        }
    };
    let n = (1..=taken.len() + 1)
        .find(|&n| !taken.contains(candidate(n).as_str()))
        .unwrap_or(taken.len() + 1);
    SessionName::parse(&candidate(n)).map_err(|e| StoreError::Corrupt(e.to_string()))
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
    let history = load_transitions(tx, id).await?;
    if history.is_empty() {
        return Err(StoreError::NoSuchSession(id));
    }
    let mut lifecycle = Lifecycle::from_history(history)
        .map_err(|e| StoreError::Corrupt(format!("history of session {id}: {e}")))?;
    let seq = lifecycle.history().len();
    let folded = connections::folds(lifecycle.history(), change.to);
    let sentence = change.sentence();
    let transition = lifecycle.transition(change.to, change.at, sentence)?;
    if folded {
        fold_transition(tx, id, seq, transition, &change.reason).await?;
    } else {
        insert_transition(tx, id, seq, transition, (&change.reason, change.hold)).await?;
    }
    activity::after_transition(tx, id, transition).await?;
    let id_text = id.to_string();
    let hold = change.hold.map(HoldReason::as_str);
    match change.placement {
        Placement::Keep => {
            sqlx::query(
                "UPDATE sessions SET state = $1, reason = $2, hold_reason = $3 WHERE id = $4",
            )
            .bind(transition.to.as_str())
            .bind(&change.reason)
            .bind(hold)
            .bind(&id_text)
            .execute(&mut **tx)
            .await?;
        }
        Placement::Place { node, gpus } => {
            sqlx::query(
                "UPDATE sessions SET state = $1, reason = $2, hold_reason = $3, node = $4, gpus = $5 \
                 WHERE id = $6",
            )
            .bind(transition.to.as_str())
            .bind(&change.reason)
            .bind(hold)
            .bind(node.as_str())
            .bind(to_json(&gpus)?)
            .bind(&id_text)
            .execute(&mut **tx)
            .await?;
        }
        Placement::Clear => {
            sqlx::query(
                "UPDATE sessions SET state = $1, reason = $2, hold_reason = $3, node = NULL, \
                 gpus = '[]' WHERE id = $4",
            )
            .bind(transition.to.as_str())
            .bind(&change.reason)
            .bind(hold)
            .bind(&id_text)
            .execute(&mut **tx)
            .await?;
        }
    }
    planning::stamp(tx, &id_text).await?;
    Ok(transition.clone())
}

async fn load_transitions(conn: &mut DbConnection, id: SessionId) -> StoreResult<Vec<Transition>> {
    let rows = sqlx::query(
        "SELECT from_state, to_state, at, reason, hold_reason, repeats FROM session_transitions \
         WHERE session_id = $1 ORDER BY seq",
    )
    .bind(id.to_string())
    .fetch_all(&mut *conn)
    .await?;
    rows.iter()
        .map(|row| {
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
        })
        .collect()
}

/// Stores `transition` as number `seq` of the session's history, with its reason as stored:
/// the words and, for a hold, its typed reason (the transition's reason is rendered from both).
async fn insert_transition(
    tx: &mut Transaction<'static, Db>,
    id: SessionId,
    seq: usize,
    transition: &Transition,
    (reason, hold): (&str, Option<HoldReason>),
) -> StoreResult<()> {
    sqlx::query(
        "INSERT INTO session_transitions (session_id, seq, from_state, to_state, at, reason, \
         hold_reason) VALUES ($1, $2, $3, $4, $5, $6, $7)",
    )
    .bind(id.to_string())
    .bind(i64::try_from(seq).map_err(|_| StoreError::Corrupt("history too long".to_owned()))?)
    .bind(transition.from.map(SessionState::as_str))
    .bind(transition.to.as_str())
    .bind(timestamp(transition.at))
    .bind(reason)
    .bind(hold.map(HoldReason::as_str))
    .execute(&mut **tx)
    .await?;
    Ok(())
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
mod dashboard;
mod gateway;
mod gpu_policy;
mod grid_jobs;
mod identity;
mod images;
pub(super) mod inventory;
mod jobs;
mod nodes;
pub(super) mod planning;
mod token_links;
mod usage;
mod users;
