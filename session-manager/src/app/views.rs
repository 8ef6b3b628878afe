//! Stored records as the API shows them: sessions (with their queue position, history and
//! lifecycle), images, deadlines. Shared by the handler modules, which never call each other.
//! What a session's view needs of the whole site (queue positions, owners and reservations,
//! the site, the usage accounts) is read through [`Reads`], once for all the views of one
//! answer or one dashboard render.

use std::collections::HashMap;
use std::sync::Arc;

use chrono::{DateTime, Utc};
use ongrid_core::api::{FairShareView, GroupShareView, SessionView, UserShareView};
use ongrid_core::holds::{HoldReason, LifecycleView, PlannedHold, SessionDeadlines};
use ongrid_core::image::{ImageProgress, ImageState, ImageView};
use ongrid_core::job::{GridJobView, JobId, JobState, JobView};
use ongrid_core::{SessionId, SessionState, Transition};
use tokio::sync::OnceCell;

use super::caller::CurrentUser;
use super::{ApiError, AppState};
use crate::domain::images::ImageRecord;
use crate::domain::jobs::{self, JobRecord};
use crate::domain::policy::fairshare::Account;
use crate::domain::sessions::holds::{deadlines, view, LifecycleFacts};
use crate::domain::sessions::SessionRecord;
use crate::scheduling::gpu_policy::GpuPolicy;
use crate::site::SiteSnapshot;
use crate::store::FactsScope;

/// The site-wide reads behind session views, each made on first use and then kept: for the
/// views of one answer or one page render, which so read them once rather than once per
/// session.
pub struct Reads<'a> {
    pub state: &'a AppState,
    positions: OnceCell<HashMap<SessionId, u32>>,
    policy: OnceCell<GpuPolicy>,
    site: OnceCell<SiteSnapshot>,
    inventory: OnceCell<Arc<SiteSnapshot>>,
    accounts: OnceCell<Vec<Account>>,
}

impl<'a> Reads<'a> {
    pub fn new(state: &'a AppState) -> Self {
        Self {
            state,
            positions: OnceCell::new(),
            policy: OnceCell::new(),
            site: OnceCell::new(),
            inventory: OnceCell::new(),
            accounts: OnceCell::new(),
        }
    }

    /// The queue positions of the PENDING sessions ([`AppState::queue_positions`]).
    pub async fn positions(&self) -> Result<&HashMap<SessionId, u32>, ApiError> {
        self.positions
            .get_or_try_init(|| self.state.queue_positions())
            .await
    }

    /// The owned GPUs and reservations.
    pub async fn policy(&self) -> Result<&GpuPolicy, ApiError> {
        self.policy
            .get_or_try_init(|| async {
                Ok::<_, ApiError>(
                    GpuPolicy::load(self.state.store.as_ref(), self.state.clock.now()).await?,
                )
            })
            .await
    }

    pub async fn site(&self) -> Result<&SiteSnapshot, ApiError> {
        self.site.get_or_try_init(|| self.state.site()).await
    }

    /// The nodes and their GPUs without what holds them ([`AppState::inventory`]); the whole
    /// site when it was read already.
    pub async fn inventory(&self) -> Result<&SiteSnapshot, ApiError> {
        if let Some(site) = self.site.get() {
            return Ok(site);
        }
        self.inventory
            .get_or_try_init(|| self.state.inventory())
            .await
            .map(|site| &**site)
    }

    /// The users' usage accounts (their accounting groups).
    pub async fn accounts(&self) -> Result<&[Account], ApiError> {
        let accounts = self
            .accounts
            .get_or_try_init(|| async {
                Ok::<_, ApiError>(self.state.store.usage_accounts().await?)
            })
            .await?;
        Ok(accounts)
    }
}

/// A stored session as the API shows it, without its lifecycle.
pub fn session_view(
    session: SessionRecord,
    queue_position: Option<u32>,
    transitions: Vec<Transition>,
) -> SessionView {
    SessionView {
        container: session.id.container_name(),
        id: session.id,
        name: session.name,
        owner: session.owner,
        user_name: session.user_name,
        state: session.state,
        reason: session.reason,
        request: session.request,
        image: session.image,
        node: session.node,
        gpus: session.gpus,
        created_at: session.created_at,
        queue_position,
        transitions,
        lifecycle: None,
    }
}

