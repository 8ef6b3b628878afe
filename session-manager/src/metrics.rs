//! The manager's metrics, served by `ongrid_service::metrics` on `[metrics] listen`.
//!
//! Two kinds: counts read from the store at each scrape ([`ManagerExporter::refresh`]: sessions
//! and jobs by state, GPUs by model, mode, health and use, nodes, the GPUs each reservation that
//! has not ended holds) and events counted where they
//! happen ([`events`]: HTTP requests by route template and status, holds by reason, time from a
//! request to a running container, the scheduler's plan duration and queue). Event handles are
//! process-wide, like a logger, because the places that count them (routes, loops) are spread
//! over modules that share no handle; managers started in one test process share them.
//! `/readyz` says whether the store answers.
//!
//! Labels are bounded: states, reasons, routes, HTTP methods and statuses are closed sets
//! (a method or status outside them is counted as `other` or by its class), GPU models and modes
//! are the site's few, reservations are the few admins made that have not ended; no DN, user, session
//! or node name is ever a label.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, LazyLock};
use std::time::Instant;

use axum::extract::{MatchedPath, Request};
use axum::middleware::Next;
use axum::response::Response;
use chrono::{DateTime, Utc};
use ongrid_core::holds::HoldReason;
use ongrid_core::reservation::ReservationStatus;
use ongrid_core::{GpuHealth, GpuId, JobState, NodeName, SessionId, SessionState};
use ongrid_scheduler::Action;
use ongrid_service::metrics::{latency_buckets, wait_buckets, Exporter, ExporterFuture};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

use crate::clock::Clock;
use crate::domain::policy::fairshare::FairShareConfig;
use crate::domain::sessions::SessionRecord;
use crate::store::{NodeRecord, Store};

/// An HTTP request's labels, each from a closed set whatever the client sends: see
/// [`route_label`], [`method_label`] and [`status_label`].
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct HttpLabels {
    /// The matched route template (`/v1/sessions/{name}`), `unmatched` for none.
    pub route: String,
    pub method: &'static str,
    pub status: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct RouteLabels {
    pub route: String,
    pub method: &'static str,
}

/// The methods counted by name; every other is `other`, so that a client cannot add series by
/// inventing methods (any token is a valid HTTP method).
pub const METHODS: [&str; 9] = [
    "GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "CONNECT", "TRACE",
];

/// The statuses counted by their code: those the manager answers with. Any other is counted by
/// its class (`1xx` to `9xx`), so the set of values is closed by construction.
pub const STATUSES: [u16; 19] = [
    200, 201, 204, 303, 304, 400, 401, 403, 404, 405, 409, 413, 415, 422, 429, 500, 502, 503, 504,
];

/// The route template the router matched, `unmatched` when none did (the router's templates are
/// a closed set; the path as sent never is a label).
pub fn route_label(matched: Option<&MatchedPath>) -> String {
    matched.map_or_else(|| "unmatched".to_owned(), |path| path.as_str().to_owned())
}

/// One of [`METHODS`], or `other`.
pub fn method_label(method: &axum::http::Method) -> &'static str {
    METHODS
        .iter()
        .find(|known| **known == method.as_str())
        .copied()
        .unwrap_or("other")
}

