//! Agents' activity samples written together ([`super::sync_records`]): the samples of every
//! sync that arrives while a write of the syncs' records waits for the writer go in that write,
//! in at most four statements whatever their number: which sampled sessions are on the node
//! that sampled them (with what is stored of them), their `session_lifecycle` rows made where
//! missing, one `UPDATE` of the CPU readings and one of the GPU readings.
//!
//! Every agent samples its running containers at nearly every sync, so a site of 1,000 nodes
//! sends thousands of samples a second. Only those the hold policy must see now are written
//! ([`facts::reading_due`]): a reading that turned active or idle, activity after an idle one,
//! and otherwise one a minute per session (less for a short idle timeout,
//! [`facts::rewritten_every`]). The last activity seen but not written is kept in memory
//! ([`Samples`]) and written with the next reading that is, and when the store closes
//! ([`SqlStore::write_unwritten`]): a session busy until a moment ago is stored as busy until
//! then. The samples are written outside the site's write lock ([`SqlStore::write_samples`]).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex, PoisonError};

use chrono::{DateTime, TimeDelta, Utc};
use ongrid_core::holds::ContainerActivity;
use ongrid_core::{NodeName, SessionId};
use sqlx::{QueryBuilder, Row, Transaction};

use super::{parse, parse_timestamp, timestamp, Db, DbRow, SqlStore, GREATEST};
use crate::domain::sessions::facts::{self, Reading, SampleFacts};
use crate::domain::sessions::holds::{ActivityThresholds, LifecycleConfig, Sampled};
use crate::store::StoreResult;

/// The activity of the agents' samples seen but not written. Cheap to clone (shared).
#[derive(Debug, Clone, Default)]
pub struct Samples {
    unwritten: Arc<Mutex<Unwritten>>,
}

/// Per session and measure, the last active reading this manager received and did not write
/// ([`facts::reading_due`] said it could wait); written with the session's next reading that is.
/// With two managers, each keeps the readings it received.
#[derive(Debug, Default)]
struct Unwritten {
    active: HashMap<(SessionId, Measure), DateTime<Utc>>,
    /// When readings of sessions no longer sampled (ended, moved) were last dropped.
    pruned_at: Option<DateTime<Utc>>,
}

impl Unwritten {
    /// Keeps what a committed write left unwritten and forgets what it wrote; now and then
    /// drops the readings of sessions no longer sampled.
    fn after_write(&mut self, written: &Decided, now: DateTime<Utc>) {
        for key in &written.forget {
            self.active.remove(key);
        }
        for &(key, at) in &written.remember {
            let kept = self.active.entry(key).or_insert(at);
            *kept = (*kept).max(at);
        }
        let every = facts::READING_REWRITTEN_EVERY;
        if self.pruned_at.is_none_or(|pruned| now - pruned >= every) {
            // Activity this old is stored: a session sampled here since had a reading written
            // here within `every`, which took it with it; one whose samples went to another
            // manager had its readings written there, busy or turned idle, at the same pace.
            // A sample's time is the manager's clock: one that goes back prunes later.
            self.active.retain(|_, at| now - *at < every * 2);
            self.pruned_at = Some(now);
        }
    }
}

/// A measure of a sample, with its columns in `session_lifecycle`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(super) enum Measure {
    Cpu,
    Gpu,
}

impl Measure {
    /// Its last activity, its last reading's time and that reading's percentage.
    pub(super) fn columns(self) -> [&'static str; 3] {
        match self {
            Self::Cpu => ["cpu_active_at", "cpu_sampled_at", "cpu_percent"],
            Self::Gpu => ["gpu_active_at", "gpu_sampled_at", "gpu_percent"],
        }
    }

    fn threshold(self, thresholds: ActivityThresholds) -> f64 {
        match self {
            Self::Cpu => thresholds.cpu_percent,
            Self::Gpu => thresholds.gpu_percent,
        }
    }
}

/// One sync's samples: sessions `node` sampled, each with what its sample records, and the
/// site's rules they are judged by (the same in every sync).
#[derive(Debug)]
pub struct NodeSamples {
    node: NodeName,
    samples: Vec<(SessionId, SampleFacts)>,
    thresholds: ActivityThresholds,
    /// The site's idle timeout, for sessions without their own.
    idle_timeout: TimeDelta,
}

/// The readings of one measure of one session in a write: the latest, and the time of the last
/// one at or above the threshold, when one was.
#[derive(Debug, Clone, Copy)]
struct Latest {
    reading: Reading,
    active_at: Option<DateTime<Utc>>,
}