/// A session as the API answers a change of it: with its history and queue position (read at
/// once), without its lifecycle.
pub async fn changed_session_view(
    state: &AppState,
    session: SessionRecord,
) -> Result<SessionView, ApiError> {
    let (position, transitions) = tokio::try_join!(state.queue_position(&session), async {
        Ok(state.store.transitions(session.id).await?)
    })?;
    Ok(session_view(session, position, transitions))
}

/// The full view of a session as it is now (read again: a round may have moved it since
/// `session` was read): queue position, history and lifecycle.
pub async fn full_session_view(
    reads: &Reads<'_>,
    session: SessionRecord,
) -> Result<SessionView, ApiError> {
    let session = reads
        .state
        .store
        .session(session.id)
        .await?
        .unwrap_or(session);
    full_view_as_read(reads, session).await
}

/// [`full_session_view`] of a session just read from the store.
pub async fn full_view_as_read(
    reads: &Reads<'_>,
    session: SessionRecord,
) -> Result<SessionView, ApiError> {
    let state = reads.state;
    let pending = session.state == SessionState::Pending;
    // Independent reads, sent at once rather than one after the other.
    let (position, transitions, (facts, lifecycle)) = tokio::try_join!(
        async {
            // Read once for all the views, and only when one waits: a session placed since has
            // no position any more.
            Ok::<_, ApiError>(if pending {
                reads.positions().await?.get(&session.id).copied()
            } else {
                None
            })
        },
        async { Ok(state.store.transitions(session.id).await?) },
        async {
            let facts = lifecycle_facts(reads, &session).await?;
            let view = lifecycle_view(reads, &session, facts.as_ref()).await?;
            Ok((facts, view))
        },
    )?;
    let held_back = pending
        .then(|| {
            state
                .scheduler
                .limit_wait(crate::scheduling::limits::Waiting::Session(session.id))
        })
        .flatten();
    let (id, owner) = (session.id, session.owner.clone());
    let mut view = session_view(session, position, transitions);
    view.lifecycle = lifecycle;
    if let Some(limit) = held_back {
        // A PENDING session over a `[limits]` maximum says which one holds it.
        view.reason = format!("waits for a limit: {limit}");
    } else if pending {
        let site = reads.inventory().await?;
        if let Some(why) = out_of_service(site, &view.request) {
            view.reason = format!("{}; {why}", view.reason);
        }
        // A PENDING session is live: its facts were read for its lifecycle above.
        let max_duration = facts
            .as_ref()
            .and_then(|f| f.max_duration(&state.config.lifecycle).to_std().ok())
            .unwrap_or(state.config.lifecycle.max_duration);
        let asker = PolicyAsker {
            owner: &owner,
            session: Some(id),
            job: None,
            max_duration: Some(max_duration),
        };
        if let Some(note) = gpu_policy_note(reads, &view.request, &asker).await? {
            view.reason = format!("{}; {note}", view.reason);
        }
    }
    Ok(view)
}

/// Whose waiting request [`gpu_policy_note`] words.
pub struct PolicyAsker<'a> {
    pub owner: &'a ongrid_core::Dn,
    pub session: Option<ongrid_core::SessionId>,
    pub job: Option<&'a crate::domain::jobs::JobRecord>,
    pub max_duration: Option<std::time::Duration>,
}

/// For a waiting session or job: why GPUs that would fit it are owned or reserved for others,
/// or which reservation it waits for; `None` when nothing of that holds it.
pub async fn gpu_policy_note(
    reads: &Reads<'_>,
    request: &ongrid_core::GpuRequest,
    asker: &PolicyAsker<'_>,
) -> Result<Option<String>, ApiError> {
    let state = reads.state;
    // After the load: the policy counts from its own `now` on ([`GpuPolicy::load`]).
    let policy = reads.policy().await?;
    let now = state.clock.now();
    if policy.is_idle(now) {
        return Ok(None);
    }
    let site = reads.site().await?;
    let accounts = reads.accounts().await?;
    let group = crate::scheduling::gpu_policy::group_of(accounts, asker.owner);
    let reservation = match (asker.session, asker.job) {
        (Some(id), _) => policy.session_reservation(id, now),
        (None, Some(job)) => policy.job_reservation(job, now),
        (None, None) => None,
    };
    let waiter = crate::domain::policy::reservations::Waiter {
        group: &group,
        session: asker.session.is_some(),
        reservation,
        max_duration: asker.max_duration,
    };
    Ok(policy.note(
        site,
        request,
        &waiter,
        state.config.sessions_on_owned_gpus,
        now,
    ))
}

