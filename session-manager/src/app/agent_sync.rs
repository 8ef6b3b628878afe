//! What node agents ask of the manager (through [`crate::api`]'s routes): registration, the
//! periodic sync (heartbeat + desired state) and the long-poll of the desired state.
//!
//! A sync records that the node is alive and its GPUs' health, then stores what the agent saw:
//! its containers ([`reports::observe`] decides what each means for its session), its freezes'
//! progress ([`images::follow_report`]), its jobs ([`super::job_reports::follow_reports`]:
//! output and state) and the activity of its sessions. The answer is the node's
//! [`DesiredState`] ([`desired::desired_state`], with its jobs from
//! [`super::job_reports::node_jobs`]).
//!
//! Between syncs the agent keeps `GET /v1/agent/desired?after=<version>` open ([`next_desired`]):
//! a long-poll that answers as soon as the node's desired state differs from the version the
//! agent has (woken by [`crate::notify::Changes`]), or says it is unchanged after `timeout`
//! seconds (25 by default). Every desired state has a [`version`] (a digest of the state
//! itself, so equal states have equal versions across restarts of the manager and nothing is
//! counted in memory); the periodic sync stays the safety net when a notification is lost.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio::sync::watch;

use ongrid_core::api::{DesiredState, NodeReport, RegisterNode};
use ongrid_core::image::ImageState;
use ongrid_core::{GpuInfo, GpuMode, NodeName, SessionId, SessionState};
use sha2::{Digest, Sha256};

use super::{ApiError, AppState, Effect};
use crate::domain::sessions::desired::{self, NodeSettings};
use crate::domain::sessions::{reports, SessionRecord};
use crate::domain::{image_access, images};
use crate::notify::Position;
use crate::store::{DesiredReads, Heartbeat, ImageFilter, NodeRegistration, SessionFilter};

/// Registers (or registers again) the agent's node and its GPUs; answers its desired state.
pub async fn register(
    state: &AppState,
    node: &NodeName,
    body: RegisterNode,
) -> Result<Versioned, ApiError> {
    check_node(node, &body.node)?;
    check_gpus(&body.gpus)?;
    check_start_modes(&body.gpus, &body.start_modes)?;
    let stream_url = body.stream_url.map(|url| url.trim().to_owned());
    if let Some(url) = &stream_url {
        check_stream_url(url).map_err(ApiError::bad_request)?;
    }
    let registration = NodeRegistration {
        name: node.clone(),
        gpu_backend: body.gpu_backend,
        agent_version: body.agent_version,
        stream_url: stream_url.clone(),
        start_modes: body.start_modes,
    };
    state
        .store
        .register_node(registration, &body.gpus, state.clock.now())
        .await?;
    tracing::info!(%node, gpus = body.gpus.len(), stream_url = stream_url.as_deref().unwrap_or("none"), "Node registered.");
    // Its GPUs and their modes may have changed with it (the desired state's MIG layouts).
    state.committed(&[Effect::Scheduling, Effect::Node(node.clone())]);
    Versioned::of(&desired_state(state, node, NodeRead::Nothing).await?)
}