impl Latest {
    /// `reading` with those before it.
    fn and(before: Option<Self>, reading: Reading) -> Self {
        let active_at = reading.active.then_some(reading.sampled_at);
        let Some(before) = before else {
            return Self { reading, active_at };
        };
        Self {
            reading: if before.reading.sampled_at > reading.sampled_at {
                before.reading
            } else {
                reading
            },
            active_at: before.active_at.max(active_at),
        }
    }
}

/// A sampled session found on the node that sampled it, with what is stored of it (`None`: no
/// `session_lifecycle` row yet).
#[derive(Debug)]
struct Placed {
    node: NodeName,
    stored: Option<StoredFacts>,
}

#[derive(Debug, Clone, Copy, Default)]
struct StoredFacts {
    idle_timeout: Option<TimeDelta>,
    cpu: Sampled,
    gpu: Sampled,
}

/// What [`SqlStore::write_samples`] wrote, until its transaction commits.
#[derive(Debug, Default)]
pub(super) struct SamplesWritten {
    decided: Decided,
    /// The sampled sessions found on the node that sampled them.
    placed: HashMap<SessionId, Placed>,
    /// The time of the latest sample written.
    now: DateTime<Utc>,
}

/// What a write does with the readings of its batch.
#[derive(Debug, Default)]
struct Decided {
    /// Sessions whose `session_lifecycle` row is to be made.
    rows: Vec<SessionId>,
    /// The readings written, per measure (CPU, GPU), with the activity to write.
    cpu: Vec<(SessionId, Latest)>,
    gpu: Vec<(SessionId, Latest)>,
    /// Unwritten activity that this write takes with it.
    forget: Vec<(SessionId, Measure)>,
    /// Activity left unwritten.
    remember: Vec<((SessionId, Measure), DateTime<Utc>)>,
}

impl NodeSamples {
    /// The samples of `node`'s sync seen at `at`, judged by `lifecycle`'s rules: `None` when
    /// none can be recorded (the sync sent none, or none whose CPU percentage is a number).
    pub(super) fn of(
        node: &NodeName,
        samples: &[ContainerActivity],
        at: DateTime<Utc>,
        lifecycle: &LifecycleConfig,
    ) -> Option<Self> {
        let thresholds = lifecycle.thresholds;
        let samples: Vec<(SessionId, SampleFacts)> = samples
            .iter()
            .filter_map(|sample| {
                let facts = facts::activity_sample(sample, thresholds, at)?;
                Some((sample.session_id, facts))
            })
            .collect();
        if samples.is_empty() {
            return None;
        }
        Some(Self {
            node: node.clone(),
            samples,
            thresholds,
            idle_timeout: TimeDelta::from_std(lifecycle.idle_timeout).unwrap_or(TimeDelta::MAX),
        })
    }
}

impl SqlStore {
    /// Writes the samples of `all` that are due in `tx`, each session's as if its samples had
    /// been written one after the other; what it wrote, for [`Self::samples_committed`] once
    /// `tx` commits.
    ///
    /// Not under the site's write lock ([`super::together::Lock::Outside`]; PostgreSQL's
    /// advisory lock, SQLite has one writer anyway): what a sample decides (which sessions are
    /// on the node that sampled them) moves nothing of the site, and a session that left its
    /// node after the check has a reading from its container of a moment ago, as had the
    /// sample come just before it left. Under the lock, the samples of every node's sync held
    /// up placements and creates.
    pub(super) async fn write_samples(
        &self,
        tx: &mut Transaction<'static, Db>,
        all: &[&NodeSamples],
    ) -> StoreResult<SamplesWritten> {
        let Some(last) = all.last() else {
            return Ok(SamplesWritten::default());
        };
        let mut latest: BTreeMap<(SessionId, &NodeName, Measure), Latest> = BTreeMap::new();
        for sync in all {
            for (id, facts) in &sync.samples {
                let readings = [(Measure::Cpu, Some(facts.cpu)), (Measure::Gpu, facts.gpu)];
                for (measure, reading) in readings {
                    if let Some(reading) = reading {
                        let key = (*id, &sync.node, measure);
                        latest.insert(key, Latest::and(latest.get(&key).copied(), reading));
                    }
                }
            }
        }
        let now = all
            .iter()
            .flat_map(|sync| sync.samples.iter().map(|(_, facts)| facts.cpu.sampled_at))
            .max()
            .unwrap_or_default();
        let sampled: BTreeSet<(SessionId, &NodeName)> =
            latest.keys().map(|&(id, node, _)| (id, node)).collect();
        let placed = on_their_nodes(tx, sampled).await?;
        let decided = {
            let unwritten = self
                .samples
                .unwritten
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            decide(&latest, &placed, &unwritten, last)
        };
        if !decided.rows.is_empty() {
            let mut rows = QueryBuilder::<Db>::new("WITH v (id) AS (");
            rows.push_values(&decided.rows, |mut row, id| {
                row.push_bind(id.to_string());
            });
            // `WHERE TRUE`: SQLite's parser needs one before `ON CONFLICT` after a `SELECT`.
            rows.push(
                ") INSERT INTO session_lifecycle (session_id) SELECT v.id FROM v WHERE TRUE \
                 ON CONFLICT (session_id) DO NOTHING",
            );
            // Statements of the batch's length: kept out of the statement cache but for one.
            let persistent = decided.rows.len() == 1;
            rows.build()
                .persistent(persistent)
                .execute(&mut **tx)
                .await?;
        }
        store_readings(tx, Measure::Cpu, &decided.cpu).await?;
        store_readings(tx, Measure::Gpu, &decided.gpu).await?;
        Ok(SamplesWritten {
            decided,
            placed,
            now,
        })
    }