/// For a PENDING session: the GPUs that would fit `request` but are out of service (drained,
/// unhealthy, or on a drained or offline node), in words, when there are any: `waits: GPUs that
/// fit it are out of service (2 fit in all): GPU-... on node1 drained ... by alice: fan noise`.
pub fn out_of_service(
    site: &crate::site::SiteSnapshot,
    request: &ongrid_core::GpuRequest,
) -> Option<String> {
    let fits = |gpu: &crate::store::GpuRecord| crate::site::fits(gpu, request);
    let mut out = Vec::new();
    for (_, why) in site.out_of_service().filter(|(gpu, _)| fits(gpu)) {
        if !out.contains(&why) {
            out.push(why);
        }
    }
    if out.is_empty() {
        return None;
    }
    let fitting = site
        .nodes
        .iter()
        .flat_map(|node| node.gpus.iter())
        .filter(|gpu| fits(gpu))
        .count();
    let shown = out.len().min(3);
    let more = if out.len() > shown {
        format!(" (and {} more)", out.len() - shown)
    } else {
        String::new()
    };
    Some(format!(
        "waits: GPUs that fit it are out of service ({fitting} fit in all): {}{more}",
        out[..shown].join("; ")
    ))
}

/// The lifecycle facts of a session's view: for live and HELD sessions.
async fn lifecycle_facts(
    reads: &Reads<'_>,
    session: &SessionRecord,
) -> Result<Option<LifecycleFacts>, ApiError> {
    if !(session.state.is_live() || session.state == SessionState::Held) {
        return Ok(None);
    }
    let facts = reads
        .state
        .store
        .lifecycle_facts(FactsScope::Session(session.id))
        .await?;
    Ok(facts.into_iter().next())
}

/// The lifecycle part of a session's view, from its `facts` ([`lifecycle_facts`]).
async fn lifecycle_view(
    reads: &Reads<'_>,
    session: &SessionRecord,
    facts: Option<&LifecycleFacts>,
) -> Result<Option<LifecycleView>, ApiError> {
    let state = reads.state;
    let Some(facts) = facts else {
        return Ok(None);
    };
    let mut view = view(facts, &state.config.lifecycle, state.clock.now());
    sooner(&mut view.deadlines, reservation_hold(reads, session).await?);
    Ok(Some(view))
}

/// The hold planned for a reservation of another group on the GPUs `session` runs on, if any
/// ([`crate::scheduling::gpu_policy::GpuPolicy::session_hold`]): shown and warned about like the hold
/// policy's own (an admin's kind of hold: the site's admins reserved the GPUs).
async fn reservation_hold(
    reads: &Reads<'_>,
    session: &SessionRecord,
) -> Result<Option<PlannedHold>, ApiError> {
    if !session.state.holds_gpus() {
        return Ok(None);
    }
    let state = reads.state;
    let now = state.clock.now();
    let policy = reads.policy().await?;
    if policy.reservations.iter().all(|r| r.to <= now) {
        return Ok(None);
    }
    let site = reads.site().await?;
    let accounts = reads.accounts().await?;
    let group = crate::scheduling::gpu_policy::group_of(accounts, &session.owner);
    let notice = state.config.lifecycle.warn_before;
    Ok(policy
        .session_hold(site, session, &group, notice, now)
        .map(|(at, _)| PlannedHold {
            at,
            reason: HoldReason::Admin,
        }))
}

