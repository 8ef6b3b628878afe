//! A snapshot of the site as the scheduler and the API see it: registered nodes with their GPUs,
//! which of them are online, and which sessions and batch jobs hold which GPU.
//!
//! A node is online when its agent synced within `node_timeout`. Drained nodes and GPUs
//! (`devctl admin node drain`, `devctl admin gpu drain`) are marked so for the scheduler, which
//! places nothing new on them. A GPU's `used` count is the
//! number of sessions in a GPU-holding state (STARTING, WAITING, CONNECTED, IDLE) and of jobs
//! holding GPUs (RUNNING, MUSTHALT, HALTING) assigned to it.
//! A GPU set back to `exclusive` or `shared:N` from `mig:...` takes nothing until its agent
//! reports MIG mode off ([`leaving_mig`]).
//! A session that asked for a whole GPU fills it, whatever its mode: when an admin turns an
//! occupied exclusive GPU into a shared one, nobody joins that session on it until it leaves.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};
use ongrid_core::job::JobState;
use ongrid_core::{GpuId, GpuUuid, SessionState, Sharing};
use ongrid_scheduler::{GpuSlot, NodeState, PendingSession, QueuedJob, RunningJob, SiteState};

use crate::domain::jobs::JobRecord;
use crate::domain::sessions::SessionRecord;
use crate::store::{GpuRecord, NodeRecord, PlanningNodes, SessionFilter, Store, StoreResult};

/// The GPU-holding states, for queries.
pub fn holding_states() -> Vec<SessionState> {
    SessionState::ALL
        .into_iter()
        .filter(|s| s.holds_gpus())
        .collect()
}

#[derive(Debug, Clone)]
pub struct SiteSnapshot {
    pub now: DateTime<Utc>,
    pub nodes: Vec<NodeRecord>,
    /// Sessions holding GPUs now.
    pub holding: Vec<Arc<SessionRecord>>,
    /// Jobs QUEUED or holding GPUs now (see [`SiteSnapshot::with_jobs`]).
    pub jobs: Vec<Arc<JobRecord>>,
    /// A node seen at or after this is online ([`online_since`]).
    online_since: DateTime<Utc>,
    /// What holds each GPU held by sessions or jobs.
    used: HashMap<GpuUuid, Use>,
    /// [`Self::satisfiability_state`], made once, with the answers it gave: a snapshot shared by
    /// a burst of requests ([`crate::app::AppState::inventory`]) answers each one's
    /// [`Self::never_meets`]; the snapshots of one inventory version share it
    /// ([`Satisfiability`]).
    satisfiable: OnceLock<Arc<Satisfiable>>,
    /// [`Self::out_of_service`], found once from `nodes` (which nothing changes once the
    /// snapshot is made; the jobs do not count): every PENDING answer looks at it, and most
    /// sites have none, where each answer walked every GPU.
    out_of_service: OnceLock<Vec<(usize, usize, String)>>,
}

/// What holds a GPU: how many sessions and jobs, and whether one of them asked for a whole GPU.
/// One map, not a count and a set: a round counts every holder of the site's GPUs, then looks
/// up every GPU once.
#[derive(Debug, Clone, Copy)]
struct Use {
    count: u32,
    whole: bool,
}

impl Use {
    /// The whole GPUs among `gpus` (a session's or a job's; MIG devices are not counted here)
    /// held by one more holder, which asked for a whole GPU when `whole`.
    fn add(used: &mut HashMap<GpuUuid, Use>, gpus: &[GpuId], whole: bool) {
        for gpu in gpus {
            let GpuId::Gpu(uuid) = gpu else {
                continue;
            };
            match used.get_mut(uuid) {
                Some(by) => {
                    by.count += 1;
                    by.whole |= whole;
                }
                None => {
                    used.insert(uuid.clone(), Use { count: 1, whole });
                }
            }
        }
    }
}

