//! The planning read of the nodes ([`Store::planning_nodes`](crate::store::Store::planning_nodes)):
//! the nodes and their GPUs as last read, kept in memory, read again only when the site's
//! inventory changed; of the node rows, only those not seen lately are read every time.
//!
//! Every write that changes what the scheduler knows of a node or a GPU (a node registered,
//! drained or removed; a GPU added, gone or moved to another node, its health or MIG devices, its
//! mode, its drain) bumps `inventory_version` (migration 0023) in its own transaction
//! ([`bump`]). A node's last sync does not: it moves with every sync of every node, and a round
//! needs it only to tell the nodes that stopped responding from the others. So a planning read
//! reads first the last sync of the nodes not seen since the cutoff it was given, usually none;
//! then the counter; then the node and GPU rows, only when the counter moved since the ones kept
//! were read. Reading the counter before the rows makes a stale copy impossible: rows read
//! after the counter are at least as new as it, so a change committed after either read moves
//! the counter past the one kept with them. Reading the last syncs before the counter keeps a
//! node removed meanwhile from showing online: removed before that read, it is gone from the rows
//! of the counter after; removed after it, that read had it, offline as a node is when removed.
//! Replicas on one PostgreSQL database each keep their own copy and see each other's changes
//! through the counter. A GPU's utilisation alone does not move it (agents report it every
//! sync): the planning read's is as of the last change, and views read
//! [`Store::nodes`](crate::store::Store::nodes).
//!
//! The owners of nodes and GPUs and the reservations
//! ([`GpuPolicyStore::owners_and_reservations`](crate::store::gpu_policy::GpuPolicyStore::owners_and_reservations),
//! read by every round and every view of a waiting or running session) are kept the same way:
//! setting an owner, adding or removing a reservation bumps the version too (so the nodes and
//! GPUs are read again with them, for a rare change of an admin's), and so do the node removals
//! and registrations and the GPU moves that change whose owner counts.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use chrono::{DateTime, Utc};
use ongrid_core::{NodeName, SessionState};
use sqlx::Transaction;

use super::{parse, parse_timestamp, timestamp, Db, DbConnection, SqlStore};
use crate::store::gpu_policy::OwnersAndReservations;
use crate::store::{
    DesiredReads, GpuRecord, ImageFilter, NodeRecord, NodeWork, PlanningNodes, SessionFilter,
    StoreResult,
};

/// The GPUs of each node, ordered as [`Store::nodes`](crate::store::Store::nodes) orders them.
pub(super) type GpusByNode = BTreeMap<NodeName, Arc<[GpuRecord]>>;

/// The nodes and GPUs a manager read for planning, and the owners and reservations, shared by
/// the clones of one store.
#[derive(Debug, Clone, Default)]
pub struct KeptInventory {
    planning: AtVersion<Kept>,
    policy: AtVersion<OwnersAndReservations>,
}

/// Nodes and GPUs as read.
#[derive(Debug, Clone)]
struct Kept {
    /// Every registered node with its GPUs, ordered by name; each one's last sync as of the read.
    nodes: Arc<[NodeRecord]>,
    gpus: Arc<GpusByNode>,
}

/// A read kept with the inventory version it is at least as new as.
#[derive(Debug)]
struct AtVersion<T>(Arc<Mutex<Option<(i64, T)>>>);

impl<T> Default for AtVersion<T> {
    fn default() -> Self {
        Self(Arc::default())
    }
}

impl<T> Clone for AtVersion<T> {
    fn clone(&self) -> Self {
        Self(Arc::clone(&self.0))
    }
}

impl<T: Clone> AtVersion<T> {
    fn at(&self, version: i64) -> Option<T> {
        let kept = self.0.lock().ok()?;
        kept.as_ref()
            .filter(|(at, _)| *at == version)
            .map(|(_, read)| read.clone())
    }

    /// Keeps `read`, made at `version`, unless a read at a later version is kept already.
    fn keep(&self, version: i64, read: T) {
        if let Ok(mut kept) = self.0.lock() {
            if kept.as_ref().is_none_or(|(at, _)| *at <= version) {
                *kept = Some((version, read));
            }
        }
    }
}

/// The inventory's version as a table `v` of one row (0 before the first change), for the
/// statements that read it with the node rows they join to it: a row even when none joins.
macro_rules! version_row {
    () => {
        "(SELECT COALESCE((SELECT version FROM inventory_version WHERE id = 1), 0) AS version) v"
    };
}

/// Moves the inventory version on, inside the transaction of the change.
pub(super) async fn bump(tx: &mut Transaction<'static, Db>) -> StoreResult<()> {
    sqlx::query(
        "INSERT INTO inventory_version (id, version) VALUES (1, 1) \
         ON CONFLICT (id) DO UPDATE SET version = inventory_version.version + 1",
    )
    .execute(&mut **tx)
    .await?;
    Ok(())
}

impl SqlStore {
    pub(super) async fn planning_nodes(
        &self,
        seen_since: DateTime<Utc>,
    ) -> StoreResult<PlanningNodes> {
        // Before the nodes, so that a node removed meanwhile is in neither read or offline in
        // this one.
        let (version, not_seen) = self.not_seen_since(seen_since).await?;
        let kept = match self.inventory.planning.at(version) {
            Some(kept) => kept,
            None => {
                let read = self.read_inventory().await?;
                self.inventory.planning.keep(version, read.clone());
                read
            }
        };
        let nodes = kept
            .nodes
            .iter()
            .map(|node| NodeRecord {
                last_seen: match not_seen.get(&node.name) {
                    Some(last_seen) => *last_seen,
                    None => node.last_seen.max(seen_since),
                },
                ..node.clone()
            })
            .collect();
        Ok(PlanningNodes { version, nodes })
    }