/// One of [`STATUSES`], else the status's class.
pub fn status_label(status: axum::http::StatusCode) -> String {
    let code = status.as_u16();
    if STATUSES.contains(&code) {
        code.to_string()
    } else {
        format!("{}xx", code / 100)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct ReasonLabels {
    pub reason: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct StateLabels {
    pub state: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct GpuLabels {
    pub model: String,
    /// `exclusive`, `shared` or `mig`.
    pub mode: String,
    /// `healthy`, `failed` or `unknown`.
    pub health: String,
    /// `used` (a session or job holds it) or `free`.
    pub r#use: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct MigLabels {
    /// The parent GPU's model.
    pub model: String,
    /// The MIG profile, such as `1g.10gb`.
    pub profile: String,
    /// `used` (a session or job holds it) or `free`.
    pub r#use: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct GroupLabels {
    /// An accounting group of the site's `[policy]` and `[fairshare]`.
    pub group: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct ReservationLabels {
    pub reservation: String,
    /// The accounting group it is for.
    pub group: String,
    /// `active` (its window is open) or `upcoming`.
    pub status: String,
}

/// Every state of `states` with its count in `counts` (by the state's name), zero when absent.
fn counted(
    states: impl Iterator<Item = &'static str>,
    counts: &[(String, i64)],
) -> BTreeMap<&'static str, i64> {
    states
        .map(|state| {
            let n = counts
                .iter()
                .find(|(name, _)| name == state)
                .map_or(0, |(_, n)| *n);
            (state, n)
        })
        .collect()
}

/// The events the manager counts where they happen.
pub struct Events {
    pub http_requests: Family<HttpLabels, Counter>,
    pub http_request_duration: Family<RouteLabels, Histogram>,
    pub holds: Family<ReasonLabels, Counter>,
    pub session_start: Histogram,
    pub plan_duration: Histogram,
    pub round_duration: Histogram,
    pub queued_sessions: Family<ReasonLabels, Gauge>,
}

static EVENTS: LazyLock<Events> = LazyLock::new(|| Events {
    http_requests: Family::default(),
    http_request_duration: Family::new_with_constructor(|| Histogram::new(latency_buckets())),
    holds: Family::default(),
    session_start: Histogram::new(wait_buckets()),
    plan_duration: Histogram::new(latency_buckets()),
    round_duration: Histogram::new(latency_buckets()),
    queued_sessions: Family::default(),
});

/// The process-wide event handles.
pub fn events() -> &'static Events {
    &EVENTS
}

impl Events {
    /// A session was held (by a rule, its owner or an admin).
    pub fn held(&self, reason: HoldReason) {
        self.holds
            .get_or_create(&ReasonLabels {
                reason: reason.as_str().to_owned(),
            })
            .inc();
    }

    /// A session's container runs: `queued_at` is when it was requested (created, or released).
    pub fn started(&self, queued_at: DateTime<Utc>, now: DateTime<Utc>) {
        let seconds = (now - queued_at).num_milliseconds().max(0) as f64 / 1000.0;
        self.session_start.observe(seconds);
    }

    /// How long one scheduling plan took.
    pub fn plan_took(&self, elapsed: std::time::Duration) {
        self.plan_duration.observe(elapsed.as_secs_f64());
    }

    /// How long one whole scheduling round took: its reads, the plan and its writes.
    pub fn round_took(&self, elapsed: std::time::Duration) {
        self.round_duration.observe(elapsed.as_secs_f64());
    }

    /// What stays queued after a scheduling round, by why (see [`queue_reasons`]).
    pub fn queued(&self, queued: &BTreeMap<&'static str, i64>) {
        for reason in QUEUE_REASONS {
            self.queued_sessions
                .get_or_create(&ReasonLabels {
                    reason: reason.to_owned(),
                })
                .set(queued.get(reason).copied().unwrap_or(0));
        }
    }
}

/// The sessions a plan places.
pub fn placed_sessions(actions: &[Action]) -> HashSet<SessionId> {
    actions
        .iter()
        .filter_map(|action| match action {
            Action::Place { session, .. } => Some(*session),
            _ => None,
        })
        .collect()
}

/// The PENDING sessions a round leaves queued, by why: waiting for jobs to halt, pinned to the
/// node of their held container (`unpinned`: those whose node is offline, so not pinned), or
/// waiting for capacity.
pub fn queue_reasons<T>(
    pending: &[SessionRecord],
    placed: &HashSet<SessionId>,
    halt_waits: &HashMap<SessionId, T>,
    unpinned: &HashMap<SessionId, NodeName>,
) -> BTreeMap<&'static str, i64> {
    let mut queued = BTreeMap::new();
    for session in pending.iter().filter(|s| !placed.contains(&s.id)) {
        let reason = if halt_waits.contains_key(&session.id) {
            "awaiting_halt"
        } else if session.node.is_some() && !unpinned.contains_key(&session.id) {
            "pinned_node"
        } else {
            "no_capacity"
        };
        *queued.entry(reason).or_default() += 1;
    }
    queued
}

/// Why a PENDING session is still queued after a plan: released onto its node's GPUs
/// (`pinned_node`), waiting for batch jobs to halt (`awaiting_halt`), or no GPU fits
/// (`no_capacity`).
pub const QUEUE_REASONS: [&str; 3] = ["pinned_node", "awaiting_halt", "no_capacity"];

/// Axum middleware counting every request by its route template, method and status, each
/// label from a closed set ([`HttpLabels`]): the series stay few whatever clients send, also
/// while `/metrics` is not served (the counters live on).
pub async fn count_requests(request: Request, next: Next) -> Response {
    let route = route_label(request.extensions().get::<MatchedPath>());
    let method = method_label(request.method());
    let start = Instant::now();
    let response = next.run(request).await;
    let events = events();
    events
        .http_request_duration
        .get_or_create(&RouteLabels {
            route: route.clone(),
            method,
        })
        .observe(start.elapsed().as_secs_f64());
    events
        .http_requests
        .get_or_create(&HttpLabels {
            route,
            method,
            status: status_label(response.status()),
        })
        .inc();
    response
}

/// The manager's `/metrics`: its store's counts and the process-wide [`events`].
pub struct ManagerExporter {
    registry: Registry,
    store: Arc<dyn Store>,
    sessions: Family<StateLabels, Gauge>,
    jobs: Family<StateLabels, Gauge>,
    gpus: Family<GpuLabels, Gauge>,
    mig_devices: Family<MigLabels, Gauge>,
    nodes: Gauge,
    /// `[fairshare]` and the clock its decay is computed with; `None`: off.
    fair_share: Option<(FairShareConfig, Arc<dyn Clock>)>,
    fair_share_usage: Family<GroupLabels, Gauge<f64, AtomicU64>>,
    fair_share_factor: Family<GroupLabels, Gauge<f64, AtomicU64>>,
    reserved_gpus: Family<ReservationLabels, Gauge>,
    /// What "now" is for reservations' windows.
    clock: Arc<dyn Clock>,
}

impl ManagerExporter {
    pub fn new(store: Arc<dyn Store>) -> Self {
        let mut registry = Registry::with_prefix("ongrid");
        let sessions = Family::<StateLabels, Gauge>::default();
        let jobs = Family::<StateLabels, Gauge>::default();
        let gpus = Family::<GpuLabels, Gauge>::default();
        let mig_devices = Family::<MigLabels, Gauge>::default();
        let fair_share_usage = Family::<GroupLabels, Gauge<f64, AtomicU64>>::default();
        let fair_share_factor = Family::<GroupLabels, Gauge<f64, AtomicU64>>::default();
        let reserved_gpus = Family::<ReservationLabels, Gauge>::default();
        let nodes = Gauge::default();
        registry.register("sessions", "Sessions by state", sessions.clone());
        registry.register("jobs", "Batch jobs by state", jobs.clone());
        registry.register(
            "gpus",
            "GPUs by model, mode, health and use (used: a session or job holds it, or one of its \
             MIG devices)",
            gpus.clone(),
        );
        registry.register(
            "mig_devices",
            "MIG devices of GPUs in MIG mode, by the GPU's model, profile and use",
            mig_devices.clone(),
        );
        registry.register("nodes", "Registered nodes", nodes.clone());
        registry.register(
            "fair_share_usage",
            "Decayed cost-weighted GPU-hours of each accounting group's users (as devctl share)",
            fair_share_usage.clone(),
        );
        registry.register(
            "fair_share_factor",
            "Each accounting group's fair-share factor: 1 unused, 0.5 at its share, less above",
            fair_share_factor.clone(),
        );
        registry.register(
            "reserved_gpus",
            "GPUs each reservation that has not ended holds, by reservation, group and status \
             (active: its window is open; upcoming)",
            reserved_gpus.clone(),
        );
        let events = events();
        registry.register(
            "http_requests",
            "API requests by route template, method and status",
            events.http_requests.clone(),
        );
        registry.register_with_unit(
            "http_request_duration",
            "API request handling time by route template and method",
            Unit::Seconds,
            events.http_request_duration.clone(),
        );
        registry.register(
            "session_holds",
            "Sessions held, by reason (no-connection, idle, max-duration, owner, admin)",
            events.holds.clone(),
        );
        registry.register_with_unit(
            "session_start_duration",
            "Time from a session's request (creation or release) to its running container",
            Unit::Seconds,
            events.session_start.clone(),
        );
        registry.register_with_unit(
            "scheduler_plan_duration",
            "Time of one scheduling plan over the whole site",
            Unit::Seconds,
            events.plan_duration.clone(),
        );
        registry.register_with_unit(
            "scheduler_round_duration",
            "Time of one scheduling round: the site read, the plan and its changes stored",
            Unit::Seconds,
            events.round_duration.clone(),
        );
        registry.register(
            "scheduler_queued_sessions",
            "PENDING sessions left queued by the last plan, by why",
            events.queued_sessions.clone(),
        );
        Self {
            registry,
            store,
            sessions,
            jobs,
            gpus,
            mig_devices,
            nodes,
            fair_share: None,
            fair_share_usage,
            fair_share_factor,
            reserved_gpus,
            clock: Arc::new(crate::clock::SystemClock),
        }
    }

    /// Reads reservations' windows with `clock` (default: the system's).
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// Exports each accounting group's fair-share usage and factor when `config` is set.
    pub fn with_fair_share(
        mut self,
        config: Option<FairShareConfig>,
        clock: Arc<dyn Clock>,
    ) -> Self {
        self.fair_share = config.map(|config| (config, clock));
        self
    }

    async fn read_store(&self) -> Result<(), crate::store::StoreError> {
        // Counted by the database, with the GPUs in use (no session or job is read whole).
        let counts = self.store.state_counts().await?;
        // The planning read: the GPUs are read again only when the inventory changed, and what
        // is counted here (model, mode, health, MIG devices, the nodes) is part of it; only the
        // utilisation, which no series shows, may be older.
        let nodes = self.store.planning_nodes().await?;

        let by_state = counted(
            SessionState::ALL.iter().map(|s| s.as_str()),
            &counts.sessions,
        );
        set_states(&self.sessions, &by_state);
        let by_state = counted(JobState::ALL.iter().map(|s| s.as_str()), &counts.jobs);
        set_states(&self.jobs, &by_state);

        let used: HashSet<&str> = counts.gpus_in_use.iter().map(GpuId::as_str).collect();

        let (gpus, slices) = count_gpus(&nodes, &used);
        // Models and modes change: start over, so a series that no longer applies is gone.
        self.gpus.clear();
        for ((model, mode, health, in_use), count) in gpus {
            self.gpus
                .get_or_create(&GpuLabels {
                    model,
                    mode,
                    health: health.to_owned(),
                    r#use: in_use.to_owned(),
                })
                .set(count);
        }
        // Layouts change: start over, so a series that no longer applies is gone.
        self.mig_devices.clear();
        for ((model, profile, in_use), count) in slices {
            self.mig_devices
                .get_or_create(&MigLabels {
                    model,
                    profile,
                    r#use: in_use.to_owned(),
                })
                .set(count);
        }
        self.nodes.set(nodes.len() as i64);

        let policy = crate::scheduling::gpu_policy::GpuPolicy::load(self.store.as_ref()).await?;
        let now = self.clock.now();
        // Reservations end and are removed: start over, so their series are gone.
        self.reserved_gpus.clear();
        for (reservation, gpus) in policy.reservations_on(&nodes) {
            let status = match reservation.status(now) {
                ReservationStatus::Active => "active",
                ReservationStatus::Upcoming => "upcoming",
                ReservationStatus::Ended => continue,
            };
            self.reserved_gpus
                .get_or_create(&ReservationLabels {
                    reservation: reservation.name.to_string(),
                    group: reservation.group.to_string(),
                    status: status.to_owned(),
                })
                .set(gpus.len() as i64);
        }

        if let Some((config, clock)) = &self.fair_share {
            let accounts = self.store.usage_accounts().await?;
            let standings = crate::scheduling::fair_share::current(&accounts, config, clock.now());
            self.fair_share_usage.clear();
            self.fair_share_factor.clear();
            for standing in standings {
                let labels = GroupLabels {
                    group: standing.group.to_string(),
                };
                self.fair_share_usage
                    .get_or_create(&labels)
                    .set(standing.usage);
                self.fair_share_factor
                    .get_or_create(&labels)
                    .set(standing.factor);
            }
        }
        Ok(())
    }
}

/// (model, mode, health, use) of a GPU.
type GpuKey = (String, String, &'static str, &'static str);

/// (the GPU's model, profile, use) of a MIG device.
type MigKey = (String, String, &'static str);

/// Whole GPUs by (model, mode, health, use) and MIG devices of GPUs in MIG mode by (model,
/// profile, use); `used` holds the GPU and MIG device UUIDs sessions and jobs hold.
fn count_gpus(
    nodes: &[NodeRecord],
    used: &HashSet<&str>,
) -> (BTreeMap<GpuKey, i64>, BTreeMap<MigKey, i64>) {
    let mut gpus: BTreeMap<GpuKey, i64> = BTreeMap::new();
    for gpu in nodes.iter().flat_map(|node| node.gpus.iter()) {
        let mode = match gpu.mode {
            ongrid_core::GpuMode::Exclusive => "exclusive",
            ongrid_core::GpuMode::Shared { .. } => "shared",
            ongrid_core::GpuMode::Mig { .. } => "mig",
        };
        let health = match gpu.info.health {
            GpuHealth::Healthy => "healthy",
            GpuHealth::Failed(_) => "failed",
            GpuHealth::Unknown(_) => "unknown",
        };
        // A GPU in MIG mode is used while any of its MIG devices is.
        let held = used.contains(gpu.info.uuid.as_str())
            || gpu
                .info
                .mig_devices
                .iter()
                .any(|device| used.contains(device.uuid.as_str()));
        let in_use = if held { "used" } else { "free" };
        let key = (gpu.info.model.clone(), mode.to_owned(), health, in_use);
        *gpus.entry(key).or_default() += 1;
    }
    let mut slices: BTreeMap<MigKey, i64> = BTreeMap::new();
    for gpu in nodes.iter().flat_map(|node| node.gpus.iter()) {
        if !matches!(gpu.mode, ongrid_core::GpuMode::Mig { .. }) {
            continue;
        }
        for device in &gpu.info.mig_devices {
            let in_use = if used.contains(device.uuid.as_str()) {
                "used"
            } else {
                "free"
            };
            let key = (gpu.info.model.clone(), device.profile.to_string(), in_use);
            *slices.entry(key).or_default() += 1;
        }
    }
    (gpus, slices)
}

fn set_states(family: &Family<StateLabels, Gauge>, counts: &BTreeMap<&'static str, i64>) {
    for (state, count) in counts {
        family
            .get_or_create(&StateLabels {
                state: state.to_lowercase(),
            })
            .set(*count);
    }
}

impl Exporter for ManagerExporter {
    fn registry(&self) -> &Registry {
        &self.registry
    }

    fn refresh(&self) -> ExporterFuture<'_, ()> {
        Box::pin(async move {
            if let Err(e) = self.read_store().await {
                tracing::warn!(error = %e, "Cannot read the store for /metrics; its counts are stale.");
            }
        })
    }

    fn ready(&self) -> ExporterFuture<'_, Result<(), String>> {
        Box::pin(async move {
            self.store
                .nodes()
                .await
                .map(|_| ())
                .map_err(|e| format!("the store does not answer: {e}"))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ongrid_core::{
        ComputeCapability, GpuInfo, GpuMode, GpuUuid, MemorySize, MigDevice, MigLayout, MigProfile,
        MigUuid,
    };

    use crate::store::GpuRecord;

    fn gpu(n: u8, mode: GpuMode, mig_devices: Vec<MigDevice>) -> GpuRecord {
        GpuRecord {
            node: NodeName::parse("node1").unwrap(),
            info: GpuInfo {
                uuid: GpuUuid::parse(&format!("GPU-11111111-2222-3333-4444-5555555555{n:02}"))
                    .unwrap(),
                model: "NVIDIA A100-SXM4-40GB".to_owned(),
                capability: ComputeCapability::new(8, 0),
                memory: MemorySize::from_mib(40_960),
                pci_bus_id: None,
                driver_version: None,
                mig_enabled: !mig_devices.is_empty(),
                health: GpuHealth::Healthy,
                utilization_percent: None,
                mig_devices,
                mig_waiting: None,
            },
            mode,
            drain: None,
        }
    }

    fn slice(parent: u8, gi: u8) -> MigDevice {
        let parent = GpuUuid::parse(&format!(
            "GPU-11111111-2222-3333-4444-5555555555{parent:02}"
        ))
        .unwrap();
        MigDevice {
            uuid: MigUuid::parse(&format!("MIG-{parent}/{gi}/0")).unwrap(),
            profile: MigProfile {
                slices: 1,
                memory_gb: 10,
                media: false,
            },
            memory: MemorySize::from_mib(9_728),
            parent,
        }
    }

    #[tokio::test]
    async fn fair_share_usage_and_factor_per_group() {
        use crate::domain::policy::fairshare::Account;
        use crate::domain::policy::GroupName;

        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(
            crate::store::SqliteStore::open(&dir.path().join("m.db"))
                .await
                .unwrap(),
        );
        let now = chrono::DateTime::UNIX_EPOCH + chrono::TimeDelta::days(20_000);
        let dn = ongrid_core::Dn::parse("/DC=org/DC=example/CN=Alice Smith").unwrap();
        store.user(&dn, 20_000).await.unwrap();
        let account = Account {
            user: dn,
            group: GroupName::parse("cms").unwrap(),
            usage: 2.0,
            updated_at: now,
        };
        store.save_usage(&[account]).await.unwrap();
        let exporter = ManagerExporter::new(store).with_fair_share(
            Some(FairShareConfig::default()),
            Arc::new(crate::clock::ManualClock::new(now)),
        );
        exporter.refresh().await;
        let mut text = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut text, exporter.registry())
            .unwrap();
        assert!(
            text.contains("\nongrid_fair_share_usage{group=\"cms\"} 2.0\n"),
            "{text}"
        );
        assert!(
            text.contains("\nongrid_fair_share_factor{group=\"cms\"} 0.5\n"),
            "{text}"
        );
    }

    #[tokio::test]
    async fn reserved_gpus_per_reservation_active_or_upcoming() {
        use crate::domain::policy::reservations::{ReservationName, ReservationRecord};
        use crate::domain::policy::GroupName;
        use crate::store::NodeRegistration;

        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(
            crate::store::SqliteStore::open(&dir.path().join("m.db"))
                .await
                .unwrap(),
        );
        let now = chrono::DateTime::UNIX_EPOCH + chrono::TimeDelta::days(20_000);
        let registration = NodeRegistration {
            name: NodeName::parse("node1").unwrap(),
            gpu_backend: "simulated".to_owned(),
            agent_version: "test".to_owned(),
            stream_url: None,
            start_modes: Default::default(),
        };
        let gpus = [
            gpu(1, GpuMode::Exclusive, Vec::new()).info,
            gpu(2, GpuMode::Exclusive, Vec::new()).info,
        ];
        store.register_node(registration, &gpus, now).await.unwrap();
        let hours = |h| now + chrono::TimeDelta::hours(h);
        let reservation =
            |name: &str, node: Option<&str>, on: Vec<GpuUuid>, from, to| ReservationRecord {
                name: ReservationName::parse(name).unwrap(),
                group: GroupName::parse("cms").unwrap(),
                node: node.map(|n| NodeName::parse(n).unwrap()),
                gpus: on,
                from: hours(from),
                to: hours(to),
                created_by: ongrid_core::UserName::parse("root").unwrap(),
                created_at: now,
            };
        let policy = store.gpu_policy();
        for r in [
            reservation("school", None, vec![gpus[0].uuid.clone()], -1, 1),
            reservation("hackathon", Some("node1"), Vec::new(), 2, 3),
            reservation("over", None, vec![gpus[1].uuid.clone()], -3, -2),
        ] {
            assert!(policy.add_reservation(&r).await.unwrap());
        }
        let exporter =
            ManagerExporter::new(store).with_clock(Arc::new(crate::clock::ManualClock::new(now)));
        exporter.refresh().await;
        let mut text = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut text, exporter.registry())
            .unwrap();
        assert!(text.contains("# TYPE ongrid_reserved_gpus gauge"), "{text}");
        assert!(
            text.contains(
                "\nongrid_reserved_gpus{reservation=\"school\",group=\"cms\",status=\"active\"} 1\n"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "\nongrid_reserved_gpus{reservation=\"hackathon\",group=\"cms\",status=\"upcoming\"} 2\n"
            ),
            "{text}"
        );
        assert!(!text.contains("reservation=\"over\""), "{text}");
    }

    #[test]
    fn gpus_and_mig_devices_are_counted_by_use() {
        let mig = GpuMode::Mig {
            layout: MigLayout::parse("1g.10gb*7").unwrap(),
        };
        let nodes = [NodeRecord {
            name: NodeName::parse("node1").unwrap(),
            gpu_backend: "simulated".to_owned(),
            agent_version: "0.1.0".to_owned(),
            stream_url: None,
            last_seen: chrono::DateTime::UNIX_EPOCH,
            gpus: vec![
                gpu(1, GpuMode::Exclusive, Vec::new()),
                gpu(2, GpuMode::Exclusive, Vec::new()),
                gpu(3, mig, vec![slice(3, 1), slice(3, 2), slice(3, 3)]),
            ]
            .into(),
            drain: None,
        }];
        let held_slice = slice(3, 2).uuid;
        let used: HashSet<&str> = [
            "GPU-11111111-2222-3333-4444-555555555501",
            held_slice.as_str(),
        ]
        .into_iter()
        .collect();
        let (gpus, slices) = count_gpus(&nodes, &used);
        let model = "NVIDIA A100-SXM4-40GB".to_owned();
        let whole = |mode: &str, in_use| (model.clone(), mode.to_owned(), "healthy", in_use);
        assert_eq!(
            gpus,
            BTreeMap::from([
                (whole("exclusive", "free"), 1),
                (whole("exclusive", "used"), 1),
                (whole("mig", "used"), 1),
            ])
        );
        let device = |in_use| (model.clone(), "1g.10gb".to_owned(), in_use);
        assert_eq!(
            slices,
            BTreeMap::from([(device("free"), 2), (device("used"), 1)])
        );
    }

    /// 10,000 requests with made-up methods (and unmatched paths) add at most a few series:
    /// `/metrics` stays as long as it was, give or take those.
    #[tokio::test]
    async fn invented_methods_and_paths_add_no_series() {
        fn lines() -> usize {
            let mut registry = Registry::default();
            let events = events();
            registry.register("http_requests", "", events.http_requests.clone());
            registry.register(
                "http_request_duration",
                "",
                events.http_request_duration.clone(),
            );
            let mut text = String::new();
            prometheus_client::encoding::prometheus_text::encode(&mut text, &registry).unwrap();
            text.lines().count()
        }
        let router = axum::Router::new()
            .route("/v1/nodes/{name}", axum::routing::get(|| async { "" }))
            .layer(axum::middleware::from_fn(count_requests));
        let before = lines();
        for n in 0..10_000 {
            let method = axum::http::Method::from_bytes(format!("BOGUS{n}").as_bytes()).unwrap();
            let path = if n % 2 == 0 {
                "/v1/nodes/node1".to_owned()
            } else {
                format!("/made/up/{n}")
            };
            let request = axum::http::Request::builder()
                .method(method)
                .uri(path)
                .body(axum::body::Body::empty())
                .unwrap();
            tower::ServiceExt::oneshot(router.clone(), request)
                .await
                .unwrap();
        }
        let after = lines();
        // A few new series (this test's two routes with `other`, and what tests running beside
        // it count), each a counter line and a histogram of some twenty lines: not 10,000.
        assert!(after - before <= 100, "{before} lines became {after}");
        let mut text = String::new();
        let mut registry = Registry::default();
        registry.register("http_requests", "", events().http_requests.clone());
        prometheus_client::encoding::prometheus_text::encode(&mut text, &registry).unwrap();
        assert!(
            !text.contains("BOGUS") && !text.contains("/made/up"),
            "{text}"
        );
        assert!(
            text.contains(
                r#"http_requests_total{route="/v1/nodes/{name}",method="other",status="405"} 5000"#
            ),
            "{text}"
        );
        assert!(
            text.contains(
                r#"http_requests_total{route="unmatched",method="other",status="404"} 5000"#
            ),
            "{text}"
        );
    }

    #[test]
    fn labels_come_from_closed_sets() {
        use axum::http::{Method, StatusCode};
        assert_eq!(method_label(&Method::GET), "GET");
        assert_eq!(method_label(&Method::PATCH), "PATCH");
        assert_eq!(
            method_label(&Method::from_bytes(b"PROPFIND").unwrap()),
            "other"
        );
        assert_eq!(status_label(StatusCode::CREATED), "201");
        assert_eq!(status_label(StatusCode::IM_A_TEAPOT), "4xx");
        assert_eq!(status_label(StatusCode::from_u16(599).unwrap()), "5xx");
        assert_eq!(route_label(None), "unmatched");
    }

    #[tokio::test]
    async fn the_metrics_are_named_by_convention_and_read_from_the_store() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(
            crate::store::SqliteStore::open(&dir.path().join("m.db"))
                .await
                .unwrap(),
        );
        let exporter = ManagerExporter::new(store.clone());
        events().held(HoldReason::Owner);
        events().queued(&queue_reasons::<()>(
            &[],
            &HashSet::new(),
            &HashMap::new(),
            &HashMap::new(),
        ));
        let router = axum::Router::new()
            .route("/v1/sessions/{name}", axum::routing::get(|| async { "" }))
            .layer(axum::middleware::from_fn(count_requests));
        let request = axum::http::Request::get("/v1/sessions/train-7f3a")
            .body(axum::body::Body::empty())
            .unwrap();
        tower::ServiceExt::oneshot(router, request).await.unwrap();
        exporter.refresh().await;
        assert_eq!(exporter.ready().await, Ok(()));
        let mut text = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut text, exporter.registry())
            .unwrap();
        for name in [
            "# TYPE ongrid_sessions gauge",
            "# TYPE ongrid_jobs gauge",
            "# TYPE ongrid_nodes gauge",
            "# TYPE ongrid_http_requests_total counter",
            "# TYPE ongrid_http_request_duration_seconds histogram",
            "# TYPE ongrid_session_holds_total counter",
            "# TYPE ongrid_session_start_duration_seconds histogram",
            "# TYPE ongrid_scheduler_plan_duration_seconds histogram",
            "# TYPE ongrid_scheduler_queued_sessions gauge",
        ] {
            assert!(text.contains(name), "{name} missing from\n{text}");
        }
        assert!(
            text.contains("ongrid_session_holds_total{reason=\"owner\"}"),
            "{text}"
        );
        assert!(
            text.contains("\nongrid_sessions{state=\"pending\"} 0\n"),
            "{text}"
        );
        assert!(
            text.contains("\nongrid_jobs{state=\"queued\"} 0\n"),
            "{text}"
        );
        assert!(text.contains("\nongrid_nodes 0\n"), "{text}");
        assert!(
            text.contains(
                "ongrid_http_requests_total{route=\"/v1/sessions/{name}\",method=\"GET\",status=\"200\"}"
            ),
            "{text}"
        );
        assert!(!text.contains("train-7f3a"), "{text}");

        // A closed database is not ready, and says so.
        store.close().await;
        let not_ready = exporter.ready().await.unwrap_err();
        assert!(
            not_ready.starts_with("the store does not answer"),
            "{not_ready}"
        );
        assert!(
            text.contains("ongrid_scheduler_queued_sessions{reason=\"no_capacity\"}"),
            "{text}"
        );
    }
}