/// Records what the agent reports of its node, and answers the node's desired state.
///
/// Only what changed wakes anyone: a sync that found its node as it was (the common case, every
/// `sync_interval` on every node) stores the heartbeat and wakes neither the scheduler nor any
/// long-poll. The scheduler is woken when what it plans with changed: the GPUs (health, MIG
/// devices, a GPU added or gone), a session's or a job's state (or a job's output), or a node it
/// saw as offline.
///
/// A sync that woke its node's waiters wakes its agent's long-poll too: the answer is then read
/// after the notification, as a read of that poll would be, and the poll takes it
/// ([`DesiredVersions`]) instead of reading the same again.
pub async fn sync(
    state: &AppState,
    node: &NodeName,
    report: NodeReport,
) -> Result<Versioned, ApiError> {
    check_node(node, &report.node)?;
    check_gpus(&report.gpus)?;
    let now = state.clock.now();
    let Some(heartbeat) = state.store.record_sync(node, &report.gpus, now).await? else {
        return Err(not_registered(node));
    };
    let mut changed = Changed::heartbeat(heartbeat, now, state.config.node_timeout);
    let sessions = state
        .store
        .sessions(SessionFilter::Node(node.clone()))
        .await?;
    let resuming = resuming(state, node, &sessions).await?;
    let on_node: HashMap<SessionId, &SessionRecord> = sessions.iter().map(|s| (s.id, s)).collect();
    // The session changes the node's report makes, written together in one write.
    let mut observed = Vec::new();
    for container in &report.containers {
        let Some(session) = on_node.get(&container.session_id) else {
            continue;
        };
        let resumes = resuming.contains(&session.id);
        if let Some(change) = reports::observe(session, container, node, resumes, now) {
            observed.push((*session, change));
        }
    }
    // Whether a session of the node changed here: its sessions are then read again for the answer.
    let mut transitioned = false;
    if !observed.is_empty() {
        let changes = observed
            .iter()
            .map(|(session, change)| (session.id, change.clone()))
            .collect();
        let outcomes = state.store.transition_all(changes).await?;
        for ((session, change), outcome) in observed.iter().zip(outcomes) {
            // Refused, changed meanwhile (for example removed by its owner): the next sync sees
            // it. An error of the database failed the whole write above.
            if outcome.is_err() {
                continue;
            }
            if session.state == SessionState::Starting && change.to == SessionState::Waiting {
                crate::metrics::events().started(session.queued_at, now);
            }
            changed.scheduling |= takes_or_frees(session.state, change.to);
            changed.watched = true;
            transitioned = true;
            tracing::info!(session_id = %session.id, %node, state = %change.to, reason = %change.reason, "Session changed on its node's report.");
        }
    }
    for progress in &report.freezes {
        let change = images::follow_report(progress, node);
        let id = progress.image_id();
        let Some(image) = state.store.record_freeze(node, id, &change, now).await? else {
            continue;
        };
        changed.watched = true;
        match image.state {
            ImageState::Ready => {
                tracing::info!(image_id = %image.id, reference = %image.reference, digest = image.digest.as_deref().unwrap_or(""), size = image.size.unwrap_or(0), %node, "Image frozen.");
            }
            ImageState::Failed => {
                tracing::info!(image_id = %image.id, reference = %image.reference, reason = ?image.reason, %node, "Freeze failed.");
            }
            ImageState::Building | ImageState::Deleted => {}
        }
    }
    let jobs = super::job_reports::follow_reports(state, node, &report.jobs).await?;
    changed.scheduling |= jobs.stored;
    state
        .store
        .record_activity(node, &report.activity, now, &state.config.lifecycle)
        .await?;
    let effects = changed.effects(node);
    state.committed(&effects);
    if effects.contains(&Effect::Node(node.clone())) {
        // Read after the notification, where the woken long-poll stands, and shared with it.
        let position = state.changes.subscribe_node(node).position();
        return read_shared(state, node, position).await;
    }
    // A sync that changed nothing of the node's (the common case) answers with its sessions and
    // jobs as read above; a commit since by someone else has woken the node's long-poll, which
    // answers it.
    debug_assert!(!transitioned, "a session's change notifies its node");
    let read = NodeRead::Synced {
        sessions: NodeSessions { sessions, resuming },
        jobs: jobs.unchanged,
    };
    Versioned::of(&desired_state(state, node, read).await?)
}

/// What a sync changed, so that it wakes only the waiters concerned: the long-polls on the node
/// (its agent's, and people's on its sessions, freezes and jobs) for either.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Changed {
    /// Something the scheduler plans with.
    scheduling: bool,
    /// Something the node's waiters watch but the scheduler does not plan with (a freeze's
    /// progress, a session's container that started).
    watched: bool,
}

/// Whether a session's move from `from` to `to` changed what the scheduler plans with: it took
/// or gave back GPUs (it ended, failed or was held), or went back to the queue. A container
/// that started (STARTING to WAITING) or a connection keeps the GPUs it had: no round for it.
fn takes_or_frees(from: SessionState, to: SessionState) -> bool {
    from.holds_gpus() != to.holds_gpus() || to == SessionState::Pending
}