/// The nodes as "could this request ever run here" sees them
/// ([`SiteSnapshot::satisfiability_state`]), with the answers given so far to requests for whole
/// or shared GPUs: the answer depends on the nodes and the request alone, so a burst of
/// requests of a few shapes walks the site's thousands of GPUs once per shape, not once each
/// (1.5% of the manager's CPU in the fleet bench, `tests/examples/fleet.rs`, where every
/// create and submit asked).
#[derive(Debug)]
struct Satisfiable {
    state: SiteState,
    answers: std::sync::Mutex<HashMap<ongrid_core::GpuRequest, Option<String>>>,
}

/// How many requests' answers one [`Satisfiable`] keeps: requests come in a few shapes, but a
/// client may send any memory or capability; past this, answers are worked out each time.
const KEPT_ANSWERS: usize = 256;

impl Satisfiable {
    fn new(state: SiteState) -> Self {
        Self {
            state,
            answers: Default::default(),
        }
    }

    /// Why no GPU could ever meet `request` (not a MIG device), as answered before when it was.
    fn whole_or_shared(&self, request: &ongrid_core::GpuRequest) -> Option<String> {
        let answers = || {
            self.answers
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
        };
        if let Some(answer) = answers().get(request) {
            return answer.clone();
        }
        let answer = ongrid_scheduler::check_satisfiable(&self.state, request)
            .err()
            .map(|no| no.to_string());
        let mut answers = answers();
        if answers.len() < KEPT_ANSWERS {
            answers.insert(*request, answer.clone());
        }
        answer
    }
}

/// The [`SiteSnapshot::satisfiability_state`] of the nodes at the last inventory version read,
/// shared by the inventory snapshots read at that version ([`SiteSnapshot::load_inventory`]):
/// it depends on the nodes and GPUs alone, which move the version whenever they change, so
/// the thousands of GPUs are not made into the scheduler's state again for each request.
#[derive(Debug, Default)]
pub struct Satisfiability(std::sync::Mutex<Option<(i64, Arc<Satisfiable>)>>);

impl Satisfiability {
    /// The state (and its answers) kept for `version`, else `site`'s, kept unless a newer
    /// version's is.
    fn of(&self, version: i64, site: &SiteSnapshot) -> Arc<Satisfiable> {
        let kept = || {
            self.0
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
        };
        if let Some((at, state)) = kept().as_ref() {
            if *at == version {
                return Arc::clone(state);
            }
        }
        let state = Arc::new(Satisfiable::new(site.satisfiability_state()));
        let mut kept = kept();
        if kept.as_ref().is_none_or(|(at, _)| *at < version) {
            *kept = Some((version, Arc::clone(&state)));
        }
        state
    }
}

/// The jobs of `jobs` the site's GPUs run: those of grid targets run elsewhere, their engines
/// schedule them.
fn on_site(mut jobs: Vec<Arc<JobRecord>>) -> Vec<Arc<JobRecord>> {
    jobs.retain(|job| job.grid.is_none());
    jobs
}

impl SiteSnapshot {
    /// The site as stored now, for what people see of it.
    pub async fn load(
        store: &dyn Store,
        now: DateTime<Utc>,
        node_timeout: Duration,
    ) -> StoreResult<Self> {
        let nodes = store.nodes().await?;
        let holding = store
            .sessions(SessionFilter::States(holding_states()))
            .await?
            .into_iter()
            .map(Arc::new)
            .collect();
        Self::with_active_jobs(store, Self::new(now, nodes, holding, node_timeout)).await
    }