    /// Keeps what the committed write of `all` left unwritten, and forgets what it wrote: how
    /// many samples of each sync of `all` were recorded, in order.
    pub(super) fn samples_committed(
        &self,
        written: &SamplesWritten,
        all: &[&NodeSamples],
    ) -> Vec<usize> {
        self.samples
            .unwritten
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .after_write(&written.decided, written.now);
        all.iter()
            .map(|sync| {
                sync.samples
                    .iter()
                    .filter(|(id, _)| {
                        written.placed.get(id).map(|placed| &placed.node) == Some(&sync.node)
                    })
                    .count()
            })
            .collect()
    }

    /// Writes the activity this store received and did not write yet (the last active reading
    /// of each session and measure), so that a manager that stops loses none of it; called as
    /// the store closes, once nothing samples any more. How many were written.
    pub(super) async fn write_unwritten(&self) -> StoreResult<usize> {
        let unwritten: Vec<((SessionId, Measure), DateTime<Utc>)> = self
            .samples
            .unwritten
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .active
            .drain()
            .collect();
        if unwritten.is_empty() {
            return Ok(0);
        }
        let mut tx = self.writes().begin().await?;
        for measure in [Measure::Cpu, Measure::Gpu] {
            let active: Vec<(SessionId, DateTime<Utc>)> = unwritten
                .iter()
                .filter(|((_, of), _)| *of == measure)
                .map(|&((id, _), at)| (id, at))
                .collect();
            if active.is_empty() {
                continue;
            }
            let [active_at, ..] = measure.columns();
            let mut query = QueryBuilder::<Db>::new("WITH v (id, active_at) AS (");
            query.push_values(&active, |mut row, (id, at)| {
                row.push_bind(id.to_string()).push_bind(timestamp(*at));
            });
            query.push(format!(
                ") UPDATE session_lifecycle SET {active_at} = {} \
                 FROM v WHERE session_lifecycle.session_id = v.id",
                later_activity(active_at)
            ));
            query.build().persistent(false).execute(&mut *tx).await?;
        }
        tx.commit().await?;
        Ok(unwritten.len())
    }
}

/// [`SqlStore::write_unwritten`] as `store` closes; what cannot be written is logged, lost.
pub async fn write_before_closing(store: &SqlStore) {
    match store.write_unwritten().await {
        Ok(0) => {}
        Ok(written) => {
            tracing::info!(
                written,
                "Activity not written yet written as the store closes."
            );
        }
        Err(error) => {
            tracing::warn!(%error, "The activity not written yet could not be written as the store closes; the sessions it kept busy may be held up to a minute early.");
        }
    }
}

/// Which of the `latest` readings of the sessions `placed` on the node that sampled them are
/// written, by [`facts::reading_due`] against what is stored and left `unwritten` before, under
/// the rules of `site` (the site's, in every sync).
fn decide(
    latest: &BTreeMap<(SessionId, &NodeName, Measure), Latest>,
    placed: &HashMap<SessionId, Placed>,
    unwritten: &Unwritten,
    site: &NodeSamples,
) -> Decided {
    let mut decided = Decided::default();
    for (&(id, node, measure), latest) in latest {
        let Some(placed) = placed.get(&id).filter(|placed| &placed.node == node) else {
            continue;
        };
        // The readings of a session come one after the other (the map's order).
        if placed.stored.is_none() && decided.rows.last() != Some(&id) {
            decided.rows.push(id);
        }
        let stored = placed.stored.unwrap_or_default();
        let (sampled, written) = match measure {
            Measure::Cpu => (stored.cpu, &mut decided.cpu),
            Measure::Gpu => (stored.gpu, &mut decided.gpu),
        };
        let key = (id, measure);
        let last_active = latest.active_at.max(unwritten.active.get(&key).copied());
        let every = facts::rewritten_every(stored.idle_timeout.unwrap_or(site.idle_timeout));
        let threshold = measure.threshold(site.thresholds);
        if facts::reading_due(&sampled, threshold, latest.reading, last_active, every) {
            let reading = latest.reading;
            written.push((
                id,
                Latest {
                    reading,
                    active_at: last_active,
                },
            ));
            decided.forget.push(key);
        } else if let Some(at) = latest.active_at {
            decided.remember.push((key, at));
        }
    }
    decided
}

