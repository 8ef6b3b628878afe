//! Phases 3 and 4 of a round: the work of nodes that stopped responding, and re-queued jobs
//! whose checkpoint was on such a node.
//!
//! STARTING sessions of a node that went offline go back to PENDING ("node N stopped
//! responding"), keeping their place in the queue. Sessions already running there are lost with
//! it: FAILED with [`nodes::lost_with_node`]'s reason, so their GPUs no longer count as used;
//! when the agent is back it stops their containers (never starts them twice). Jobs holding
//! GPUs there are HALTED and re-queued when restartable, else FAILED ("node lost").

use chrono::{DateTime, Utc};
use ongrid_core::job::JobId;
use ongrid_core::SessionState;

use super::{Scheduler, TickReport};
use crate::domain::nodes;
use crate::domain::{jobs, sessions::queue};
use crate::site::SiteSnapshot;
use crate::store::{NodeRecord, StoreResult};

impl Scheduler {
    /// Whether this manager gave up on `node`'s work at `now`: it has been silent past the node
    /// timeout (counted from this manager's start at the earliest).
    fn given_up(&self, node: &NodeRecord, now: DateTime<Utc>) -> bool {
        nodes::work_given_up(node.last_seen, self.started, self.node_timeout, now)
    }

    /// Re-queues or fails the work of every node given up on, counting it in `report`.
    pub(super) async fn give_up_lost_nodes(
        &self,
        site: &SiteSnapshot,
        now: DateTime<Utc>,
        report: &mut TickReport,
    ) -> StoreResult<()> {
        for node in site.nodes.iter().filter(|n| self.given_up(n, now)) {
            report.jobs += self.lose_jobs(site, node, now).await?;
            let (requeued, lost) = self.lose_sessions(site, node, now).await?;
            report.requeued += requeued;
            report.lost += lost;
        }
        Ok(())
    }

    /// Jobs holding GPUs on `node`: halted and re-queued when restartable, else failed.
    async fn lose_jobs(
        &self,
        site: &SiteSnapshot,
        node: &NodeRecord,
        now: DateTime<Utc>,
    ) -> StoreResult<usize> {
        let mut lost = 0;
        let on_node = site
            .jobs
            .iter()
            .filter(|j| j.state().holds_gpus() && j.node.as_ref() == Some(&node.name));
        for job in on_node {
            let Some(change) = jobs::node_lost(job, now) else {
                continue;
            };
            let next = jobs::next_in_chain(job, &change, JobId::new_random(), &self.job_limits);
            if self.apply_job(job.id, change, next).await? {
                tracing::info!(job_id = %job.id, node = %node.name, "Job lost with its node.");
                lost += 1;
            }
        }
        Ok(lost)
    }

    /// The sessions holding GPUs on `node`: a STARTING one back to the queue, keeping its
    /// place; a running one FAILED with the node. Returns how many went each way.
    async fn lose_sessions(
        &self,
        site: &SiteSnapshot,
        node: &NodeRecord,
        now: DateTime<Utc>,
    ) -> StoreResult<(usize, usize)> {
        let (mut requeued, mut lost) = (0, 0);
        let on_node = site
            .holding
            .iter()
            .filter(|s| s.node.as_ref() == Some(&node.name));
        for session in on_node {
            if session.state == SessionState::Starting {
                let change = queue::requeue_stranded(&node.name, now);
                if self.apply(session.id, change).await? {
                    tracing::info!(session_id = %session.id, node = %node.name, "Session re-queued: its node stopped responding.");
                    requeued += 1;
                }
                continue;
            }
            let change =
                nodes::lost_with_node(session, &node.name, node.last_seen, self.node_timeout, now);
            let Some(change) = change else {
                continue;
            };
            if self.apply(session.id, change).await? {
                tracing::warn!(session_id = %session.id, node = %node.name, "Session lost with its node.");
                lost += 1;
            }
        }
        Ok((requeued, lost))
    }

    /// Re-queued jobs whose checkpoint is on a node that is gone or given up on: FAILED.
    pub(super) async fn fail_jobs_of_lost_checkpoints(
        &self,
        site: &SiteSnapshot,
        now: DateTime<Utc>,
    ) -> StoreResult<usize> {
        let mut failed = 0;
        for job in &site.jobs {
            let online = job.pinned_node.as_ref().is_some_and(|pinned| {
                site.nodes
                    .iter()
                    .any(|n| n.name == *pinned && !self.given_up(n, now))
            });
            let Some(change) = jobs::checkpoint_node_lost(job, online, now) else {
                continue;
            };
            if self.apply_job(job.id, change, None).await? {
                tracing::info!(job_id = %job.id, node = ?job.pinned_node, "Job failed: its checkpoint's node is gone.");
                failed += 1;
            }
        }
        Ok(failed)
    }
}