    /// The site for a scheduling round, as [`Self::load`] but from the store's planning reads:
    /// its nodes and GPUs ([`Store::planning_nodes`], read again only when the inventory changed,
    /// a node's last sync only when it is older than `node_timeout`) and the
    /// sessions holding them ([`Store::planning_sessions`], only those changed read again); with
    /// the PENDING sessions of the same read, in the order [`Store::sessions`] gives them.
    pub async fn load_for_planning(
        store: &dyn Store,
        now: DateTime<Utc>,
        node_timeout: Duration,
    ) -> StoreResult<(Self, Vec<SessionRecord>)> {
        // The three reads at once: a round waits for the longest, not for their sum. Their
        // order does not matter: only the rounds, one at a time, give GPUs to sessions and jobs,
        // so a holder read in one is never missing from the GPUs read in another; a holder that
        // lets its GPUs go between them only leaves them taken until the next round.
        let (nodes, sessions, jobs) = tokio::try_join!(
            store.planning_nodes(online_since(now, node_timeout)),
            store.planning_sessions(),
            store.planning_jobs(),
        )?;
        let (holding, pending): (Vec<_>, Vec<_>) = sessions
            .into_iter()
            .partition(|session| session.state.holds_gpus());
        // Few wait, and the scheduler's phases take them as records.
        let pending = pending.into_iter().map(Arc::unwrap_or_clone).collect();
        let site = Self::new(now, nodes.nodes, holding, node_timeout).with_jobs(on_site(jobs));
        Ok((site, pending))
    }

    /// `site` with the jobs QUEUED or holding GPUs as stored now.
    async fn with_active_jobs(store: &dyn Store, site: Self) -> StoreResult<Self> {
        Ok(site.with_jobs(on_site(store.planning_jobs().await?)))
    }

    /// The registered nodes and their GPUs as of `now`, without the sessions and jobs that hold
    /// them (every GPU shows as free): for what depends only on which GPUs the site has, such as
    /// whether a request could ever be met ([`Self::never_meets`]), a limit's share of the site,
    /// or which GPUs that fit a request are out of service. One read of the nodes instead of
    /// the whole site, for answers that every request waits on.
    /// Its [`Self::never_meets`] answers from the state `kept` has for the nodes' inventory
    /// version.
    pub async fn load_inventory(
        store: &dyn Store,
        now: DateTime<Utc>,
        node_timeout: Duration,
        kept: &Satisfiability,
    ) -> StoreResult<Self> {
        let PlanningNodes { version, nodes } = store
            .planning_nodes(online_since(now, node_timeout))
            .await?;
        let site = Self::new(now, nodes, Vec::new(), node_timeout);
        let _ = site.satisfiable.set(kept.of(version, &site));
        Ok(site)
    }

    pub fn new(
        now: DateTime<Utc>,
        nodes: Vec<NodeRecord>,
        holding: Vec<Arc<SessionRecord>>,
        node_timeout: Duration,
    ) -> Self {
        let mut used = HashMap::new();
        for session in &holding {
            let whole = session.request.sharing == Sharing::Exclusive;
            Use::add(&mut used, &session.gpus, whole);
        }
        Self {
            now,
            nodes,
            holding,
            online_since: online_since(now, node_timeout),
            used,
            jobs: Vec::new(),
            satisfiable: OnceLock::new(),
            out_of_service: OnceLock::new(),
        }
    }

    /// Adds the active jobs: those holding GPUs count in their GPUs' `used` like sessions.
    pub fn with_jobs(mut self, jobs: Vec<Arc<JobRecord>>) -> Self {
        for job in jobs.iter().filter(|j| j.state().holds_gpus()) {
            let whole = job.spec.gpus.sharing == Sharing::Exclusive;
            Use::add(&mut self.used, &job.gpus, whole);
        }
        self.jobs = jobs;
        self.satisfiable = OnceLock::new();
        self
    }

    pub fn is_online(&self, node: &NodeRecord) -> bool {
        node.last_seen >= self.online_since
    }

    /// How many sessions and jobs hold this GPU.
    pub fn used(&self, uuid: &GpuUuid) -> u32 {
        self.used.get(uuid).map_or(0, |by| by.count)
    }