/// `hold` as the next hold of `deadlines` when it comes first.
fn sooner(deadlines: &mut SessionDeadlines, hold: Option<PlannedHold>) {
    if let Some(hold) = hold {
        if deadlines
            .next_hold
            .as_ref()
            .is_none_or(|next| hold.at < next.at)
        {
            deadlines.next_hold = Some(hold);
        }
    }
}

/// The session's deadlines now, for the gateway's banner and warnings.
pub async fn deadlines_view(
    state: &AppState,
    session: &SessionRecord,
) -> Result<SessionDeadlines, ApiError> {
    let facts = state
        .store
        .lifecycle_facts(FactsScope::Session(session.id))
        .await?;
    let facts = facts
        .first()
        .ok_or_else(|| ApiError::not_found(format!("no session with id {}", session.id)))?;
    let mut deadlines = deadlines(facts, &state.config.lifecycle, state.clock.now());
    sooner(
        &mut deadlines,
        reservation_hold(&Reads::new(state), session).await?,
    );
    Ok(deadlines)
}

/// A stored image as the API shows it.
pub fn image_view(image: ImageRecord) -> ImageView {
    let progress = (image.state == ImageState::Building).then_some(ImageProgress {
        bytes_done: image.bytes_done,
        bytes_total: image.bytes_total,
    });
    ImageView {
        id: image.id,
        name: image.reference.name().to_owned(),
        version: image.reference.version().to_owned(),
        reference: image.reference.to_string(),
        owner: image.owner,
        user_name: image.user_name,
        state: image.state,
        reason: image.reason,
        digest: image.digest,
        size: image.size,
        sif_path: image.sif_path,
        docker_image: image.docker_image,
        node: image.node,
        session: image.session_name,
        session_id: image.session_id,
        base_image: image.base_image,
        compression: image.compression,
        created_at: image.created_at,
        finished_at: image.finished_at,
        superseded_at: image.superseded_at,
        progress,
        shared: image.shared_at.is_some(),
    }
}

/// The job as it is now: its place in the queue and why it waits, with what holds it (a
/// `[limits]` maximum, owned GPUs or reservations).
pub async fn job_view_now(state: &AppState, job: JobRecord) -> Result<JobView, ApiError> {
    let active = state.store.planning_jobs().await?;
    let note = if job.state() == JobState::Queued && job.grid.is_none() {
        let asker = PolicyAsker {
            owner: &job.owner,
            session: None,
            job: Some(&job),
            max_duration: job.max_duration.map(|d| d.as_duration()),
        };
        let reads = Reads::new(state);
        gpu_policy_note(&reads, &job.spec.gpus, &asker).await?
    } else {
        None
    };
    let held_back = (job.state() == JobState::Queued && job.grid.is_none())
        .then(|| {
            state
                .scheduler
                .limit_wait(crate::scheduling::limits::Waiting::Job(job.id))
        })
        .flatten();
    let position = job_queue_position(state, &job, &active).await?;
    let positions = position
        .map(|p| HashMap::from([(job.id, p)]))
        .unwrap_or_default();
    let mut view = job_view(job, &active, &positions, state.clock.now());
    if let (Some(limit), Some(waiting)) = (held_back, view.waiting.as_mut()) {
        // A QUEUED job over a `[limits]` maximum says which one holds it.
        *waiting = format!("waits for a limit: {limit}");
    } else if let (Some(note), Some(waiting)) = (note, view.waiting.as_mut()) {
        // Owned GPUs and reservations that keep it off GPUs that would fit it.
        *waiting = format!("{waiting}; {note}");
    }
    Ok(view)
}

/// `job`'s 1-based place among the QUEUED jobs of `active`, as [`job_queue_positions`] would
/// give it, without ordering the others.
async fn job_queue_position(
    state: &AppState,
    job: &JobRecord,
    active: &[Arc<JobRecord>],
) -> Result<Option<u32>, ApiError> {
    if job.state() != JobState::Queued || job.grid.is_some() {
        return Ok(None);
    }
    let accounts = match &state.config.fair_share {
        Some(_) => state.store.usage_accounts().await?,
        None => Vec::new(),
    };
    Ok(crate::scheduling::fair_share::serve_place(
        job.id,
        queued_locally(active).map(|j| (&j.owner, j.queued_at(), j.id)),
        &accounts,
        state.config.fair_share.as_ref(),
    ))
}

