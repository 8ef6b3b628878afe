//! Batch jobs on MIG devices: [`plan_mig_jobs`] starts queued jobs that ask for a MIG device
//! ([`ongrid_core::Sharing::Mig`]) on free devices, and halts jobs on MIG devices for
//! sessions that found none free, by the rules `batch.rs` applies to whole GPUs.
//!
//! The session manager calls it after [`crate::plan`] and [`crate::plan_mig`] with the same
//! [`SiteState`] and slots, their actions and placements: what they started, halted and
//! placed is taken into account, so nothing is given twice.
//!
//! # Rules
//!
//! - **Sessions first.** A pending MIG session that `plan_mig` could not place (in
//!   `(priority, queued_at, id)` order) waits for a job on a device that would meet it and is
//!   halting already (asked before, or by this plan for its max duration) and that no earlier
//!   session waits for; else it halts one job past its min duration on such a device
//!   ([`JobReason::ForInteractiveSession`]). A job within its min duration is never halted for
//!   a session. The least sufficient device first, as for placing (then the session's
//!   preferred node, node name, UUID); only usable devices (online, undrained node; healthy,
//!   undrained parent in MIG mode) and only on a pinned session's node. One job on a device
//!   holds it alone, so halting one job always frees what the session needs. Who waits for
//!   which halting job is decided again every plan from this order, so no state is kept: the
//!   device goes to the first session that fits once its job is HALTED.
//! - **Jobs.** Queued MIG jobs, in `(priority, queued_at, id)` order, take the least sufficient
//!   free device (then node name, UUID) that no session took, within their notBefore, their
//!   bucket (counting the jobs holding GPUs or devices and those started by this plan) and
//!   their pinned node. Jobs halt nothing. A job past its notAfter is cancelled by `plan`.
//! - **Owners and reservations** ([`crate::Policy`]), as on whole GPUs: a device is bound by
//!   its parent GPU's. A job goes only where the policy lets it (others' jobs run on owned
//!   devices as backfill; nothing of another group, nor work that would outlast the start,
//!   goes on a device whose GPU has a reservation), the owners' jobs to their own devices
//!   first, others' to devices nobody owns before backfilling owned ones. A session halts only jobs on devices it may be given; on its group's own devices
//!   it halts any job of another group, within its min duration too
//!   ([`JobReason::ForOwnerWork`]). A running job on a device whose GPU's reservation of
//!   another group has opened is halted ([`JobReason::ReservationStarted`]).

use std::collections::{HashMap, HashSet};

use chrono::{DateTime, Utc};
use ongrid_core::job::{BucketName, JobId, JobReason};
use ongrid_core::{GpuUuid, MigUuid, NodeName, UserName};
use serde::{Deserialize, Serialize};

use crate::batch::reached;
use crate::mig::{meets, usable, valid_mig_request, MigPlacement, MigSlot};
use crate::policy::{Policy, Who};
use crate::site::{Action, PendingSession, QueuedJob, RunningJob, SiteState};

/// What the session manager should do about batch jobs on MIG devices.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "action", rename_all = "snake_case")]
pub enum MigJobAction {
    /// Start a queued job on the MIG device `device` of `parent` (QUEUED → RUNNING).
    Start {
        job: JobId,
        node: NodeName,
        device: MigUuid,
        parent: GpuUuid,
    },
    /// Halt a running job on a MIG device (RUNNING → MUSTHALT): a waiting session needs it.
    /// The session stays PENDING and gets the device once the job is HALTED.
    Halt { job: JobId, reason: JobReason },
}

/// Plans batch jobs on MIG devices (see the module's rules), after `plan`'s `actions` and
/// `plan_mig`'s `placed`. Deterministic: the result does not depend on the order of the
/// input's vectors.
pub fn plan_mig_jobs(
    site: &SiteState,
    slots: &[MigSlot],
    now: DateTime<Utc>,
    actions: &[Action],
    placed: &[MigPlacement],
) -> Vec<MigJobAction> {
    let mut round = MigJobRound::new(site, slots, now, actions);
    round.halt_for_reservations();
    round.halt_for_sessions(placed);
    round.start_queued(actions, placed);
    round.out
}