    /// Free places on the GPU: none when it is unhealthy or drained, its node offline or
    /// drained, or a session that asked for a whole GPU holds it.
    pub fn free(&self, node: &NodeRecord, gpu: &GpuRecord) -> u32 {
        if !gpu.info.health.is_healthy()
            || !self.is_online(node)
            || gpu.drain.is_some()
            || node.drain.is_some()
            || leaving_mig(gpu)
        {
            return 0;
        }
        gpu.mode.capacity().saturating_sub(self.occupancy(gpu))
    }

    /// The `used` count the scheduler sees: a GPU held by a session that asked for a whole GPU
    /// counts as full.
    fn occupancy(&self, gpu: &GpuRecord) -> u32 {
        let Some(by) = self.used.get(&gpu.info.uuid) else {
            return 0;
        };
        if by.whole {
            by.count.max(gpu.mode.capacity())
        } else {
            by.count
        }
    }

    /// The GPUs out of service (drained, unhealthy, leaving MIG mode, or on a drained or
    /// offline node), in the order of the nodes and their GPUs, each with why.
    pub fn out_of_service(&self) -> impl Iterator<Item = (&GpuRecord, &str)> {
        self.out_of_service
            .get_or_init(|| {
                let mut out = Vec::new();
                for (n, node) in self.nodes.iter().enumerate() {
                    for (g, gpu) in node.gpus.iter().enumerate() {
                        if let Some(why) = self.why_out_of_service(node, gpu) {
                            out.push((n, g, why));
                        }
                    }
                }
                out
            })
            .iter()
            .map(|(n, g, why)| (&self.nodes[*n].gpus[*g], why.as_str()))
    }

    /// Why `gpu` of `node` is out of service, in words (`node node1 is offline`); `None` when
    /// it is in service.
    fn why_out_of_service(&self, node: &NodeRecord, gpu: &GpuRecord) -> Option<String> {
        Some(if let Some(drain) = &node.drain {
            format!("node {} {}", node.name, drain.sentence())
        } else if !self.is_online(node) {
            format!("node {} is offline", node.name)
        } else if let Some(drain) = &gpu.drain {
            format!("{} on {} {}", gpu.info.uuid, node.name, drain.sentence())
        } else if let Some(problem) = gpu.info.health.problem() {
            format!("{} on {} is {problem}", gpu.info.uuid, node.name)
        } else if leaving_mig(gpu) {
            format!(
                "{} on {} is leaving MIG mode, once nothing uses its MIG devices",
                gpu.info.uuid, node.name
            )
        } else {
            return None;
        })
    }

    /// The sessions holding GPUs or MIG devices.
    pub fn holding_sessions(&self) -> impl Iterator<Item = &SessionRecord> {
        self.holding.iter().map(|s| &**s)
    }

    /// Sessions holding this GPU or one of its MIG devices.
    pub fn sessions_on<'a>(&'a self, uuid: &'a GpuUuid) -> impl Iterator<Item = &'a SessionRecord> {
        self.holding
            .iter()
            .map(|s| &**s)
            .filter(move |s| self.on_gpu(uuid, &s.gpus))
    }

    /// Whether `gpus` (a session's or a job's) include this GPU or one of its MIG devices.
    pub fn on_gpu(&self, uuid: &GpuUuid, gpus: &[GpuId]) -> bool {
        gpus.iter().any(|g| match g {
            GpuId::Gpu(u) => u == uuid,
            GpuId::Mig(m) => self.nodes.iter().flat_map(|n| n.gpus.iter()).any(|gpu| {
                &gpu.info.uuid == uuid && gpu.info.mig_devices.iter().any(|d| &d.uuid == m)
            }),
        })
    }

    /// The MIG devices agents reported for GPUs in `mig` mode whose devices are their layout's,
    /// each used when a session or a job holding GPUs has it, and naming the job that holds
    /// it.
    pub fn mig_slots(&self) -> Vec<ongrid_scheduler::MigSlot> {
        self.mig_devices(true)
    }