/// The jobs of `active` that wait in the site's queue: QUEUED, not for a grid target.
fn queued_locally(active: &[Arc<JobRecord>]) -> impl Iterator<Item = &JobRecord> {
    active
        .iter()
        .map(|j| &**j)
        .filter(|j| j.state() == JobState::Queued && j.grid.is_none())
}

/// 1-based queue positions of the QUEUED jobs among `active`, in the order the scheduler
/// serves them (fair-share priority, then time queued). Jobs of grid targets wait in their
/// engines' queues, not in this one: they have no position.
async fn job_queue_positions(
    state: &AppState,
    active: &[Arc<JobRecord>],
) -> Result<HashMap<JobId, u32>, ApiError> {
    let waiting: Vec<_> = queued_locally(active)
        .map(|j| (j.owner.clone(), j.queued_at(), j.id))
        .collect();
    let accounts = match &state.config.fair_share {
        Some(_) => state.store.usage_accounts().await?,
        None => Vec::new(),
    };
    let order = crate::scheduling::fair_share::serve_order(
        &waiting,
        &accounts,
        state.config.fair_share.as_ref(),
    );
    Ok(order.into_iter().zip(1u32..).collect())
}

/// The views of `records`, with their places in the queue (the site's active jobs read once).
pub async fn job_views(
    state: &AppState,
    records: Vec<JobRecord>,
) -> Result<Vec<JobView>, ApiError> {
    let active = state.store.planning_jobs().await?;
    let positions = job_queue_positions(state, &active).await?;
    let now = state.clock.now();
    Ok(records
        .into_iter()
        .map(|job| job_view(job, &active, &positions, now))
        .collect())
}

/// A job as it was when it was removed: in no queue.
pub async fn removed_job_view(state: &AppState, job: JobRecord) -> Result<JobView, ApiError> {
    let active = state.store.planning_jobs().await?;
    Ok(job_view(job, &active, &HashMap::new(), state.clock.now()))
}

/// A job as the API shows it, with its place among the site's QUEUED jobs (`positions`) and
/// why it waits (from `active`: the site's jobs QUEUED or holding GPUs).
pub fn job_view(
    job: JobRecord,
    active: &[Arc<JobRecord>],
    positions: &HashMap<JobId, u32>,
    now: DateTime<Utc>,
) -> JobView {
    let position = positions.get(&job.id).copied();
    let waiting = jobs::waiting_reason(&job, active, now);
    JobView {
        id: job.id,
        owner: job.owner.clone(),
        user_name: job.user_name.clone(),
        state: job.state(),
        reason: job.lifecycle.last().reason.to_string(),
        max_duration: job.max_duration,
        image_digest: Some(job.image.digest.clone()),
        node: job.node.clone(),
        gpus: job.gpus.clone(),
        chain: job.chain,
        previous_job: job.previous_job,
        next_job: job.next_job,
        exit_code: job.exit_code,
        queued_at: job.queued_at(),
        started_at: job.lifecycle.started_at(),
        finished_at: job.finished_at(),
        queue_position: position,
        waiting,
        transitions: job.lifecycle.history().to_vec(),
        grid: job.grid.as_ref().map(|g| GridJobView {
            target: g.target,
            account: g.account.to_string(),
            engine_id: g.engine_id.as_ref().map(ToString::to_string),
            engine_state: g.engine_state.clone(),
            polled_at: g.polled_at,
        }),
        output_complete: job.log_complete,
        spec: job.spec,
    }
}

