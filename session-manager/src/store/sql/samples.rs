//! Agents' activity samples written together ([`super::together`]): the samples of every sync
//! that arrives while some are being written go in the next write, in four statements whatever
//! their number: which sampled sessions are on the node that sampled them, their
//! `session_lifecycle` rows made where missing, one `UPDATE` of the CPU readings and one of the
//! GPU readings.
//!
//! Every agent samples its running containers at nearly every sync, so a site of 1,000 nodes
//! sends thousands of samples a second; written one sample at a time (a check, a row, two
//! updates each), a sync of eight sessions held the site's write lock for 34 statements. They
//! are written outside that lock ([`SqlStore::write_samples`]).

use std::collections::{BTreeMap, HashMap};

use chrono::{DateTime, Utc};
use ongrid_core::holds::ContainerActivity;
use ongrid_core::{NodeName, SessionId};
use sqlx::{QueryBuilder, Transaction};

use super::together::WriteQueue;
use super::{parse, timestamp, Db, SqlStore};
use crate::domain::sessions::facts::{self, Reading, SampleFacts};
use crate::domain::sessions::holds::ActivityThresholds;
use crate::store::StoreResult;

/// The syncs' samples waiting for a write; each answers how many of its samples were recorded.
pub type SampleQueue = WriteQueue<NodeSamples, usize>;

/// One sync's samples: sessions `node` sampled, each with what its sample records.
#[derive(Debug)]
pub struct NodeSamples {
    node: NodeName,
    samples: Vec<(SessionId, SampleFacts)>,
}

/// What a write stores of one measure of one session: its last reading, and the time of the
/// last one at or above the threshold, when one was.
#[derive(Debug, Clone, Copy)]
struct Stored {
    sampled_at: DateTime<Utc>,
    percent: f64,
    active_at: Option<DateTime<Utc>>,
}

impl Stored {
    /// `reading` after what is stored: the later reading is the last, and an active one is the
    /// last activity.
    fn and(stored: Option<Self>, reading: Reading) -> Self {
        let active_at = reading.active.then_some(reading.sampled_at);
        match stored {
            Some(stored) if stored.sampled_at > reading.sampled_at => Self {
                active_at: stored.active_at.max(active_at),
                ..stored
            },
            stored => Self {
                sampled_at: reading.sampled_at,
                percent: reading.percent,
                active_at: active_at.or(stored.and_then(|stored| stored.active_at)),
            },
        }
    }
}

impl SqlStore {
    /// Stores the samples of the sessions placed on `node` (others are ignored), as seen at
    /// `at`, in the write of every sync's samples waiting with them; how many were recorded.
    pub(super) async fn record_activity(
        &self,
        node: &NodeName,
        samples: &[ContainerActivity],
        at: DateTime<Utc>,
        thresholds: ActivityThresholds,
    ) -> StoreResult<usize> {
        let samples: Vec<(SessionId, SampleFacts)> = samples
            .iter()
            .filter_map(|sample| {
                let facts = facts::activity_sample(sample, thresholds, at)?;
                Some((sample.session_id, facts))
            })
            .collect();
        if samples.is_empty() {
            return Ok(0);
        }
        let node = node.clone();
        self.samples
            .write(self, NodeSamples { node, samples }, |store, all| {
                Box::pin(store.write_samples(all))
            })
            .await
    }