    /// Every MIG device agents reported for GPUs in `mig` mode, also those of a layout being
    /// replaced (for views: who holds what).
    pub fn reported_mig_slots(&self) -> Vec<ongrid_scheduler::MigSlot> {
        self.mig_devices(false)
    }

    fn mig_devices(&self, only_made: bool) -> Vec<ongrid_scheduler::MigSlot> {
        let mig = |gpu: &GpuId| match gpu {
            GpuId::Mig(mig) => Some(mig.clone()),
            GpuId::Gpu(_) => None,
        };
        let held: HashSet<ongrid_core::MigUuid> = self
            .holding
            .iter()
            .flat_map(|s| s.gpus.iter().filter_map(mig))
            .collect();
        let held_by_job: HashMap<ongrid_core::MigUuid, ongrid_core::job::JobId> = self
            .jobs
            .iter()
            .filter(|j| j.state().holds_gpus())
            .flat_map(|j| j.gpus.iter().filter_map(mig).map(move |m| (m, j.id)))
            .collect();
        self.nodes
            .iter()
            .flat_map(|node| node.gpus.iter().map(move |gpu| (node, gpu)))
            // A GPU whose devices are not (yet) its layout's waits to drain for the change:
            // its old devices are not offered any more.
            .filter(|(_, gpu)| {
                gpu.mode
                    .mig_layout()
                    .is_some_and(|layout| !only_made || layout.is_made_by(&gpu.info.mig_devices))
            })
            .flat_map(|(node, gpu)| {
                gpu.info
                    .mig_devices
                    .iter()
                    .map(|device| ongrid_scheduler::MigSlot {
                        node: node.name.clone(),
                        uuid: device.uuid.clone(),
                        parent: gpu.info.uuid.clone(),
                        profile: device.profile,
                        capability: gpu.info.capability,
                        memory: device.memory,
                        used: held.contains(&device.uuid) || held_by_job.contains_key(&device.uuid),
                        job: held_by_job.get(&device.uuid).copied(),
                    })
            })
            .collect()
    }

    /// The scheduler's view, with `pending` as the sessions' queue and the snapshot's jobs.
    pub fn scheduler_state(&self, pending: Vec<PendingSession>) -> SiteState {
        SiteState {
            nodes: self
                .nodes
                .iter()
                .map(|node| self.node_state(node, self.is_online(node)))
                .collect(),
            pending,
            queued_jobs: self
                .jobs
                .iter()
                .filter(|j| j.state() == JobState::Queued)
                .map(|j| queued_job(j))
                .collect(),
            running_jobs: self.jobs.iter().filter_map(|j| running_job(j)).collect(),
            // Owned GPUs and reservations: set by the scheduling loop (`gpu_policy.rs`).
            policy: Default::default(),
        }
    }

    /// The view for "could this request ever run here": every registered node counts as online,
    /// since one that is down right now may well come back.
    pub fn satisfiability_state(&self) -> SiteState {
        SiteState {
            nodes: self
                .nodes
                .iter()
                .map(|node| self.node_state(node, true))
                .collect(),
            pending: Vec::new(),
            queued_jobs: Vec::new(),
            running_jobs: Vec::new(),
            policy: Default::default(),
        }
    }

    /// Why no GPU of the site as registered could ever meet `request` (a whole GPU, a share or
    /// a MIG device), in words naming the requirement to relax; `None` when some GPU could.
    /// Sessions and local jobs are refused with it at once, instead of waiting for ever.
    pub fn never_meets(&self, request: &ongrid_core::GpuRequest) -> Option<String> {
        let site = self
            .satisfiable
            .get_or_init(|| Arc::new(Satisfiable::new(self.satisfiability_state())));
        match request.sharing.mig() {
            Some(_) => {
                ongrid_scheduler::check_mig_satisfiable(&site.state, &self.mig_slots(), request)
                    .err()
                    .map(|no| no.to_string())
            }
            None => site.whole_or_shared(request),
        }
    }