/// What the phases of [`plan_mig_jobs`] share: the input, the running jobs by id, the jobs
/// halting from this plan on, and the actions decided so far.
struct MigJobRound<'a> {
    site: &'a SiteState,
    slots: &'a [MigSlot],
    now: DateTime<Utc>,
    running: HashMap<JobId, &'a RunningJob>,
    /// Jobs `plan` or an earlier phase asked to halt.
    halted_now: HashSet<JobId>,
    out: Vec<MigJobAction>,
}

impl<'a> MigJobRound<'a> {
    fn new(
        site: &'a SiteState,
        slots: &'a [MigSlot],
        now: DateTime<Utc>,
        actions: &[Action],
    ) -> Self {
        Self {
            site,
            slots,
            now,
            running: site.running_jobs.iter().map(|j| (j.id, j)).collect(),
            halted_now: actions
                .iter()
                .filter_map(|a| match a {
                    Action::HaltJob { job, .. } => Some(*job),
                    _ => None,
                })
                .collect(),
            out: Vec::new(),
        }
    }

    /// The running jobs on MIG devices, with their device.
    fn on_devices(&self) -> impl Iterator<Item = (&'a MigSlot, &'a RunningJob)> + '_ {
        self.slots
            .iter()
            .filter_map(|slot| Some((slot, *self.running.get(&slot.job?)?)))
    }

    /// Halts the jobs on devices whose GPU's reservation of another group has opened.
    fn halt_for_reservations(&mut self) {
        let policy = &self.site.policy;
        let mut holding: Vec<(&MigSlot, &RunningJob)> = self
            .on_devices()
            .filter(|(_, job)| !job.halting && !self.halted_now.contains(&job.id))
            .collect();
        holding.sort_by_key(|(_, job)| job.id);
        for (slot, job) in holding {
            let group = Who::job(policy, &job.id).group;
            if let Some(reservation) = policy.started_against(&slot.parent, group, self.now) {
                self.halted_now.insert(job.id);
                self.out.push(MigJobAction::Halt {
                    job: job.id,
                    reason: JobReason::ReservationStarted {
                        reservation: reservation.name.clone(),
                        group: reservation.group.clone(),
                    },
                });
            }
        }
    }

    /// Each session that found no free device waits for a halting job on one that would meet
    /// it, else halts one.
    fn halt_for_sessions(&mut self, placed: &[MigPlacement]) {
        let placed_sessions: HashSet<_> = placed.iter().map(|p| p.session).collect();
        let mut sessions: Vec<&PendingSession> = self
            .site
            .pending
            .iter()
            .filter(|s| valid_mig_request(&s.request) && !placed_sessions.contains(&s.id))
            .collect();
        sessions.sort_by_key(|s| (s.priority, s.queued_at, s.id));
        let mut claimed: HashSet<JobId> = HashSet::new();
        for session in sessions {
            if let Some((job, halt)) = self.job_for(session, &claimed) {
                claimed.insert(job);
                if let Some(reason) = halt {
                    self.out.push(MigJobAction::Halt { job, reason });
                }
            }
        }
    }

    /// The job whose device `session` is to get: one halting already (no new halt), else one
    /// it may halt, with the reason; `None` when no job's device would do.
    fn job_for(
        &self,
        session: &PendingSession,
        claimed: &HashSet<JobId>,
    ) -> Option<(JobId, Option<JobReason>)> {
        let (site, policy, now) = (self.site, &self.site.policy, self.now);
        let wanted = session.request.sharing.mig()?;
        let who = Who::session(policy, &session.id);
        let candidates = || {
            self.on_devices().filter(|(slot, job)| {
                !claimed.contains(&job.id)
                    && session
                        .pinned_node
                        .as_ref()
                        .is_none_or(|pin| pin == &slot.node)
                    && meets(slot, &session.request, wanted)
                    && usable(site, slot)
                    && policy.allows(&policy.tag(&slot.parent, now), &who, now)
            })
        };
        let order = |slot: &&MigSlot| {
            (
                // MigProfile orders by slices, then memory, then media: the least sufficient first.
                slot.profile,
                session.preferred_node.as_ref() != Some(&slot.node),
                slot.node.clone(),
                slot.uuid.clone(),
            )
        };
        let halting = candidates()
            .filter(|(_, job)| job.halting || self.halted_now.contains(&job.id))
            .min_by_key(|(slot, _)| order(slot));
        if let Some((_, job)) = halting {
            return Some((job.id, None));
        }
        // On its group's own devices, owner work halts another group's job at once.
        let backfill = |slot: &MigSlot, job: &RunningJob| {
            Policy::owned_by(&policy.tag(&slot.parent, now), &who)
                && Who::job(policy, &job.id).group != who.group
        };
        let (slot, job) = candidates()
            .filter(|(slot, job)| {
                !job.halting
                    && !self.halted_now.contains(&job.id)
                    && (reached(job.started_at, job.min_duration, now) || backfill(slot, job))
            })
            .min_by_key(|(slot, job)| (!backfill(slot, job), order(slot)))?;
        let reason = match who.group {
            Some(group) if backfill(slot, job) => JobReason::ForOwnerWork {
                group: group.to_owned(),
            },
            _ => JobReason::ForInteractiveSession {
                need: session.request,
            },
        };
        Some((job.id, Some(reason)))
    }

    /// Starts queued MIG jobs on the devices left free (not taken by a session), within their
    /// buckets.
    fn start_queued(&mut self, actions: &[Action], placed: &[MigPlacement]) {
        let (site, policy, now) = (self.site, &self.site.policy, self.now);
        let mut taken: HashSet<&MigUuid> = placed.iter().map(|p| &p.device).collect();
        let cancelled: HashSet<JobId> = actions
            .iter()
            .filter_map(|a| match a {
                Action::CancelJob { job, .. } => Some(*job),
                _ => None,
            })
            .collect();
        let mut in_bucket = jobs_in_buckets(site, actions);
        let mut jobs: Vec<&QueuedJob> = site
            .queued_jobs
            .iter()
            .filter(|j| {
                valid_mig_request(&j.request)
                    && !cancelled.contains(&j.id)
                    && j.not_before.is_none_or(|t| t <= now)
                    && j.not_after.is_none_or(|t| t > now)
            })
            .collect();
        jobs.sort_by_key(|j| (j.priority, j.queued_at, j.id));
        for job in jobs {
            let Some(wanted) = job.request.sharing.mig() else {
                continue;
            };
            let bucket_full = job.bucket.as_ref().is_some_and(|b| {
                in_bucket
                    .get(&(&job.owner, &b.name))
                    .is_some_and(|&n| n >= b.max)
            });
            if bucket_full {
                continue;
            }
            let who = Who::job(policy, &job.id);
            let best = self
                .slots
                .iter()
                .filter(|slot| !slot.used && !taken.contains(&slot.uuid))
                .filter(|slot| job.pinned_node.as_ref().is_none_or(|pin| pin == &slot.node))
                .filter(|slot| meets(slot, &job.request, wanted) && usable(site, slot))
                .filter(|slot| policy.allows(&policy.tag(&slot.parent, now), &who, now))
                .min_by_key(|slot| {
                    // The group's own devices first, then those nobody owns, then backfill.
                    let tag = policy.tag(&slot.parent, now);
                    (
                        !Policy::owned_by(&tag, &who),
                        tag.owner.is_some(),
                        // MigProfile orders by slices, then memory, then media: the least sufficient first.
                        slot.profile,
                        &slot.node,
                        &slot.uuid,
                    )
                });
            if let Some(slot) = best {
                taken.insert(&slot.uuid);
                if let Some(bucket) = &job.bucket {
                    *in_bucket.entry((&job.owner, &bucket.name)).or_default() += 1;
                }
                self.out.push(MigJobAction::Start {
                    job: job.id,
                    node: slot.node.clone(),
                    device: slot.uuid.clone(),
                    parent: slot.parent.clone(),
                });
            }
        }
    }
}

/// How many jobs of each owner's bucket hold GPUs or devices, counting those `plan` starts.
fn jobs_in_buckets<'a>(
    site: &'a SiteState,
    actions: &[Action],
) -> HashMap<(&'a UserName, &'a BucketName), u32> {
    let mut in_bucket: HashMap<(&UserName, &BucketName), u32> = HashMap::new();
    for job in &site.running_jobs {
        if let Some(bucket) = &job.bucket {
            *in_bucket.entry((&job.owner, bucket)).or_default() += 1;
        }
    }
    for action in actions {
        if let Action::StartJob { job, .. } = action {
            if let Some(queued) = site.queued_jobs.iter().find(|q| q.id == *job) {
                if let Some(bucket) = &queued.bucket {
                    *in_bucket.entry((&queued.owner, &bucket.name)).or_default() += 1;
                }
            }
        }
    }
    in_bucket
}
