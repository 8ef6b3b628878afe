//! The manager's `/metrics` as a scrape reads it: sessions and jobs by state, GPUs by model, mode,
//! health and use, MIG devices, nodes, the GPUs each reservation that has not ended holds, and
//! each accounting group's fair share, read from the store at each scrape
//! ([`ManagerExporter::refresh`]), beside the events counted where they happen
//! ([`crate::metrics::events`]). `/readyz` says whether the store answers.

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use ongrid_core::reservation::ReservationStatus;
use ongrid_core::{GpuHealth, GpuId, JobState, SessionState};
use ongrid_service::metrics::{Exporter, ExporterFuture};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::{Registry, Unit};

use crate::clock::Clock;
use crate::domain::policy::fairshare::FairShareConfig;
use crate::metrics::{events, GpuLabels, GroupLabels, MigLabels, ReservationLabels, StateLabels};
use crate::scheduling::{fair_share, gpu_policy::GpuPolicy};
use crate::store::{NodeRecord, Store};

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
        let now = self.clock.now();
        // The reads at once, none depending on another's answer: a scrape waits for the
        // longest, not for their sum, while the manager is busy. One that fails leaves every
        // series as the last scrape that read them all set it.
        let (counts, planning, policy, standings) = tokio::try_join!(
            // The counts the database keeps by state; the GPUs in use from the copies kept for
            // planning.
            self.store.state_counts(),
            // The planning read: the GPUs are read again only when the inventory changed, and
            // what is counted here (model, mode, health, MIG devices, the nodes) is part of it;
            // only the utilisation, which no series shows, may be older. No series shows a
            // node's last sync either, so none is read exactly.
            self.store
                .planning_nodes(chrono::DateTime::<chrono::Utc>::MIN_UTC),
            GpuPolicy::load(self.store.as_ref(), now),
            async {
                let Some((config, clock)) = &self.fair_share else {
                    return Ok(None);
                };
                let accounts = self.store.usage_accounts().await?;
                Ok(Some(fair_share::current(&accounts, config, clock.now())))
            },
        )?;
        let nodes = planning.nodes;

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

        if let Some(standings) = standings {
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
    let mut slices: BTreeMap<MigKey, i64> = BTreeMap::new();
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
        if !matches!(gpu.mode, ongrid_core::GpuMode::Mig { .. }) {
            continue;
        }
        for device in &gpu.info.mig_devices {
            let held = used.contains(device.uuid.as_str());
            let in_use = if held { "used" } else { "free" };
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
    use std::collections::HashMap;

    use ongrid_core::holds::HoldReason;
    use ongrid_core::{
        GpuInfo, GpuMode, GpuUuid, MemorySize, MigDevice, MigLayout, MigProfile, MigUuid, NodeName,
    };

    use super::*;
    use crate::metrics::{count_requests, queue_reasons};
    use crate::store::{fixtures, GpuRecord};

    fn gpu(n: u8, mode: GpuMode, mig_devices: Vec<MigDevice>) -> GpuRecord {
        GpuRecord {
            node: NodeName::parse("node1").unwrap(),
            info: GpuInfo {
                mig_enabled: !mig_devices.is_empty(),
                mig_devices,
                ..fixtures::gpu(n)
            },
            mode,
            drain: None,
        }
    }

    /// The exporter's metrics, refreshed from the store, as Prometheus scrapes them.
    async fn scraped(exporter: &ManagerExporter) -> String {
        exporter.refresh().await;
        let mut text = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut text, exporter.registry())
            .unwrap();
        text
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

        let (_dir, store) = fixtures::sqlite().await;
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
        let text = scraped(&exporter).await;
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

        let (_dir, store) = fixtures::sqlite().await;
        let now = chrono::DateTime::UNIX_EPOCH + chrono::TimeDelta::days(20_000);
        let registration = fixtures::registration("node1");
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
        let text = scraped(&exporter).await;
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
        let nodes = [crate::store::fixtures::node_record(
            "node1",
            chrono::DateTime::UNIX_EPOCH,
            vec![
                gpu(1, GpuMode::Exclusive, Vec::new()),
                gpu(2, GpuMode::Exclusive, Vec::new()),
                gpu(3, mig, vec![slice(3, 1), slice(3, 2), slice(3, 3)]),
            ],
        )];
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

    #[tokio::test]
    async fn the_metrics_are_named_by_convention_and_read_from_the_store() {
        let (_dir, store) = fixtures::sqlite().await;
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
        let text = scraped(&exporter).await;
        assert_eq!(exporter.ready().await, Ok(()));
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
