//! What the nodes' syncs record outside the site's write lock, written together
//! ([`super::together`]) whatever its kind: heartbeats ([`super::heartbeats`]), activity samples
//! ([`super::samples`]) and jobs' output records ([`super::job_logs`]). Every such record that
//! waits when a write of them gets the writer goes in that one transaction, each kind in its
//! own statements.
//!
//! Each kind had a queue of its own, and each queue's write took SQLite's one writer for a
//! transaction of its own: in a run of the fleet bench (1,000 nodes, `bench/run.sh --only
//! fleet`), 26,323 of the 38,487 writes made together were these kinds' (13,424 of heartbeats,
//! 8,350 of samples, 4,549 of output records), while the writer was busy 88 to 95% of the time
//! and the creates, submits and rounds waited for it. In one queue the writer was taken 380 to
//! 480 times a second in the create phase, against 530 to 620. A sync's own records still come
//! one after the other (its heartbeat first, its samples last): those of different syncs share
//! a write.
//!
//! What it costs: a record that cannot be written (a damaged row the samples read) fails the
//! write of all the records with it, which are then written each alone ([`super::together`]),
//! as long as the damage lasts. On PostgreSQL a write holds the row locks of its heartbeats'
//! nodes, samples' sessions and output records' jobs until it commits; a write under the site's
//! lock that takes the same rows in another order may meet it in a deadlock, which PostgreSQL
//! breaks by failing one of them: these are then written again, each alone.

use std::collections::HashSet;

use chrono::{DateTime, Utc};
use ongrid_core::holds::ContainerActivity;
use ongrid_core::NodeName;
use sqlx::Transaction;

use super::heartbeats::{self, Beat};
use super::job_logs;
use super::samples::NodeSamples;
use super::together::{Lock, WriteQueue};
use super::{Db, SqlStore};
use crate::domain::sessions::holds::LifecycleConfig;
use crate::store::{OutputKept, StoreResult};

/// The syncs' records waiting for a write.
pub type SyncRecordQueue = WriteQueue<SyncRecord, Recorded>;

/// A record of a node's sync.
#[derive(Debug)]
pub enum SyncRecord {
    /// The node was seen.
    Beat(Beat),
    /// Its sessions' activity.
    Samples(NodeSamples),
    /// How much of its jobs' output the manager has.
    Output(Vec<OutputKept>),
}

/// What the write of a [`SyncRecord`] answers: for a heartbeat, whether its node is registered;
/// for samples, how many were recorded (of sessions on the node that sampled them). Nothing for
/// an output record.
#[derive(Debug, Clone, Copy, Default)]
pub struct Recorded {
    pub(super) node_seen: bool,
    pub(super) samples: usize,
}

impl SqlStore {
    /// Stores that `node` was seen at `at`, in the write of every sync's records waiting with
    /// it: `false` when the node is not registered (removed meanwhile).
    pub(super) async fn write_heartbeat(
        &self,
        node: &NodeName,
        at: DateTime<Utc>,
    ) -> StoreResult<bool> {
        let beat = Beat::new(node, at);
        let recorded = self.record_together(SyncRecord::Beat(beat)).await?;
        Ok(recorded.node_seen)
    }

    /// Stores the samples of the sessions placed on `node` (others are ignored), as seen at
    /// `at`, in the write of every sync's records waiting with them; how many were recorded.
    /// A recorded sample is written when the hold policy must see it
    /// ([`crate::domain::sessions::facts::reading_due`]).
    pub(super) async fn record_activity(
        &self,
        node: &NodeName,
        samples: &[ContainerActivity],
        at: DateTime<Utc>,
        lifecycle: &LifecycleConfig,
    ) -> StoreResult<usize> {
        let Some(sync) = NodeSamples::of(node, samples, at, lifecycle) else {
            return Ok(0);
        };
        let recorded = self.record_together(SyncRecord::Samples(sync)).await?;
        Ok(recorded.samples)
    }

    /// Stores `logs` in the write of every sync's records waiting with them
    /// ([`crate::store::Store::record_job_logs`]).
    pub(super) async fn record_job_logs(&self, logs: Vec<OutputKept>) -> StoreResult<()> {
        if logs.is_empty() {
            return Ok(());
        }
        self.record_together(SyncRecord::Output(logs)).await?;
        Ok(())
    }

    /// Writes `record` with every record of the syncs waiting with it, outside the site's write
    /// lock; what its write answers.
    async fn record_together(&self, record: SyncRecord) -> StoreResult<Recorded> {
        self.sync_records
            .write(self, record, Lock::Outside, |store, tx, records| {
                Box::pin(store.write_records(tx, records))
            })
            .await
    }

    /// Writes `records` in `tx`, each kind in its own statements, and commits: each record's
    /// answer, in order.
    async fn write_records(
        &self,
        mut tx: Transaction<'static, Db>,
        records: &[SyncRecord],
    ) -> StoreResult<Vec<StoreResult<Recorded>>> {
        let mut beats = Vec::new();
        let mut samples = Vec::new();
        let mut outputs = Vec::new();
        for record in records {
            match record {
                SyncRecord::Beat(beat) => beats.push(beat),
                SyncRecord::Samples(sync) => samples.push(sync),
                SyncRecord::Output(logs) => outputs.push(logs),
            }
        }
        let seen = if beats.is_empty() {
            HashSet::new()
        } else {
            heartbeats::write_beats(&mut tx, &beats).await?
        };
        let sampled = if samples.is_empty() {
            None
        } else {
            Some(self.write_samples(&mut tx, &samples).await?)
        };
        job_logs::write_logs(&mut tx, &outputs).await?;
        tx.commit().await?;
        let recorded = sampled
            .map(|written| self.samples_committed(&written, &samples))
            .unwrap_or_default();
        debug_assert_eq!(
            recorded.len(),
            samples.len(),
            "one count per sync's samples"
        );
        let mut recorded = recorded.into_iter();
        Ok(records
            .iter()
            .map(|record| {
                Ok(match record {
                    SyncRecord::Beat(beat) => Recorded {
                        node_seen: seen.contains(beat.node.as_str()),
                        ..Recorded::default()
                    },
                    SyncRecord::Samples(_) => Recorded {
                        samples: recorded.next().unwrap_or_default(),
                        ..Recorded::default()
                    },
                    SyncRecord::Output(_) => Recorded::default(),
                })
            })
            .collect())
    }
}