    fn node_state(&self, node: &NodeRecord, online: bool) -> NodeState {
        NodeState {
            name: node.name.clone(),
            online,
            drained: node.drain.is_some(),
            gpus: node
                .gpus
                .iter()
                .map(|gpu| GpuSlot {
                    uuid: gpu.info.uuid.clone(),
                    capability: gpu.info.capability,
                    memory: gpu.info.memory,
                    mode: gpu.mode,
                    healthy: gpu.info.health.is_healthy(),
                    drained: gpu.drain.is_some() || leaving_mig(gpu),
                    used: self.occupancy(gpu),
                })
                .collect(),
        }
    }
}

/// The cutoff of [`SiteSnapshot::is_online`] at `now`: a node seen at or after it is online, so
/// its last sync need not be read exactly ([`Store::planning_nodes`]).
pub fn online_since(now: DateTime<Utc>, node_timeout: Duration) -> DateTime<Utc> {
    TimeDelta::from_std(node_timeout)
        .ok()
        .and_then(|timeout| now.checked_sub_signed(timeout))
        .unwrap_or(DateTime::<Utc>::MIN_UTC)
}

/// Whether the GPU's mode is `exclusive` or `shared:N` while its agent still reports MIG mode
/// on: it is not a whole GPU until the agent has left MIG mode (once nothing uses it), so
/// nothing is placed on it meanwhile.
pub fn leaving_mig(gpu: &GpuRecord) -> bool {
    gpu.info.mig_enabled && gpu.mode.mig_layout().is_none()
}

/// Whether `gpu` could ever serve `request`, in service or not: a MIG request wants a GPU in
/// MIG mode with a device of its profile or larger, any other the GPU's capability, memory and
/// mode.
pub fn fits(gpu: &GpuRecord, request: &ongrid_core::GpuRequest) -> bool {
    match request.sharing.mig() {
        Some(wanted) => {
            gpu.mode.mig_layout().is_some()
                && gpu
                    .info
                    .mig_devices
                    .iter()
                    .any(|device| device.profile.covers(wanted))
        }
        None => request.fits(gpu.info.capability, gpu.info.memory, gpu.mode),
    }
}

/// A PENDING session as the scheduler takes it.
pub fn pending_session(session: &SessionRecord) -> PendingSession {
    PendingSession {
        id: session.id,
        request: session.request,
        queued_at: session.queued_at,
        preferred_node: session.preferred_node.clone(),
        pinned_node: None,
        previous_gpus: Vec::new(),
        awaiting_halt: None,
        // Set by the scheduling loop from the owners' fair share.
        priority: Default::default(),
    }
}

/// A QUEUED job as the scheduler takes it.
pub fn queued_job(job: &JobRecord) -> QueuedJob {
    QueuedJob {
        id: job.id,
        owner: job.user_name.clone(),
        request: job.spec.gpus,
        queued_at: job.queued_at(),
        not_before: job.spec.not_before,
        not_after: job.spec.not_after,
        bucket: job.spec.bucket.clone(),
        pinned_node: job.pinned_node.clone(),
        // Set by the scheduling loop from the owners' fair share.
        priority: Default::default(),
    }
}

/// A job holding GPUs as the scheduler takes it; `None` for other states.
pub fn running_job(job: &JobRecord) -> Option<RunningJob> {
    if !job.state().holds_gpus() {
        return None;
    }
    Some(RunningJob {
        id: job.id,
        owner: job.user_name.clone(),
        node: job.node.clone()?,
        gpus: ongrid_core::api::whole_gpus(&job.gpus),
        started_at: job.lifecycle.started_at()?,
        max_duration: job.max_duration,
        min_duration: job.spec.min_duration,
        bucket: job.spec.bucket.as_ref().map(|b| b.name.clone()),
        halting: job.state() != JobState::Running,
    })
}

#[cfg(test)]
impl Satisfiable {
    fn kept_answers(&self) -> HashMap<ongrid_core::GpuRequest, Option<String>> {
        self.answers.lock().unwrap().clone()
    }
}