impl Changed {
    /// What the heartbeat alone changed: the node's GPUs, or the node itself when the scheduler
    /// saw it as offline (silent for `node_timeout`) until now.
    fn heartbeat(heartbeat: Heartbeat, now: DateTime<Utc>, node_timeout: Duration) -> Self {
        let was_offline = (now - heartbeat.last_seen)
            .to_std()
            .is_ok_and(|silent| silent >= node_timeout);
        Self {
            scheduling: heartbeat.gpus_changed || was_offline,
            watched: false,
        }
    }

    fn effects(self, node: &NodeName) -> Vec<Effect> {
        let mut effects = Vec::new();
        if self.scheduling {
            effects.push(Effect::Scheduling);
        }
        if self.scheduling || self.watched {
            effects.push(Effect::Node(node.clone()));
        }
        effects
    }
}

/// How long `GET /v1/agent/desired` waits for a change when the agent does not say.
pub const DESIRED_WAIT: Duration = Duration::from_secs(25);

/// The longest wait an agent may ask for.
pub const MAX_DESIRED_WAIT: Duration = Duration::from_secs(300);

/// What the long-poll answers: the node's desired state once it differs from the version the
/// agent has, or that it did not change while the poll waited.
pub enum Desired {
    Changed(Versioned),
    /// Unchanged: still this version.
    Unchanged(String),
}

/// A desired state as an agent receives it: its JSON, and its version (a digest of that JSON,
/// whose fields and lists are in a fixed order, so it changes exactly when the state does),
/// made once for both.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Versioned {
    pub json: bytes::Bytes,
    pub version: String,
}

impl Versioned {
    pub fn of(desired: &DesiredState) -> Result<Self, ApiError> {
        let json = serde_json::to_vec(desired).map_err(ApiError::internal)?;
        let version = hex::encode(&Sha256::digest(&json)[..16]);
        Ok(Self {
            json: json.into(),
            version,
        })
    }
}

/// The long-poll: the node's desired state once it differs from `after` (at once when the
/// agent has none), else `Unchanged` when `wait` passes (or the manager shuts down).
///
/// What a long-poll or a sync read is remembered with where the node's signals stood before the
/// read ([`DesiredVersions`]): a poll at the same place takes it, waiting for it while the read
/// runs, instead of reading the node's desired state again. So the agent's next poll, which
/// comes at once with the version it was answered, waits without reading unless a notification
/// for the node or the site came since (a node removed or registered again notifies it), and a
/// poll woken by its node's own sync takes the sync's answer (a read that differs from the
/// agent's version is taken only when it began after the poll came: an older one may be older
/// than what the agent has, from another replica). A read is taken for [`KNOWN_FOR`]
/// only: what changes with time alone (a job's output grace, a removed image's retention) and a
/// notification another replica could not publish notify nobody, and a poll that begins later
/// reads again, as every poll did. A poll that reads the desired state learns there whether its
/// node is registered ([`desired_state`]): one whose node was removed while it waited, which
/// notifies it, is answered not found at once; one that takes a read kept with the agent's
/// version checks nothing, and its node's removal, when it comes, notifies it.
pub async fn next_desired(
    state: &AppState,
    node: &NodeName,
    after: Option<&str>,
    wait: Duration,
) -> Result<Desired, ApiError> {
    let deadline = tokio::time::Instant::now() + wait.min(MAX_DESIRED_WAIT);
    // Subscribed before the first read, so a commit between the read and the wait wakes it.
    let mut changes = state.changes.subscribe_node(node);
    let arrived = tokio::time::Instant::now();
    loop {
        let known = match changes.position() {
            Some(at) => state.desired_versions.at(node, at).await,
            None => None,
        };
        let current = match known {
            Some(read) if after == Some(read.desired.version.as_str()) => read.desired.version,
            known => {
                // Begun since this poll came (by the sync that woke it, say): what its own read
                // would be. One begun before may be older than the state the agent has, had
                // another replica answered it a commit this one has not heard of yet.
                if let Some(read) = known.filter(|read| read.begun_at >= arrived) {
                    return Ok(Desired::Changed(read.desired));
                }
                let current = read_shared(state, node, changes.position()).await?;
                if after != Some(current.version.as_str()) {
                    return Ok(Desired::Changed(current));
                }
                current.version
            }
        };
        match tokio::time::timeout_at(deadline, changes.changed()).await {
            Ok(true) => {}
            Ok(false) | Err(_) => return Ok(Desired::Unchanged(current)),
        }
    }
}