    /// Writes the samples of `all` in one write transaction, each session's as if its samples
    /// had been written one after the other.
    async fn write_samples(&self, all: &[NodeSamples]) -> StoreResult<Vec<StoreResult<usize>>> {
        let mut cpu: BTreeMap<(SessionId, &NodeName), Stored> = BTreeMap::new();
        let mut gpu: BTreeMap<(SessionId, &NodeName), Stored> = BTreeMap::new();
        for sync in all {
            for (id, facts) in &sync.samples {
                let key = (*id, &sync.node);
                cpu.insert(key, Stored::and(cpu.get(&key).copied(), facts.cpu));
                if let Some(reading) = facts.gpu {
                    gpu.insert(key, Stored::and(gpu.get(&key).copied(), reading));
                }
            }
        }
        // Not under the site's write lock (PostgreSQL's advisory lock; SQLite has one writer
        // anyway): what a sample decides (which sessions are on the node that sampled them)
        // moves nothing of the site, and a session that left its node after the check has a
        // reading from its container of a moment ago, as had the sample come just before it
        // left. Under the lock, the samples of every node's sync held up placements and creates.
        let mut tx = self.writes().begin().await?;
        let placed = on_their_nodes(&mut tx, cpu.keys().copied()).await?;
        if !placed.is_empty() {
            let mut rows = QueryBuilder::<Db>::new("WITH v (id) AS (");
            rows.push_values(&placed, |mut row, (id, _)| {
                row.push_bind(id.to_string());
            });
            // `WHERE TRUE`: SQLite's parser needs one before `ON CONFLICT` after a `SELECT`.
            rows.push(
                ") INSERT INTO session_lifecycle (session_id) SELECT v.id FROM v WHERE TRUE \
                 ON CONFLICT (session_id) DO NOTHING",
            );
            // Statements of the batch's length: kept out of the statement cache but for one.
            let persistent = placed.len() == 1;
            rows.build()
                .persistent(persistent)
                .execute(&mut *tx)
                .await?;
            for (measure, readings) in [("cpu", &cpu), ("gpu", &gpu)] {
                let readings: Vec<(SessionId, Stored)> = readings
                    .iter()
                    .filter(|((id, node), _)| placed.get(id) == Some(*node))
                    .map(|((id, _), stored)| (*id, *stored))
                    .collect();
                store_readings(&mut tx, measure, &readings).await?;
            }
        }
        tx.commit().await?;
        Ok(all
            .iter()
            .map(|sync| {
                let recorded = sync
                    .samples
                    .iter()
                    .filter(|(id, _)| placed.get(id) == Some(&sync.node))
                    .count();
                Ok(recorded)
            })
            .collect())
    }
}

/// Those of the sessions `sampled` placed on the node that sampled them, with that node.
async fn on_their_nodes<'a>(
    tx: &mut Transaction<'static, Db>,
    sampled: impl IntoIterator<Item = (SessionId, &'a NodeName)>,
) -> StoreResult<HashMap<SessionId, NodeName>> {
    let mut query = QueryBuilder::<Db>::new("WITH v (id, node) AS (");
    query.push_values(sampled, |mut row, (id, node)| {
        row.push_bind(id.to_string()).push_bind(node.as_str());
    });
    query.push(") SELECT s.id, s.node FROM sessions s JOIN v ON v.id = s.id AND v.node = s.node");
    let rows: Vec<(String, String)> = query
        .build_query_as()
        .persistent(false)
        .fetch_all(&mut **tx)
        .await?;
    rows.iter()
        .map(|(id, node)| Ok((parse(id, "session id")?, parse(node, "node name")?)))
        .collect()
}

/// Stores each session's `measure` (`cpu` or `gpu`) as `readings` say: its last reading, and
/// its last activity when it had one.
async fn store_readings(
    tx: &mut Transaction<'static, Db>,
    measure: &str,
    readings: &[(SessionId, Stored)],
) -> StoreResult<()> {
    if readings.is_empty() {
        return Ok(());
    }
    let mut query = QueryBuilder::<Db>::new("WITH v (id, sampled_at, percent, active_at) AS (");
    query.push_values(readings, |mut row, (id, stored)| {
        row.push_bind(id.to_string())
            .push_bind(timestamp(stored.sampled_at))
            .push_bind(stored.percent)
            .push_bind(stored.active_at.map(timestamp));
    });
    query.push(format!(
        ") UPDATE session_lifecycle SET {measure}_sampled_at = v.sampled_at, \
         {measure}_percent = v.percent, \
         {measure}_active_at = COALESCE(v.active_at, session_lifecycle.{measure}_active_at) \
         FROM v WHERE session_lifecycle.session_id = v.id"
    ));
    query
        .build()
        .persistent(readings.len() == 1)
        .execute(&mut **tx)
        .await?;
    Ok(())
}
