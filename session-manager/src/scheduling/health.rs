//! Phase 1 of a round: GPUs their nodes report unhealthy are drained and their work stopped;
//! with `auto_undrain`, GPUs healthy again come back.

use chrono::{DateTime, Utc};
use ongrid_core::job::JobId;

use super::Scheduler;
use crate::domain::{jobs, nodes};
use crate::site::SiteSnapshot;
use crate::store::StoreResult;

impl Scheduler {
    /// GPUs that online nodes report unhealthy (failed, or unknown): drained at once, their
    /// sessions FAILED and their jobs HALTED (restartable ones, re-queued) or FAILED. With
    /// `auto_undrain`, the health check's drain of a GPU healthy again is lifted. Returns how
    /// many changes it stored.
    pub(super) async fn check_health(
        &self,
        site: &SiteSnapshot,
        now: DateTime<Utc>,
    ) -> StoreResult<usize> {
        let mut changed = 0;
        for node in site.nodes.iter().filter(|n| site.is_online(n)) {
            for gpu in node.gpus.iter() {
                let uuid = &gpu.info.uuid;
                let health = &gpu.info.health;
                if nodes::lift_health_drain(health, gpu.drain.as_ref(), self.auto_undrain) {
                    self.store.set_gpu_drain(uuid, None).await?;
                    tracing::info!(gpu = %uuid, node = %node.name, "GPU healthy again: back in service (auto_undrain).");
                    changed += 1;
                    continue;
                }
                let Some(problem) = health.problem() else {
                    continue;
                };
                if let Some(drain) = nodes::health_drain(health, gpu.drain.as_ref(), now) {
                    self.store.set_gpu_drain(uuid, Some(drain)).await?;
                    tracing::warn!(gpu = %uuid, node = %node.name, %problem, "GPU drained: its node reports it unhealthy.");
                    changed += 1;
                }
                for session in site.sessions_on(uuid) {
                    if let Some(change) = nodes::session_on_bad_gpu(session, uuid, &problem, now) {
                        if self.apply(session.id, change).await? {
                            tracing::warn!(session_id = %session.id, gpu = %uuid, "Session failed with its GPU.");
                            changed += 1;
                        }
                    }
                }
                let on_gpu = site.jobs.iter().filter(|j| site.on_gpu(uuid, &j.gpus));
                for job in on_gpu {
                    if let Some(change) = nodes::job_on_bad_gpu(job, uuid, &problem, now) {
                        let next = jobs::next_in_chain(
                            job,
                            &change,
                            JobId::new_random(),
                            &self.job_limits,
                        );
                        if self.apply_job(job.id, change, next).await? {
                            tracing::warn!(job_id = %job.id, gpu = %uuid, "Job stopped with its GPU.");
                            changed += 1;
                        }
                    }
                }
            }
        }
        Ok(changed)
    }
}