    /// Every registered node and GPU.
    async fn read_inventory(&self) -> StoreResult<Kept> {
        let node_rows = self.node_rows(None).await?;
        let gpus = Arc::new(self.gpus_by_node(None).await?);
        let nodes = node_rows
            .iter()
            .map(|row| {
                let mut node = super::node_from_row(row)?;
                node.gpus = gpus.get(&node.name).cloned().unwrap_or_default();
                Ok(node)
            })
            .collect::<StoreResult<_>>()?;
        Ok(Kept { nodes, gpus })
    }

    /// The inventory's version, and the last sync of each registered node not seen at or after
    /// `since`: one statement (a row with the version alone when every node was seen).
    async fn not_seen_since(
        &self,
        since: DateTime<Utc>,
    ) -> StoreResult<(i64, HashMap<NodeName, DateTime<Utc>>)> {
        let rows: Vec<(i64, Option<String>, Option<String>)> = sqlx::query_as(concat!(
            "SELECT v.version, n.name, n.last_seen FROM ",
            version_row!(),
            " LEFT JOIN nodes n ON n.removed_at IS NULL AND n.last_seen < $1"
        ))
        .bind(timestamp(since))
        .fetch_all(&self.pool)
        .await?;
        let version = rows.first().map_or(0, |(version, _, _)| *version);
        let not_seen = rows
            .iter()
            .filter_map(|(_, name, last_seen)| Some((name.as_deref()?, last_seen.as_deref()?)))
            .map(|(name, last_seen)| Ok((parse(name, "node name")?, parse_timestamp(last_seen)?)))
            .collect::<StoreResult<_>>()?;
        Ok((version, not_seen))
    }

    /// What a node's desired state reads besides its sessions and jobs
    /// ([`Store::desired_reads`](crate::store::Store::desired_reads)), on one connection.
    pub(super) async fn desired_reads(
        &self,
        node: &NodeName,
        images_removed_since: DateTime<Utc>,
    ) -> StoreResult<Option<DesiredReads>> {
        let mut conn = self.pool.acquire().await?;
        self.desired_reads_on(&mut conn, node, images_removed_since)
            .await
    }

    /// [`Self::desired_reads`] and the node's work, on one connection
    /// ([`Store::desired_reads_and_work`](crate::store::Store::desired_reads_and_work)).
    pub(super) async fn desired_reads_and_work(
        &self,
        node: &NodeName,
        images_removed_since: DateTime<Utc>,
    ) -> StoreResult<Option<(DesiredReads, NodeWork)>> {
        let mut conn = self.pool.acquire().await?;
        let Some(reads) = self
            .desired_reads_on(&mut conn, node, images_removed_since)
            .await?
        else {
            return Ok(None);
        };
        let sessions = super::read_sessions(&mut *conn, SessionFilter::Node(node.clone())).await?;
        let ran_before = if sessions.iter().any(|s| s.state == SessionState::Starting) {
            super::activity::read_resuming(&mut *conn, node).await?
        } else {
            Vec::new()
        };
        let jobs = self.node_jobs(&mut conn, node).await?;
        Ok(Some((
            reads,
            NodeWork {
                sessions,
                ran_before,
                jobs,
            },
        )))
    }

    /// The reads of [`Self::desired_reads`], on `conn`: the node's GPUs from the kept ones when
    /// they are at the inventory's version (read first, as [`Self::planning_nodes`] does), else
    /// read alone (the kept ones are refreshed only by a planning read of every node); its
    /// images only when the statement that reads the version finds one. `None` when the node is
    /// not registered (or was removed), which that statement looks up too.
    async fn desired_reads_on(
        &self,
        conn: &mut DbConnection,
        node: &NodeName,
        images_removed_since: DateTime<Utc>,
    ) -> StoreResult<Option<DesiredReads>> {
        let (version, registered, any_images): (i64, Option<String>, bool) =
            sqlx::query_as(concat!(
                "SELECT v.version, n.name, EXISTS (SELECT 1 FROM images i WHERE ",
                super::images::for_node_images!(),
                ") FROM ",
                version_row!(),
                " LEFT JOIN nodes n ON n.name = $1 AND n.removed_at IS NULL"
            ))
            .bind(node.as_str())
            .bind(timestamp(images_removed_since))
            .fetch_one(&mut *conn)
            .await?;
        if registered.is_none() {
            return Ok(None);
        }
        let gpus = match self.inventory.planning.at(version) {
            Some(kept) => kept.gpus.get(node).cloned().unwrap_or_default(),
            None => super::read_gpus_by_node(&mut *conn, Some(node))
                .await?
                .remove(node)
                .unwrap_or_default(),
        };
        let images = if any_images {
            let filter = ImageFilter::ForNode {
                node: node.clone(),
                removed_since: images_removed_since,
            };
            super::images::read_images(&mut *conn, filter).await?
        } else {
            Vec::new()
        };
        Ok(Some(DesiredReads { gpus, images }))
    }

    /// The owners and reservations as kept when they are at the inventory's version (read
    /// first, as [`Self::planning_nodes`] does), else read and kept.
    pub(super) async fn kept_policy(&self) -> StoreResult<OwnersAndReservations> {
        let version = self.inventory_version().await?;
        if let Some(policy) = self.inventory.policy.at(version) {
            return Ok(policy);
        }
        let policy = self.read_policy().await?;
        self.inventory.policy.keep(version, policy.clone());
        Ok(policy)
    }

    async fn inventory_version(&self) -> StoreResult<i64> {
        let version: Option<i64> =
            sqlx::query_scalar("SELECT version FROM inventory_version WHERE id = 1")
                .fetch_optional(&self.pool)
                .await?;
        Ok(version.unwrap_or(0))
    }
}
