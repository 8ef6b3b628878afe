//! Limits in the scheduling loop: before each plan, the waiting sessions and jobs that would
//! take a user or group past a `[limits]` maximum are taken out of the plan's input, so they
//! wait, and the scheduler logs the limit that holds each (see
//! [`crate::domain::policy::limits`]). Sessions are offered before jobs, each class in the order
//! the plan serves it.

use std::collections::HashMap;

use ongrid_core::job::JobId;
use ongrid_core::{Dn, SessionId};
use ongrid_scheduler::SiteState;

use crate::domain::jobs::JobRecord;
use crate::domain::policy::fairshare::Account;
use crate::domain::policy::limits::{offer, Held, Kind, LimitHit, LimitsConfig, Request};
use crate::domain::policy::GroupName;
use crate::domain::sessions::SessionRecord;
use crate::site::SiteSnapshot;

/// A request held back by a limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Waiting {
    Session(SessionId),
    Job(JobId),
}

/// Takes the requests over a limit out of `state`; returns them with the limit that holds each.
pub fn hold_back(
    state: &mut SiteState,
    config: &LimitsConfig,
    accounts: &[Account],
    site: &SiteSnapshot,
    pending: &[SessionRecord],
) -> Vec<(Waiting, LimitHit)> {
    let group_of = |dn: &Dn| {
        accounts
            .iter()
            .find(|a| &a.user == dn)
            .map_or_else(GroupName::default_group, |a| a.group.clone())
    };
    let mut by_user: HashMap<Dn, Held> = HashMap::new();
    let mut by_group: HashMap<GroupName, Held> = HashMap::new();
    let mut count = |owner: &Dn, kind: Kind, gpus: usize| {
        let gpus = u32::try_from(gpus).unwrap_or(u32::MAX);
        for held in [
            by_user.entry(owner.clone()).or_default(),
            by_group.entry(group_of(owner)).or_default(),
        ] {
            match kind {
                Kind::Session => {
                    held.session_gpus += gpus;
                    held.sessions += 1;
                }
                Kind::Job => held.job_gpus += gpus,
            }
        }
    };
    for session in &site.holding {
        count(&session.owner, Kind::Session, session.gpus.len());
    }
    let holding_jobs: Vec<&JobRecord> = site
        .jobs
        .iter()
        .filter(|j| j.state().holds_gpus())
        .collect();
    for job in &holding_jobs {
        count(&job.owner, Kind::Job, job.gpus.len());
    }

    let mut sessions: Vec<_> = state.pending.iter().collect();
    sessions.sort_by_key(|s| (s.priority, s.queued_at, s.id));
    let mut jobs: Vec<_> = state.queued_jobs.iter().collect();
    jobs.sort_by_key(|j| (j.priority, j.queued_at, j.id));
    let mut requests = Vec::new();
    for queued in sessions {
        if let Some(session) = pending.iter().find(|s| s.id == queued.id) {
            requests.push(Request {
                id: Waiting::Session(queued.id),
                owner: session.owner.clone(),
                group: group_of(&session.owner),
                kind: Kind::Session,
                gpus: queued.request.count,
            });
        }
    }
    for queued in jobs {
        if let Some(job) = site.jobs.iter().find(|j| j.id == queued.id) {
            requests.push(Request {
                id: Waiting::Job(queued.id),
                owner: job.owner.clone(),
                group: group_of(&job.owner),
                kind: Kind::Job,
                gpus: queued.request.count,
            });
        }
    }
    let held_back: Vec<(Waiting, LimitHit)> = offer(&requests, &by_user, &by_group, config)
        .into_iter()
        .filter_map(|(id, verdict)| verdict.err().map(|hit| (id, hit)))
        .collect();
    state.pending.retain(|s| {
        !held_back
            .iter()
            .any(|(id, _)| *id == Waiting::Session(s.id))
    });
    state
        .queued_jobs
        .retain(|j| !held_back.iter().any(|(id, _)| *id == Waiting::Job(j.id)));
    held_back
}
