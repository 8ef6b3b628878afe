//! Limits in the scheduling loop: before each plan, the waiting sessions and jobs that would
//! take a user or group past a `[limits]` maximum, or a length class past its cap
//! (`[limits.length_classes]`), are taken out of the plan's input, so they wait, and the
//! scheduler logs the limit that holds each (see [`crate::domain::policy::limits`]). Sessions
//! are offered before jobs, each class in the order the plan serves it.

use std::collections::HashMap;
use std::time::Duration;

use ongrid_core::job::JobId;
use ongrid_core::{Dn, SessionId};
use ongrid_scheduler::SiteState;

use crate::domain::jobs::JobRecord;
use crate::domain::policy::fairshare::Account;
use crate::domain::policy::limits::{
    never_fits, offer, Blocked, Holdings, Kind, LimitsConfig, Request,
};
use crate::domain::policy::GroupName;
use crate::domain::sessions::holds::{LifecycleConfig, LifecycleFacts};
use crate::domain::sessions::SessionRecord;
use crate::site::SiteSnapshot;

/// A request held back by a limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Waiting {
    Session(SessionId),
    Job(JobId),
}

/// The GPUs the length classes' fraction is of: every GPU of every registered node, so the cap
/// does not shrink while a node is briefly away.
pub fn site_gpus(site: &SiteSnapshot) -> u32 {
    let gpus: usize = site.nodes.iter().map(|node| node.gpus.len()).sum();
    u32::try_from(gpus).unwrap_or(u32::MAX)
}

/// The longest each session may hold GPUs: its maximum lifetime (its own or the site's),
/// from its stored facts.
pub fn session_lengths(
    facts: &[LifecycleFacts],
    lifecycle: &LifecycleConfig,
) -> HashMap<SessionId, Duration> {
    facts
        .iter()
        .map(|f| {
            let length = f.max_duration(lifecycle).to_std().unwrap_or(Duration::MAX);
            (f.session_id, length)
        })
        .collect()
}

/// A job's length: its max duration (`None`: without end).
pub fn job_length(job: &JobRecord) -> Option<Duration> {
    job.max_duration.map(|d| d.as_duration())
}

/// Why a new request could never run under the site's `[limits]` (`None`: no limits) on
/// `site`, as the 403 says it, if it could not.
pub fn refusal(
    config: Option<&LimitsConfig>,
    request: &Request<()>,
    site: &SiteSnapshot,
) -> Option<String> {
    never_fits(request, config?, site_gpus(site)).map(|blocked| blocked.refusal(request))
}

/// What the limits need to know of this round beside the plan's input.
pub struct Round<'a> {
    pub config: &'a LimitsConfig,
    pub accounts: &'a [Account],
    pub site: &'a SiteSnapshot,
    /// The PENDING sessions.
    pub pending: &'a [SessionRecord],
    /// The maximum lifetime of every session holding GPUs or PENDING ([`session_lengths`]);
    /// one missing counts as the site's default lifetime.
    pub session_lengths: &'a HashMap<SessionId, Duration>,
    pub lifecycle: &'a LifecycleConfig,
}

