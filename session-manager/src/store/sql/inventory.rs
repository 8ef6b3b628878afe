//! The planning read of the nodes ([`Store::planning_nodes`](crate::store::Store::planning_nodes)):
//! the GPUs as last read, kept in memory, read again only when the site's inventory changed.
//!
//! Every write that changes what the scheduler knows of a GPU (one added, gone or moved to
//! another node, its health or MIG devices, its mode, its drain) bumps `inventory_version`
//! (migration 0023) in its own transaction ([`bump`]). A planning read reads the counter first,
//! then the node rows (light, and where `last_seen` moves with every sync), and the GPU rows only
//! when the counter moved since the GPUs kept were read. Reading the counter before the rows
//! makes a stale copy impossible: rows read after the counter are at least as new as it, so a
//! change committed after either read moves the counter past the one kept with them. Replicas on
//! one PostgreSQL database each keep their own copy and see each other's changes through the
//! counter. A GPU's utilisation alone does not move it (agents report it every sync): the
//! planning read's is as of the last change, and views read [`Store::nodes`](crate::store::Store::nodes).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use ongrid_core::NodeName;
use sqlx::Transaction;

use super::{Db, SqlStore};
use crate::store::{GpuRecord, NodeRecord, StoreResult};

/// The GPUs of each node, ordered as [`Store::nodes`](crate::store::Store::nodes) orders them.
pub(super) type GpusByNode = BTreeMap<NodeName, Arc<[GpuRecord]>>;

/// The GPUs a manager read for planning, shared by the clones of one store.
#[derive(Debug, Clone, Default)]
pub struct KeptInventory(Arc<Mutex<Option<Kept>>>);

/// GPUs as read, and the inventory version they are at least as new as.
#[derive(Debug)]
struct Kept {
    version: i64,
    gpus: Arc<GpusByNode>,
}

impl KeptInventory {
    fn at(&self, version: i64) -> Option<Arc<GpusByNode>> {
        let kept = self.0.lock().ok()?;
        kept.as_ref()
            .filter(|kept| kept.version == version)
            .map(|kept| Arc::clone(&kept.gpus))
    }

    /// Keeps `gpus`, read at `version`, unless a read at a later version is kept already.
    fn keep(&self, version: i64, gpus: Arc<GpusByNode>) {
        if let Ok(mut kept) = self.0.lock() {
            if kept.as_ref().is_none_or(|kept| kept.version <= version) {
                *kept = Some(Kept { version, gpus });
            }
        }
    }
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
    pub(super) async fn planning_nodes(&self) -> StoreResult<Vec<NodeRecord>> {
        let version = self.inventory_version().await?;
        let node_rows = self.node_rows(None).await?;
        let gpus = match self.inventory.at(version) {
            Some(gpus) => gpus,
            None => {
                let gpus = Arc::new(self.gpus_by_node(None).await?);
                self.inventory.keep(version, Arc::clone(&gpus));
                gpus
            }
        };
        node_rows
            .iter()
            .map(|row| {
                let mut node = super::node_from_row(row)?;
                node.gpus = gpus.get(&node.name).cloned().unwrap_or_default();
                Ok(node)
            })
            .collect()
    }

    /// One node's GPUs from the kept ones when they are at the inventory's version (read first,
    /// as [`Self::planning_nodes`] does), else read alone; the kept ones are refreshed only by
    /// a planning read of every node.
    pub(super) async fn planning_gpus(&self, node: &NodeName) -> StoreResult<Arc<[GpuRecord]>> {
        let version = self.inventory_version().await?;
        let mut gpus = match self.inventory.at(version) {
            Some(kept) => return Ok(kept.get(node).cloned().unwrap_or_default()),
            None => self.gpus_by_node(Some(node)).await?,
        };
        Ok(gpus.remove(node).unwrap_or_default())
    }

    async fn inventory_version(&self) -> StoreResult<i64> {
        let version: Option<i64> =
            sqlx::query_scalar("SELECT version FROM inventory_version WHERE id = 1")
                .fetch_optional(&self.pool)
                .await?;
        Ok(version.unwrap_or(0))
    }
}