/// The answer to an agent whose node is not registered (or was removed): to a sync whose
/// heartbeat finds no node, and to any request whose read of the desired state finds none
/// ([`desired_state`]): a long-poll's, a sync's, a registration's.
fn not_registered(node: &NodeName) -> ApiError {
    ApiError::not_found(format!(
        "node {node} is not registered: the agent must POST /v1/agent/register first"
    ))
}

/// `node`'s desired state read now, kept at `position` (where its signals stand) for the
/// polls there ([`DesiredVersions`]).
async fn read_shared(
    state: &AppState,
    node: &NodeName,
    position: Option<Position>,
) -> Result<Versioned, ApiError> {
    let reading = position.map(|at| state.desired_versions.begin(node, at));
    let desired = Versioned::of(&desired_state(state, node, NodeRead::Nothing).await?)?;
    if let Some(reading) = reading {
        reading.done(&desired);
    }
    Ok(desired)
}

/// How long a read of a node's desired state is taken as current while no notification for the
/// node came ([`next_desired`]): long enough for the agent's next poll, which follows each
/// answer at once, and for a poll woken by its node's sync.
pub const KNOWN_FOR: Duration = Duration::from_secs(2);

/// The last read of each node's desired state, by a long-poll or a sync, with where the node's
/// signals stood before it ([`crate::notify::Position`]) and when it began: still what is stored
/// while they stand there, taken as such for [`KNOWN_FOR`]; one still running is waited for.
/// Shared by the clones of the state; one entry per node that polled or synced lately: older
/// ones (of nodes gone quiet or removed) are dropped as reads begin, at most once per
/// [`KNOWN_FOR`].
#[derive(Debug, Default)]
pub struct DesiredVersions(Mutex<Kept>);

#[derive(Debug, Default)]
struct Kept {
    by_node: HashMap<NodeName, Known>,
    /// When the reads older than [`KNOWN_FOR`] were last dropped.
    pruned_at: Option<tokio::time::Instant>,
}

/// A read begun at a position, and when; its answer once done.
#[derive(Debug)]
struct Known {
    position: Position,
    read: watch::Receiver<Option<Versioned>>,
    begun_at: tokio::time::Instant,
}

/// What a read kept in [`DesiredVersions`] read, and when it began.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Read {
    desired: Versioned,
    begun_at: tokio::time::Instant,
}

/// A read of a node's desired state that polls at its position wait for ([`DesiredVersions`]);
/// dropped without [`Reading::done`] (it failed), they read themselves.
#[derive(Debug)]
#[must_use]
pub struct Reading(watch::Sender<Option<Versioned>>);

impl Reading {
    fn done(self, desired: &Versioned) {
        self.0.send_replace(Some(desired.clone()));
    }
}

impl DesiredVersions {
    fn kept(&self) -> MutexGuard<'_, Kept> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// What was read of `node`'s desired state at `position`, within [`KNOWN_FOR`], once its
    /// read is done; `None` when there is none, or it failed.
    async fn at(&self, node: &NodeName, position: Position) -> Option<Read> {
        let (mut read, begun_at) = self
            .kept()
            .by_node
            .get(node)
            .filter(|known| known.position == position && known.begun_at.elapsed() < KNOWN_FOR)
            .map(|known| (known.read.clone(), known.begun_at))?;
        let done = read.wait_for(Option::is_some).await.ok()?;
        let desired = done.clone()?;
        Some(Read { desired, begun_at })
    }