#[cfg(test)]
mod tests {
    use ongrid_core::{ComputeCapability, GpuInfo, GpuRequest, MemorySize, MigProfile, Sharing};

    use super::*;
    use crate::store::fixtures::{self, gpu, registration};

    /// The inventory snapshots of one version share one satisfiability state; a change of the
    /// nodes (a GPU with more memory registered) is answered from the new one.
    #[tokio::test]
    async fn inventory_snapshots_share_the_satisfiability_of_their_version() {
        let (_dir, store) = fixtures::sqlite().await;
        let now = Utc::now();
        let timeout = Duration::from_secs(30);
        store
            .register_node(registration("node1"), &[gpu(1)], now)
            .await
            .unwrap();
        let kept = Satisfiability::default();
        let load = || SiteSnapshot::load_inventory(store.as_ref(), now, timeout, &kept);
        let big = GpuRequest {
            min_memory: Some(MemorySize::from_mib(81_920)),
            ..GpuRequest::default()
        };
        let (first, second) = (load().await.unwrap(), load().await.unwrap());
        let no_big = first.never_meets(&big);
        assert!(no_big.is_some());
        // The second snapshot answers as the first did, from what the first worked out.
        assert_eq!(
            second.satisfiable.get().unwrap().kept_answers(),
            HashMap::from([(big, no_big.clone())])
        );
        assert_eq!(second.never_meets(&big), no_big);
        assert!(Arc::ptr_eq(
            first.satisfiable.get().unwrap(),
            second.satisfiable.get().unwrap()
        ));

        let h100 = GpuInfo {
            memory: MemorySize::from_mib(81_920),
            ..gpu(2)
        };
        store
            .register_node(registration("node2"), &[h100], now)
            .await
            .unwrap();
        let after = load().await.unwrap();
        assert_eq!(after.never_meets(&big), None, "the new GPU counts");
        assert_eq!(
            after.satisfiable.get().unwrap().kept_answers(),
            HashMap::from([(big, None)])
        );
        assert!(
            second.never_meets(&big).is_some(),
            "an older snapshot keeps its own"
        );
    }

    /// Answers are kept for requests of whole or shared GPUs, at most [`KEPT_ANSWERS`] of them,
    /// and are the same kept or not; a MIG request's answer is never kept.
    #[test]
    fn answers_are_kept_for_a_bounded_number_of_requests() {
        let node =
            fixtures::node_record("node1", Utc::now(), vec![fixtures::gpu_record("node1", 1)]);
        let site = SiteSnapshot::new(Utc::now(), vec![node], Vec::new(), Duration::from_secs(30));
        // A MIG request is checked against the MIG slots each time, never kept.
        let mig = GpuRequest {
            sharing: Sharing::Mig(MigProfile::parse("1g.10gb").unwrap()),
            ..GpuRequest::default()
        };
        assert!(site.never_meets(&mig).is_some());
        assert!(site.satisfiable.get().unwrap().kept_answers().is_empty());
        let asking = |major: u16| GpuRequest {
            min_capability: Some(ComputeCapability::new(major, 0)),
            ..GpuRequest::default()
        };
        let answers: Vec<_> = (0..KEPT_ANSWERS as u16 + 10)
            .map(|major| site.never_meets(&asking(major)))
            .collect();
        let kept = site.satisfiable.get().unwrap().kept_answers();
        assert_eq!(kept.len(), KEPT_ANSWERS);
        for (major, answer) in (0..).zip(&answers) {
            assert_eq!(site.never_meets(&asking(major)).as_ref(), answer.as_ref());
            assert_eq!(
                kept.get(&asking(major)),
                (usize::from(major) < KEPT_ANSWERS).then_some(answer)
            );
        }
        assert_eq!(answers[0], None, "capability 0.0 is met");
        assert!(answers[20]
            .as_deref()
            .unwrap()
            .contains("compute capability 20.0"));
    }
}