/// Takes the requests over a limit out of `state`; returns them with what holds each.
pub fn hold_back(state: &mut SiteState, round: &Round<'_>) -> Vec<(Waiting, Blocked)> {
    let group_of = |dn: &Dn| {
        round
            .accounts
            .iter()
            .find(|a| &a.user == dn)
            .map_or_else(GroupName::default_group, |a| a.group.clone())
    };
    let session_length = |id: &SessionId| {
        Some(
            round
                .session_lengths
                .get(id)
                .copied()
                .unwrap_or(round.lifecycle.max_duration),
        )
    };
    let work = |id, owner: &Dn, kind, gpus: usize, length| Request {
        id,
        owner: owner.clone(),
        group: group_of(owner),
        kind,
        gpus: u32::try_from(gpus).unwrap_or(u32::MAX),
        length,
    };
    let mut held = Holdings::default();
    for session in &round.site.holding {
        let length = session_length(&session.id);
        held.add(
            &work(
                Waiting::Session(session.id),
                &session.owner,
                Kind::Session,
                session.gpus.len(),
                length,
            ),
            round.config,
        );
    }
    for job in round.site.jobs.iter().filter(|j| j.state().holds_gpus()) {
        held.add(
            &work(
                Waiting::Job(job.id),
                &job.owner,
                Kind::Job,
                job.gpus.len(),
                job_length(job),
            ),
            round.config,
        );
    }

    let mut sessions: Vec<_> = state.pending.iter().collect();
    sessions.sort_by_key(|s| (s.priority, s.queued_at, s.id));
    let mut jobs: Vec<_> = state.queued_jobs.iter().collect();
    jobs.sort_by_key(|j| (j.priority, j.queued_at, j.id));
    let mut requests = Vec::new();
    for queued in sessions {
        if let Some(session) = round.pending.iter().find(|s| s.id == queued.id) {
            requests.push(work(
                Waiting::Session(queued.id),
                &session.owner,
                Kind::Session,
                queued.request.count as usize,
                session_length(&queued.id),
            ));
        }
    }
    for queued in jobs {
        if let Some(job) = round.site.jobs.iter().find(|j| j.id == queued.id) {
            requests.push(work(
                Waiting::Job(queued.id),
                &job.owner,
                Kind::Job,
                queued.request.count as usize,
                job_length(job),
            ));
        }
    }
    let held_back: Vec<(Waiting, Blocked)> =
        offer(&requests, &held, round.config, site_gpus(round.site))
            .into_iter()
            .filter_map(|(id, verdict)| verdict.err().map(|blocked| (id, blocked)))
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

#[cfg(test)]
mod tests {
    //! A day of mixed work on a 16-GPU site under CHTC's length classes, simulated through the
    //! manager's real scheduling round (store, limits, plan) with an injected clock: every five
    //! minutes users submit short, medium and long jobs and open sessions of either lifetime;
    //! work ends when its run is over. After every round the test counts, from the store, what
    //! each user's medium and long work holds: never over the caps; and short work is never
    //! held back by a limit. It prints each class's GPU-hours and how often a cap held work
    //! (`cargo test -p ongrid-manager --lib limit_check -- --nocapture`).

    use std::sync::Arc;

    use chrono::{DateTime, TimeZone, Utc};
    use ongrid_core::job::{JobSpecFile, JobState, ObservedJobStatus};
    use ongrid_core::{GpuInfo, GpuUuid, SessionState};
    use tokio::sync::Notify;

    use super::*;
    use crate::clock::ManualClock;
    use crate::domain::jobs;
    use crate::domain::policy::limits::{LengthClass, LengthClasses};
    use crate::domain::sessions::requests;
    use crate::scheduling::Scheduler;
    use crate::store::{fixtures, JobFilter, NewSession, SessionFilter, Store};

    const TICK: i64 = 300;
    const DAY: i64 = 86_400;
    const HOUR: u64 = 3600;

    /// SplitMix64.
    struct Random(u64);

    impl Random {
        fn below(&mut self, n: u64) -> u64 {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            (z ^ (z >> 31)) % n.max(1)
        }

        fn between(&mut self, low: u64, high: u64) -> u64 {
            low + self.below(high - low + 1)
        }
    }

    fn at(second: i64) -> DateTime<Utc> {
        Utc.timestamp_opt(1_750_000_000 + second, 0).unwrap()
    }

    fn gpu(node: u8, n: u8) -> GpuInfo {
        let uuid = format!("GPU-11111111-2222-3333-4444-5555555{node:03}{n:02}");
        GpuInfo {
            uuid: GpuUuid::parse(&uuid).unwrap(),
            ..fixtures::gpu(n)
        }
    }

    #[tokio::test]
    async fn a_day_of_mixed_lengths_keeps_every_cap() {
        let classes = LengthClasses {
            long_max_gpus: 3,
            ..LengthClasses::CHTC
        };
        let config = LimitsConfig {
            length_classes: Some(classes),
            ..LimitsConfig::default()
        };
        let (_dir, store) = fixtures::sqlite().await;
        for node in 1..=2u8 {
            let registration = fixtures::registration(&format!("node{node}"));
            let gpus: Vec<GpuInfo> = (1..=8).map(|n| gpu(node, n)).collect();
            store
                .register_node(registration, &gpus, at(0))
                .await
                .unwrap();
        }
        // The nodes stay online all day without syncing.
        let scheduler = Scheduler::new(
            store.clone(),
            Arc::new(ManualClock::new(at(0))),
            std::time::Duration::from_secs(2 * DAY as u64),
            Arc::new(Notify::new()),
        )
        .with_limits(Some(config.clone()));
        let mut users = Vec::new();
        for n in 0..4 {
            let dn = Dn::parse(&format!("/DC=org/CN=User {n}")).unwrap();
            users.push(store.user(&dn, 20_000).await.unwrap());
        }

        let mut random = Random(0x6c65_6e67_7468);
        // How long each job and session runs once started, by id.
        let mut runs: HashMap<Waiting, i64> = HashMap::new();
        let mut lengths: HashMap<Waiting, Duration> = HashMap::new();
        // When each was first seen holding GPUs (the round that placed it).
        let mut started: HashMap<Waiting, i64> = HashMap::new();
        let mut gpu_seconds: HashMap<LengthClass, u64> = HashMap::new();
        let mut held_by_a_limit: HashMap<&'static str, u32> = HashMap::new();
        let (mut peak_long, mut peak_medium) = (0, 0);
        let medium_max = classes.medium_max_gpus(16);
        for tick in 0..DAY / TICK {
            let now = at(tick * TICK);
            // Arrivals: each user now and then submits a job or opens a session.
            for user in &users {
                if random.below(100) < 12 {
                    let hours = match random.below(3) {
                        0 => random.between(1, 12),
                        1 => random.between(13, 24),
                        _ => random.between(25, 7 * 24),
                    };
                    let spec = JobSpecFile {
                        max_duration: Some(format!("{hours}h")),
                        gpus: Some(u32::try_from(random.between(1, 2)).unwrap()),
                        ..Default::default()
                    };
                    let new = fixtures::job(user, spec, None, now);
                    let id = store.create_job(new).await.unwrap().id;
                    let max = i64::try_from(hours * HOUR).unwrap();
                    runs.insert(
                        Waiting::Job(id),
                        max / 2 + (random.below(100) as i64) * max / 200,
                    );
                    lengths.insert(Waiting::Job(id), Duration::from_secs(hours * HOUR));
                } else if random.below(100) < 4 {
                    let id = SessionId::new_random();
                    // Half ask for 8 hours (short work), half live the site's 7 days (long).
                    let max = (random.below(2) == 0).then_some(8 * HOUR);
                    let new = NewSession {
                        id,
                        max_duration_secs: max,
                        ..fixtures::new_session(&user.dn, now)
                    };
                    store.create_session(new).await.unwrap();
                    let length = Duration::from_secs(max.unwrap_or(7 * 24 * HOUR));
                    runs.insert(
                        Waiting::Session(id),
                        i64::try_from(random.between(1, 4) * HOUR).unwrap(),
                    );
                    lengths.insert(Waiting::Session(id), length);
                }
            }

            scheduler.tick(now).await.unwrap();

            // What holds GPUs now, by user and class, as the store has it.
            let holding = store
                .sessions(SessionFilter::States(crate::site::holding_states()))
                .await
                .unwrap();
            let active = store.jobs(JobFilter::Active).await.unwrap();
            let mut by_user: HashMap<Dn, (u32, u32)> = HashMap::new();
            let mut count = |owner: &Dn, id: Waiting, gpus: usize| {
                let started = *started.entry(id).or_insert(tick * TICK);
                let length = lengths[&id];
                let class = classes.class(Some(length)).unwrap();
                let gpus = u32::try_from(gpus).unwrap();
                let held = by_user.entry(owner.clone()).or_default();
                if class >= LengthClass::Medium {
                    held.0 += gpus;
                }
                if class == LengthClass::Long {
                    held.1 += gpus;
                }
                *gpu_seconds.entry(class).or_default() += u64::from(gpus) * TICK as u64;
                started + runs[&id] <= tick * TICK
            };
            let mut ending = Vec::new();
            for session in &holding {
                if count(
                    &session.owner,
                    Waiting::Session(session.id),
                    session.gpus.len(),
                ) {
                    ending.push((Waiting::Session(session.id), session.owner.clone()));
                }
            }
            for job in active.iter().filter(|j| j.state().holds_gpus()) {
                if count(&job.owner, Waiting::Job(job.id), job.gpus.len()) {
                    ending.push((Waiting::Job(job.id), job.owner.clone()));
                }
            }
            for (user, (medium, long)) in &by_user {
                assert!(
                    long <= &classes.long_max_gpus,
                    "{user} holds {long} long at {now}"
                );
                assert!(
                    *medium <= medium_max,
                    "{user} holds {medium} medium at {now}"
                );
                peak_long = peak_long.max(*long);
                peak_medium = peak_medium.max(*medium);
            }
            // Short work is never held by a limit; count what was.
            for job in active.iter().filter(|j| j.state() == JobState::Queued) {
                if let Some(reason) = scheduler.limit_wait(Waiting::Job(job.id)) {
                    let class = classes.class(Some(lengths[&Waiting::Job(job.id)])).unwrap();
                    assert_ne!(class, LengthClass::Short, "{reason}");
                    let cap = if reason.contains("long_max_gpus") {
                        "long"
                    } else {
                        "medium"
                    };
                    *held_by_a_limit.entry(cap).or_default() += 1;
                }
            }
            let pending = store
                .sessions(SessionFilter::States(vec![SessionState::Pending]))
                .await
                .unwrap();
            for session in &pending {
                if let Some(reason) = scheduler.limit_wait(Waiting::Session(session.id)) {
                    assert_eq!(
                        lengths[&Waiting::Session(session.id)],
                        Duration::from_secs(7 * 24 * HOUR),
                        "{reason}"
                    );
                    *held_by_a_limit.entry("long").or_default() += 1;
                }
            }

            // Work whose run is over ends.
            for (id, owner) in ending {
                match id {
                    Waiting::Session(id) => {
                        let name = users
                            .iter()
                            .find(|u| u.dn == owner)
                            .unwrap()
                            .user_name
                            .clone();
                        store
                            .transition(id, requests::remove(&name, now))
                            .await
                            .unwrap();
                    }
                    Waiting::Job(id) => {
                        let job = active.iter().find(|j| j.id == id).unwrap();
                        let exited = ObservedJobStatus::Exited {
                            started_at: job.lifecycle.started_at().unwrap(),
                            finished_at: now,
                            exit_code: 0,
                            oom_killed: false,
                            killed: false,
                            signalled_at: None,
                        };
                        let change = jobs::follow_report(job, &exited, now).unwrap();
                        store.job_transition(id, change, None).await.unwrap();
                    }
                }
            }
        }

        let hours = |class| gpu_seconds.get(&class).copied().unwrap_or_default() as f64 / 3600.0;
        let total = 16.0 * 24.0;
        println!(
            "GPU-hours of {total} by class: short {:.0}, medium {:.0}, long {:.0} ({:.0}% used)",
            hours(LengthClass::Short),
            hours(LengthClass::Medium),
            hours(LengthClass::Long),
            100.0
                * (hours(LengthClass::Short)
                    + hours(LengthClass::Medium)
                    + hours(LengthClass::Long))
                / total
        );
        println!(
            "peak per user: long {peak_long} of {}, medium and long {peak_medium} of {medium_max}; \
             rounds a request waited for a cap: {held_by_a_limit:?}",
            classes.long_max_gpus
        );
        // The load reaches both caps, so the test would notice one exceeded.
        assert_eq!(peak_long, classes.long_max_gpus);
        assert_eq!(peak_medium, medium_max);
        assert!(held_by_a_limit.get("long").is_some_and(|&n| n > 0));
        assert!(held_by_a_limit.get("medium").is_some_and(|&n| n > 0));
        assert!(hours(LengthClass::Short) > 0.0);
    }
}