    /// Begins a read of `node`'s desired state, after its signals stood at `position`.
    fn begin(&self, node: &NodeName, position: Position) -> Reading {
        let (answer, read) = watch::channel(None);
        let now = tokio::time::Instant::now();
        let known = Known {
            position,
            read,
            begun_at: now,
        };
        let mut kept = self.kept();
        kept.by_node.insert(node.clone(), known);
        if kept
            .pruned_at
            .is_none_or(|pruned| now.duration_since(pruned) >= KNOWN_FOR)
        {
            kept.by_node
                .retain(|_, known| now.duration_since(known.begun_at) < KNOWN_FOR);
            kept.pruned_at = Some(now);
        }
        Reading(answer)
    }
}

fn check_node(token_node: &NodeName, body_node: &NodeName) -> Result<(), ApiError> {
    if token_node != body_node {
        return Err(ApiError::forbidden(format!(
            "this token belongs to node {token_node}; it cannot speak for node {body_node}"
        )));
    }
    Ok(())
}

fn check_gpus(gpus: &[GpuInfo]) -> Result<(), ApiError> {
    let mut seen = BTreeSet::new();
    for gpu in gpus {
        if !seen.insert(&gpu.uuid) {
            return Err(ApiError::bad_request(format!(
                "GPU {} is listed twice in the report",
                gpu.uuid
            )));
        }
    }
    Ok(())
}

/// Checks the modes the agent asks its GPUs to start in by the rules an admin's change meets:
/// each for a GPU it reports, `shared:N` within its bounds, a MIG layout its model has.
fn check_start_modes(
    gpus: &[GpuInfo],
    modes: &std::collections::BTreeMap<ongrid_core::GpuUuid, GpuMode>,
) -> Result<(), ApiError> {
    for (uuid, mode) in modes {
        let refused = |problem: String| {
            ApiError::bad_request(format!(
                "GPU {uuid} cannot start in mode {mode}: {problem}; fix its `mode` in the \
                 agent's simulated GPU file"
            ))
        };
        let gpu = gpus
            .iter()
            .find(|gpu| &gpu.uuid == uuid)
            .ok_or_else(|| refused("the agent does not report that GPU".to_owned()))?;
        // The core's parser holds the rules, as for `PUT /v1/gpus/{uuid}/mode`.
        let parsed: GpuMode = mode
            .to_string()
            .parse()
            .map_err(|e: ongrid_core::gpu::GpuModeError| refused(e.to_string()))?;
        if let Some(layout) = parsed.mig_layout() {
            layout
                .validate_for(&gpu.model)
                .map_err(|e| refused(e.to_string()))?;
        }
    }
    Ok(())
}

/// Checks the agent's stream endpoint well enough to refuse mistakes: the gateway dials it with
/// TLS, so it must be `wss://host[:port][/path]`.
pub fn check_stream_url(url: &str) -> Result<(), String> {
    let Some(rest) = url.strip_prefix("wss://") else {
        return Err(format!(
            "stream_url {url:?} must start with wss:// (the gateway reaches agents over TLS): \
             check [streams] url in the agent's config"
        ));
    };
    let host = rest.split('/').next().unwrap_or_default();
    if host.is_empty()
        || url.len() > 2048
        || url.chars().any(|c| c.is_whitespace() || c.is_control())
    {
        return Err(format!(
            "stream_url {url:?} is not a URL like wss://node1.site.invalid:8444: check [streams] \
             url in the agent's config"
        ));
    }
    Ok(())
}

/// The STARTING sessions among `sessions` (the node's, as just read) that ran before: released
/// from a hold, their container exists, stopped, and is to be started again. Read only when
/// one is STARTING.
async fn resuming(
    state: &AppState,
    node: &NodeName,
    sessions: &[SessionRecord],
) -> Result<HashSet<SessionId>, ApiError> {
    if !sessions.iter().any(|s| s.state == SessionState::Starting) {
        return Ok(HashSet::new());
    }
    let ran_before = state.store.resuming_on(node).await?;
    Ok(resuming_among(sessions, &ran_before))
}

