//! The retention loop: what the site keeps of the past, and for how long (`[retention]`), as
//! Slurm's `PurgeJobAfter` and HTCondor's history rotation do. Every [`PRUNE_INTERVAL`] (and once
//! when this replica starts leading) it removes the records of jobs that ended longer than
//! `[retention] jobs` ago, with their output files under `[jobs] log_dir`, and the connections of
//! the audit log that closed longer than `[retention] connections` ago.
//!
//! Which jobs may go is [`crate::domain::jobs::removal`]'s rule, applied in SQL by
//! [`Store::prune_jobs`] past [`crate::domain::jobs::prune_before`]: ended, no grid engine still
//! following it, its output all in. Rows go in batches of [`PRUNE_BATCH`], one write transaction
//! each, so a first prune of a large database never holds the write lock for long.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio_util::sync::CancellationToken;

use crate::clock::Clock;
use crate::domain::jobs::prune_before;
use crate::job_logs::JobLogs;
use crate::store::{Store, StoreResult};

/// How often the loop prunes.
pub const PRUNE_INTERVAL: Duration = Duration::from_secs(3600);

/// At most this many rows of one table in one transaction.
pub const PRUNE_BATCH: u32 = 500;

/// The default of `[retention] jobs`: 30 days after a job ended, long enough to come back to a
/// month's results and restart chains, short enough that the output files (up to 16 MiB each)
/// of a busy site's jobs do not fill the manager's disk.
pub const DEFAULT_JOBS: Duration = Duration::from_secs(30 * 86_400);

/// The default of `[retention] connections`: 180 days after a connection closed, the six
/// months that grid security policies (EGI's traceability policy) ask sites to keep logs.
pub const DEFAULT_CONNECTIONS: Duration = Duration::from_secs(180 * 86_400);

/// `[retention]`, validated: how long ended jobs and closed connections are kept; `None`: for
/// ever.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetentionConfig {
    pub jobs: Option<Duration>,
    pub connections: Option<Duration>,
}

impl Default for RetentionConfig {
    fn default() -> Self {
        Self {
            jobs: Some(DEFAULT_JOBS),
            connections: Some(DEFAULT_CONNECTIONS),
        }
    }
}

/// What one prune removed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Pruned {
    pub jobs: usize,
    pub connections: u64,
}

/// The loop that prunes what is past its retention.
pub struct Retention {
    store: Arc<dyn Store>,
    clock: Arc<dyn Clock>,
    config: RetentionConfig,
    /// `[jobs] output_grace`: no job goes before its output is all in.
    output_grace: Duration,
    logs: JobLogs,
}

impl Retention {
    pub fn new(
        store: Arc<dyn Store>,
        clock: Arc<dyn Clock>,
        config: RetentionConfig,
        output_grace: Duration,
        logs: JobLogs,
    ) -> Self {
        Self {
            store,
            clock,
            config,
            output_grace,
            logs,
        }
    }

    /// Prunes now and every [`PRUNE_INTERVAL`] until `shutdown`.
    pub async fn run(self: Arc<Self>, shutdown: CancellationToken) {
        if self.config
            == (RetentionConfig {
                jobs: None,
                connections: None,
            })
        {
            return;
        }
        loop {
            if let Err(error) = self.prune(self.clock.now()).await {
                tracing::error!(%error, "Pruning ended jobs and closed connections failed; retrying in an hour.");
            }
            tokio::select! {
                () = shutdown.cancelled() => break,
                () = tokio::time::sleep(PRUNE_INTERVAL) => {}
            }
        }
    }

    /// Removes what is past its retention at `now`, batch by batch, and logs how much.
    pub async fn prune(&self, now: DateTime<Utc>) -> StoreResult<Pruned> {
        let mut pruned = Pruned::default();
        if let Some(retention) = self.config.jobs {
            let before = prune_before(retention, self.output_grace, now);
            loop {
                let ids = self.store.prune_jobs(before, PRUNE_BATCH).await?;
                for id in &ids {
                    // The record is gone: a file left behind is only disk space, said once.
                    if let Err(error) = self.logs.remove(*id).await {
                        tracing::warn!(job_id = %id, file = %self.logs.file(*id).display(), %error, "Could not delete a pruned job's output file: delete it by hand.");
                    }
                }
                pruned.jobs += ids.len();
                if ids.len() < PRUNE_BATCH as usize {
                    break;
                }
            }
        }
        if let Some(retention) = self.config.connections {
            let before = now
                .checked_sub_signed(
                    chrono::TimeDelta::from_std(retention).unwrap_or(chrono::TimeDelta::MAX),
                )
                .unwrap_or(DateTime::<Utc>::MIN_UTC);
            loop {
                let removed = self.store.prune_connections(before, PRUNE_BATCH).await?;
                pruned.connections += removed;
                if removed < u64::from(PRUNE_BATCH) {
                    break;
                }
            }
        }
        if pruned != Pruned::default() {
            tracing::info!(
                jobs = pruned.jobs,
                connections = pruned.connections,
                "Pruned the ended jobs and closed connections past their retention."
            );
        }
        Ok(pruned)
    }
}
