//! The freeze watch: the loop that fails BUILDING images that can no longer finish, so that
//! none stays BUILDING forever.
//!
//! When a freeze is given up is decided by [`crate::domain::images::give_up`]: the node has not
//! synced for longer than `node_timeout`; the session is ENDED, FAILED or gone and the agent has
//! not said so first; the freeze's progress has not moved for `freeze_stall_timeout` (a Docker
//! commit or export that hangs, an agent that ignores the order; a freeze queued behind others
//! on its node counts as stalled too). The image is failed with [`Store::record_freeze`], as an
//! agent's report would be: whichever comes first wins, a later report is ignored, and the agent
//! drops the order it no longer gets.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio_util::sync::CancellationToken;

use crate::clock::Clock;
use crate::domain::images::{give_up, FreezeLimits, ImageRecord};
use crate::notify::Changes;
use crate::store::{ImageFilter, Store, StoreResult};

/// How often the watch looks at the BUILDING images.
pub const WATCH_INTERVAL: Duration = Duration::from_secs(2);

/// The loop that applies [`give_up`] to every BUILDING image.
pub struct FreezeWatch {
    store: Arc<dyn Store>,
    clock: Arc<dyn Clock>,
    limits: FreezeLimits,
    started: DateTime<Utc>,
    /// Told of every freeze given up, so its agent stops it at once.
    changes: Option<Changes>,
}

impl FreezeWatch {
    pub fn new(store: Arc<dyn Store>, clock: Arc<dyn Clock>, limits: FreezeLimits) -> Self {
        let started = clock.now();
        Self {
            store,
            clock,
            limits,
            started,
            changes: None,
        }
    }

    /// Notifies `changes` of every freeze it gives up.
    pub fn with_changes(mut self, changes: Changes) -> Self {
        self.changes = Some(changes);
        self
    }

    /// Checks every [`WATCH_INTERVAL`] until `shutdown`.
    pub async fn run(self: Arc<Self>, shutdown: CancellationToken) {
        loop {
            tokio::select! {
                () = shutdown.cancelled() => break,
                () = tokio::time::sleep(WATCH_INTERVAL) => {}
            }
            if let Err(error) = self.check(self.clock.now()).await {
                tracing::error!(%error, "Checking the running freezes failed; retrying.");
            }
        }
    }

    /// Fails the BUILDING images that are stuck at `now`; returns them as failed. One read of
    /// the BUILDING images, and of the nodes only when there is one.
    pub async fn check(&self, now: DateTime<Utc>) -> StoreResult<Vec<ImageRecord>> {
        let mut failed = Vec::new();
        let building = self.store.images(ImageFilter::AllBuilding).await?;
        if building.is_empty() {
            return Ok(failed);
        }
        // A removed node's freeze has no last sync: given up as one that stopped responding.
        // Only whether a node stopped responding is asked of its last sync.
        let last_seen: HashMap<_, _> = self
            .store
            .planning_nodes(crate::site::online_since(now, self.limits.node_timeout))
            .await?
            .nodes
            .into_iter()
            .map(|node| (node.name, node.last_seen))
            .collect();
        for image in building {
            let node = &image.node;
            let session = self.store.session(image.session_id).await?;
            let Some(change) = give_up(
                &image,
                session.as_ref(),
                last_seen.get(node).copied(),
                self.started,
                now,
                self.limits,
            ) else {
                continue;
            };
            if let Some(image) = self
                .store
                .record_freeze(node, image.id, &change, now)
                .await?
            {
                tracing::info!(image_id = %image.id, reference = %image.reference, %node, reason = ?image.reason, "Freeze given up.");
                if let Some(changes) = &self.changes {
                    changes.node(node);
                }
                failed.push(image);
            }
        }
        Ok(failed)
    }
}