/// Those of `sessions` STARTING whose container ran before, as `ran_before` (read after them)
/// lists them: one the second read does not list (it changed between the two) does not resume.
fn resuming_among(sessions: &[SessionRecord], ran_before: &[SessionId]) -> HashSet<SessionId> {
    let ran_before: HashSet<&SessionId> = ran_before.iter().collect();
    sessions
        .iter()
        .filter(|s| s.state == SessionState::Starting && ran_before.contains(&s.id))
        .map(|s| s.id)
        .collect()
}

/// A node's sessions as read, and which of them resume a stopped container ([`resuming`]).
struct NodeSessions {
    sessions: Vec<SessionRecord>,
    resuming: HashSet<SessionId>,
}

/// What the caller has just read of the node, to answer with.
enum NodeRead {
    /// Nothing (a long-poll's answer, a registration's, a sync's that changed its node).
    Nothing,
    /// A sync's: the node's sessions, and its jobs when the sync read them for its jobs'
    /// reports and wrote nothing of them.
    Synced {
        sessions: NodeSessions,
        jobs: Option<Vec<crate::domain::jobs::JobRecord>>,
    },
}

/// The node's desired state as stored now; its sessions and jobs as `read` when the caller has
/// just read them, else read with its GPUs and images on one connection
/// ([`crate::store::Store::desired_reads_and_work`]). Not found when the node is not registered
/// (or was removed), which the read of its GPUs and images tells, first.
async fn desired_state(
    state: &AppState,
    node: &NodeName,
    read: NodeRead,
) -> Result<DesiredState, ApiError> {
    let retention = chrono::TimeDelta::from_std(image_access::REMOVED_IMAGE_RETENTION)
        .unwrap_or(chrono::TimeDelta::MAX);
    let images_removed_since = state.clock.now() - retention;
    let (DesiredReads { gpus, images }, NodeSessions { sessions, resuming }, jobs) = match read {
        NodeRead::Nothing => {
            let Some((reads, work)) = state
                .store
                .desired_reads_and_work(node, images_removed_since)
                .await?
            else {
                return Err(not_registered(node));
            };
            let resuming = resuming_among(&work.sessions, &work.ran_before);
            let sessions = NodeSessions {
                sessions: work.sessions,
                resuming,
            };
            (reads, sessions, Some(work.jobs))
        }
        NodeRead::Synced { sessions, jobs } => {
            let Some(reads) = state
                .store
                .desired_reads(node, images_removed_since)
                .await?
            else {
                return Err(not_registered(node));
            };
            (reads, sessions, jobs)
        }
    };
    let settings = NodeSettings {
        sync_interval: state.config.sync_interval,
        limits: state.config.session_limits,
    };
    let (building, removed): (Vec<_>, Vec<_>) = images
        .into_iter()
        .partition(|image| image.state == ImageState::Building);
    let removed_images = if removed.is_empty() {
        Vec::new()
    } else {
        let current = state.store.images(ImageFilter::All).await?;
        image_access::removed_docker_images(&removed, &current)
    };
    let mut desired = desired::desired_state(
        node,
        sessions,
        &resuming,
        images::freeze_orders(building),
        settings,
    );
    desired.removed_images = removed_images;
    desired.mig_layouts = gpus
        .iter()
        .filter_map(|gpu| Some((gpu.info.uuid.clone(), gpu.mode.mig_layout()?)))
        .collect();
    desired.mig_off = gpus
        .iter()
        .filter(|gpu| crate::site::leaving_mig(gpu))
        .map(|gpu| gpu.info.uuid.clone())
        .collect();
    super::job_reports::node_jobs(state, node, &mut desired, jobs).await?;
    Ok(desired)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_urls_must_be_wss() {
        assert!(check_stream_url("wss://node1.site.invalid:8444").is_ok());
        assert!(check_stream_url("wss://127.0.0.1:40123").is_ok());
        assert!(check_stream_url("wss://[::1]:8444/streams").is_ok());
        let err = check_stream_url("ws://node1:8444").unwrap_err();
        assert!(err.contains("wss://"), "{err}");
        assert!(check_stream_url("wss://").is_err());
        assert!(check_stream_url("wss:///path").is_err());
        assert!(check_stream_url("wss://node 1:8444").is_err());
    }

    /// A sync that found its node as it was wakes nobody; one that changed what the scheduler
    /// plans with wakes it and the node's waiters; one that changed only what people watch (a
    /// freeze's progress) wakes the waiters alone.
    #[test]
    fn a_sync_wakes_only_what_it_changed() {
        let node = NodeName::parse("node1").unwrap();
        let now = DateTime::parse_from_rfc3339("2026-12-02T09:00:00Z")
            .unwrap()
            .with_timezone(&Utc);
        let timeout = Duration::from_secs(30);
        let seen = |seconds_ago: i64, gpus_changed: bool| Heartbeat {
            last_seen: now - chrono::TimeDelta::seconds(seconds_ago),
            gpus_changed,
        };
        let woken = |heartbeat| Changed::heartbeat(heartbeat, now, timeout).effects(&node);
        let both = vec![Effect::Scheduling, Effect::Node(node.clone())];

        assert_eq!(woken(seen(5, false)), vec![]);
        assert_eq!(woken(seen(29, false)), vec![]);
        assert_eq!(woken(seen(30, false)), both, "back from offline");
        assert_eq!(woken(seen(5, true)), both, "its GPUs changed");
        // A clock that went back is no silence.
        assert_eq!(woken(seen(-60, false)), vec![]);

        let mut freeze_only = Changed::heartbeat(seen(5, false), now, timeout);
        freeze_only.watched = true;
        assert_eq!(freeze_only.effects(&node), vec![Effect::Node(node.clone())]);
    }

    /// A read begun at a position is taken at that position only, and for [`KNOWN_FOR`]; a poll
    /// that comes while it runs waits for its answer, and reads itself when it failed.
    #[tokio::test(start_paused = true)]
    async fn a_read_of_the_desired_state_is_taken_at_its_position_for_a_while() {
        let changes = crate::notify::Changes::new(tokio_util::sync::CancellationToken::new());
        let node = NodeName::parse("node1").unwrap();
        let waiter = changes.subscribe_node(&node);
        let read_at = waiter.position().unwrap();
        let known = DesiredVersions::default();
        let v1 = Versioned {
            json: bytes::Bytes::from_static(b"{}"),
            version: "v1".to_owned(),
        };
        let begun_at = tokio::time::Instant::now();
        let reading = known.begin(&node, read_at);
        let (taken, ()) = tokio::join!(known.at(&node, read_at), async {
            tokio::task::yield_now().await;
            reading.done(&v1);
        });
        let read = Read {
            desired: v1.clone(),
            begun_at,
        };
        assert_eq!(taken, Some(read.clone()), "waited for the read under way");
        assert_eq!(known.at(&node, read_at).await, Some(read));
        let other = NodeName::parse("node2").unwrap();
        assert_eq!(known.at(&other, read_at).await, None);
        changes.node(&node);
        let notified = waiter.position().unwrap();
        assert_eq!(known.at(&node, notified).await, None, "notified since");
        drop(known.begin(&node, notified));
        assert_eq!(known.at(&node, notified).await, None, "its read failed");
        known.begin(&node, notified).done(&v1);
        tokio::time::advance(KNOWN_FOR).await;
        assert_eq!(known.at(&node, notified).await, None, "read too long ago");
        // Reads too long ago are dropped as others begin: a node gone quiet or removed keeps
        // nothing.
        known.begin(&other, read_at).done(&v1);
        let kept: Vec<NodeName> = known.kept().by_node.keys().cloned().collect();
        assert_eq!(kept, [other]);
    }

    /// A session's report calls for a round only when the session took or gave back GPUs.
    #[test]
    fn a_round_follows_a_report_only_when_gpus_were_taken_or_given_back() {
        use SessionState::*;
        assert!(!takes_or_frees(Starting, Waiting), "its container started");
        assert!(!takes_or_frees(Waiting, Connected));
        assert!(takes_or_frees(Starting, Failed), "its container never ran");
        assert!(takes_or_frees(Waiting, Failed));
        assert!(takes_or_frees(Connected, Ended));
        assert!(takes_or_frees(Idle, Held));
        assert!(takes_or_frees(Starting, Pending), "back to the queue");
    }
}