/// Each accounting group's share, decayed usage and fair-share factor, like Slurm's `sshare`;
/// admins see every user's usage, others the groups and their own line.
pub async fn fair_share_view(
    state: &AppState,
    caller: &CurrentUser,
) -> Result<FairShareView, ApiError> {
    let Some(config) = &state.config.fair_share else {
        return Ok(FairShareView {
            enabled: false,
            half_life_secs: 0,
            groups: Vec::new(),
        });
    };
    let accounts = state.store.usage_accounts().await?;
    let standings = crate::scheduling::fair_share::current(&accounts, config, state.clock.now());
    let groups = standings
        .into_iter()
        .map(|standing| GroupShareView {
            group: standing.group.to_string(),
            share: standing.share,
            share_fraction: standing.share_fraction,
            usage: standing.usage,
            usage_fraction: standing.usage_fraction,
            factor: standing.factor,
            users: standing
                .users
                .into_iter()
                .filter(|(dn, _)| caller.admin || *dn == caller.user.dn)
                .map(|(dn, usage)| UserShareView { dn, usage })
                .collect(),
        })
        .collect();
    Ok(FairShareView {
        enabled: true,
        half_life_secs: config.half_life.as_secs(),
        groups,
    })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use chrono::TimeZone;
    use ongrid_core::gpu::Drain;
    use ongrid_core::{GpuHealth, GpuRequest, MemorySize};

    use super::*;
    use crate::store::fixtures::{self, gpu};
    use crate::store::{GpuRecord, NodeRecord};

    /// A PENDING answer names the out-of-service GPUs that fit the request: a drained node once
    /// for all its GPUs, an offline node, a drained GPU, an unhealthy one, the first three
    /// shown and the rest counted; GPUs that do not fit are neither named nor counted.
    #[test]
    fn out_of_service_names_the_fitting_gpus_once_each_reason() {
        let now = Utc.with_ymd_and_hms(2026, 11, 25, 10, 0, 0).unwrap();
        let drain = |by: &str, reason: &str| Drain {
            reason: reason.to_owned(),
            since: now,
            by: by.to_owned(),
        };
        let record = fixtures::gpu_record;
        let node = |name: &str, last_seen, drain: Option<Drain>, gpus: Vec<GpuRecord>| NodeRecord {
            drain,
            ..fixtures::node_record(name, last_seen, gpus)
        };
        let drained_gpu = GpuRecord {
            drain: Some(drain("bob", "fan noise")),
            ..record("node3", 4)
        };
        let failed = |n: u8| GpuRecord {
            info: ongrid_core::GpuInfo {
                health: GpuHealth::Failed("XID 79".to_owned()),
                ..gpu(n)
            },
            ..record("node3", n)
        };
        let small_and_failed = GpuRecord {
            info: ongrid_core::GpuInfo {
                memory: MemorySize::from_mib(20_480),
                ..failed(6).info
            },
            ..failed(6)
        };
        let nodes = vec![
            node(
                "node1",
                now,
                Some(drain("alice", "rack work")),
                vec![record("node1", 1), record("node1", 2)],
            ),
            node(
                "node2",
                now - chrono::TimeDelta::hours(1),
                None,
                vec![record("node2", 3)],
            ),
            node(
                "node3",
                now,
                None,
                vec![drained_gpu, failed(5), small_and_failed],
            ),
            node("node4", now, None, vec![record("node4", 7)]),
        ];
        let site = SiteSnapshot::new(now, nodes, Vec::new(), Duration::from_secs(30));
        let request = GpuRequest {
            min_memory: Some(MemorySize::from_mib(40_960)),
            ..GpuRequest::default()
        };
        assert_eq!(
            out_of_service(&site, &request).as_deref(),
            Some(
                "waits: GPUs that fit it are out of service (6 fit in all): \
                 node node1 drained 2026-11-25 10:00 UTC by alice: rack work; \
                 node node2 is offline; \
                 GPU-11111111-2222-3333-4444-555555555504 on node3 drained 2026-11-25 10:00 UTC \
                 by bob: fan noise (and 1 more)"
            )
        );
        // Only the small GPU, out of service, fits: named, and the only one counted.
        let small = GpuRequest {
            min_memory: Some(MemorySize::from_mib(10_240)),
            ..GpuRequest::default()
        };
        assert!(out_of_service(&site, &small)
            .unwrap()
            .starts_with("waits: GPUs that fit it are out of service (7 fit in all): "));
        // A site with every fitting GPU in service: nothing to say.
        let in_service = SiteSnapshot::new(
            now,
            vec![node("node4", now, None, vec![record("node4", 7)])],
            Vec::new(),
            Duration::from_secs(30),
        );
        assert_eq!(out_of_service(&in_service, &request), None);
    }
}