/// Those of the sessions `sampled` placed on the node that sampled them, with what is stored of
/// them.
async fn on_their_nodes<'a>(
    tx: &mut Transaction<'static, Db>,
    sampled: impl IntoIterator<Item = (SessionId, &'a NodeName)>,
) -> StoreResult<HashMap<SessionId, Placed>> {
    let mut query = QueryBuilder::<Db>::new("WITH v (id, node) AS (");
    query.push_values(sampled, |mut row, (id, node)| {
        row.push_bind(id.to_string()).push_bind(node.as_str());
    });
    query.push(
        ") SELECT s.id, s.node, l.session_id AS lifecycle, l.idle_timeout_secs, \
         l.cpu_active_at, l.cpu_sampled_at, l.cpu_percent, \
         l.gpu_active_at, l.gpu_sampled_at, l.gpu_percent \
         FROM sessions s JOIN v ON v.id = s.id AND v.node = s.node \
         LEFT JOIN session_lifecycle l ON l.session_id = s.id",
    );
    let rows = query.build().persistent(false).fetch_all(&mut **tx).await?;
    rows.iter()
        .map(|row| {
            let id = parse(&row.try_get::<String, _>("id")?, "session id")?;
            let node = parse(&row.try_get::<String, _>("node")?, "node name")?;
            let stored = match row.try_get::<Option<String>, _>("lifecycle")? {
                None => None,
                Some(_) => Some(StoredFacts {
                    idle_timeout: row
                        .try_get::<Option<i64>, _>("idle_timeout_secs")?
                        .and_then(TimeDelta::try_seconds),
                    cpu: sampled_from_row(row, Measure::Cpu)?,
                    gpu: sampled_from_row(row, Measure::Gpu)?,
                }),
            };
            Ok((id, Placed { node, stored }))
        })
        .collect()
}

/// Stores each session's `measure` as `readings` say: its latest reading, and its last activity
/// when it is later than the stored one (another manager may have written a later one).
async fn store_readings(
    tx: &mut Transaction<'static, Db>,
    measure: Measure,
    readings: &[(SessionId, Latest)],
) -> StoreResult<()> {
    if readings.is_empty() {
        return Ok(());
    }
    let [active_at, sampled_at, percent] = measure.columns();
    let mut query = QueryBuilder::<Db>::new("WITH v (id, sampled_at, percent, active_at) AS (");
    query.push_values(readings, |mut row, (id, latest)| {
        row.push_bind(id.to_string())
            .push_bind(timestamp(latest.reading.sampled_at))
            .push_bind(latest.reading.percent)
            .push_bind(latest.active_at.map(timestamp));
    });
    query.push(format!(
        ") UPDATE session_lifecycle SET {sampled_at} = v.sampled_at, {percent} = v.percent, \
         {active_at} = {} FROM v WHERE session_lifecycle.session_id = v.id",
        later_activity(active_at)
    ));
    query
        .build()
        .persistent(readings.len() == 1)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// The later of `v.active_at` and the stored `active_at` column, for an `UPDATE` of
/// `session_lifecycle` from a `VALUES` list `v`: another manager may have written a later one.
/// Timestamps are fixed-width RFC 3339 text, so their order is the text's; `''` stands for none.
fn later_activity(active_at: &str) -> String {
    format!(
        "NULLIF({GREATEST}(COALESCE(v.active_at, ''), \
         COALESCE(session_lifecycle.{active_at}, '')), '')"
    )
}

/// The stored `measure` of a `session_lifecycle` row.
pub(super) fn sampled_from_row(row: &DbRow, measure: Measure) -> StoreResult<Sampled> {
    let [active_at, sampled_at, percent] = measure.columns();
    let time = |column: &str| -> StoreResult<Option<DateTime<Utc>>> {
        row.try_get::<Option<String>, _>(column)?
            .map(|t| parse_timestamp(&t))
            .transpose()
    };
    Ok(Sampled {
        active_at: time(active_at)?,
        sampled_at: time(sampled_at)?,
        percent: row.try_get(percent)?,
    })
}
