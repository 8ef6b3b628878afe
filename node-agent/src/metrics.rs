//! The agent's metrics, served by `ongrid_service::metrics` on `[metrics] listen`: the
//! reconciler's container operations (create, start, stop, ...) with their latency and result,
//! freezes with their duration and image size, and the GPU backend's discoveries (`nvidia-smi`
//! or the simulated one) with their latency and failures ([`MeteredGpus`] wraps the backend).
//!
//! `/readyz` answers from [`Readiness`], which each sync sets: ready once a sync reached Docker
//! and the manager, not ready (with why) while either fails.
//!
//! The handles are process-wide, like a logger, so the reconciler and the freeze workers count
//! into them without passing a handle around; agents started in one test process share them.
//! Labels are closed sets: no session, container or image name is ever a label.

use std::sync::{Arc, LazyLock, Mutex, PoisonError};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use ongrid_core::GpuInfo;
use ongrid_service::metrics::{latency_buckets, size_buckets, Exporter, ExporterFuture};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

use crate::gpu::{GpuBackend, GpuError};

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct OperationLabels {
    /// `create`, `recreate`, `start`, `stop`, `remove`, `remove_network`.
    pub operation: &'static str,
    /// `ok` or `error`.
    pub result: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct ResultLabels {
    pub result: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct BackendLabels {
    /// `nvidia-smi` or `simulated`.
    pub backend: &'static str,
}

/// The agent's metric handles.
pub struct Events {
    operations: Family<OperationLabels, Histogram>,
    freezes: Family<ResultLabels, Histogram>,
    frozen_size: Histogram,
    gpu_discovery: Family<BackendLabels, Histogram>,
    gpu_failures: Family<BackendLabels, Counter>,
}

static EVENTS: LazyLock<Events> = LazyLock::new(|| Events {
    operations: Family::new_with_constructor(|| Histogram::new(latency_buckets())),
    // Freezes take from seconds to an hour.
    freezes: Family::new_with_constructor(|| {
        Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(
            1.0, 2.0, 13,
        ))
    }),
    frozen_size: Histogram::new(size_buckets()),
    gpu_discovery: Family::new_with_constructor(|| Histogram::new(latency_buckets())),
    gpu_failures: Family::default(),
});

/// The process-wide handles.
pub fn events() -> &'static Events {
    &EVENTS
}

impl Events {
    /// One container operation of the reconciler ended.
    pub fn container_operation(&self, operation: &'static str, elapsed: Duration, ok: bool) {
        self.operations
            .get_or_create(&OperationLabels {
                operation,
                result: if ok { "ok" } else { "error" },
            })
            .observe(elapsed.as_secs_f64());
    }

    /// A freeze ended: `size` is the SIF's size when it succeeded.
    pub fn freeze_ended(&self, elapsed: Duration, size: Option<u64>) {
        let result = if size.is_some() { "done" } else { "failed" };
        self.freezes
            .get_or_create(&ResultLabels { result })
            .observe(elapsed.as_secs_f64());
        if let Some(size) = size {
            self.frozen_size.observe(size as f64);
        }
    }
}

/// The GPU backend, timed: every discovery is observed, every failure counted.
pub struct MeteredGpus(Arc<dyn GpuBackend>);

impl MeteredGpus {
    pub fn wrap(backend: Arc<dyn GpuBackend>) -> Arc<dyn GpuBackend> {
        Arc::new(Self(backend))
    }
}

impl GpuBackend for MeteredGpus {
    fn kind(&self) -> &'static str {
        self.0.kind()
    }

    fn needs_nvidia_runtime(&self) -> bool {
        self.0.needs_nvidia_runtime()
    }

    fn discover(&self) -> BoxFuture<'_, Result<Vec<GpuInfo>, GpuError>> {
        Box::pin(async move {
            let started = Instant::now();
            let result = self.0.discover().await;
            let labels = BackendLabels {
                backend: self.0.kind(),
            };
            let events = events();
            events
                .gpu_discovery
                .get_or_create(&labels)
                .observe(started.elapsed().as_secs_f64());
            if result.is_err() {
                events.gpu_failures.get_or_create(&labels).inc();
            }
            result
        })
    }

    fn apply_mig<'a>(
        &'a self,
        gpu: &'a GpuInfo,
        layout: ongrid_core::MigLayout,
    ) -> BoxFuture<'a, Result<(), GpuError>> {
        self.0.apply_mig(gpu, layout)
    }

    fn start_modes(
        &self,
    ) -> std::collections::BTreeMap<ongrid_core::GpuUuid, ongrid_core::GpuMode> {
        self.0.start_modes()
    }

    fn leave_mig<'a>(&'a self, gpu: &'a GpuInfo) -> BoxFuture<'a, Result<(), GpuError>> {
        self.0.leave_mig(gpu)
    }
}

/// Whether the agent is ready, for `/readyz`: its last sync reached Docker and the manager.
/// Not ready before the first sync. Clones share one state.
#[derive(Debug, Clone)]
pub struct Readiness(Arc<Mutex<Result<(), String>>>);

impl Default for Readiness {
    fn default() -> Self {
        Self(Arc::new(Mutex::new(Err(
            "no sync with the manager yet".to_owned()
        ))))
    }
}

impl Readiness {
    /// What the last sync found: `Ok`, or why the agent is not ready.
    pub fn set(&self, state: Result<(), String>) {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) = state;
    }

    pub fn get(&self) -> Result<(), String> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

/// The agent's `/metrics` and `/readyz`.
pub struct AgentExporter {
    registry: Registry,
    readiness: Readiness,
}

impl AgentExporter {
    pub fn new(readiness: Readiness) -> Self {
        let events = events();
        let mut registry = Registry::with_prefix("ongrid_agent");
        registry.register_with_unit(
            "container_operation_duration",
            "Container operations of the reconciler by operation and result, with their latency",
            Unit::Seconds,
            events.operations.clone(),
        );
        registry.register_with_unit(
            "freeze_duration",
            "Freezes by result (done, failed), from start to the SIF in the image store",
            Unit::Seconds,
            events.freezes.clone(),
        );
        registry.register_with_unit(
            "frozen_image_size",
            "Size of the SIF files of finished freezes",
            Unit::Bytes,
            events.frozen_size.clone(),
        );
        registry.register_with_unit(
            "gpu_discovery_duration",
            "GPU discoveries (nvidia-smi, or the simulated backend) and their latency",
            Unit::Seconds,
            events.gpu_discovery.clone(),
        );
        registry.register(
            "gpu_discovery_failures",
            "GPU discoveries that failed (nvidia-smi missing, hung or unreadable)",
            events.gpu_failures.clone(),
        );
        Self {
            registry,
            readiness,
        }
    }
}

impl Exporter for AgentExporter {
    fn registry(&self) -> &Registry {
        &self.registry
    }

    fn ready(&self) -> ExporterFuture<'_, Result<(), String>> {
        Box::pin(std::future::ready(self.readiness.get()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Broken;

    impl GpuBackend for Broken {
        fn kind(&self) -> &'static str {
            "simulated"
        }
        fn needs_nvidia_runtime(&self) -> bool {
            false
        }
        fn discover(&self) -> BoxFuture<'_, Result<Vec<GpuInfo>, GpuError>> {
            Box::pin(async {
                Err(GpuError::Simulated(
                    crate::gpu::simulated::SimulatedError::Read {
                        file: "gpus.toml".into(),
                        source: std::io::Error::other("gone"),
                    },
                ))
            })
        }
        fn apply_mig<'a>(
            &'a self,
            _: &'a GpuInfo,
            _: ongrid_core::MigLayout,
        ) -> BoxFuture<'a, Result<(), GpuError>> {
            unreachable!("the test only discovers")
        }
        fn leave_mig<'a>(&'a self, _: &'a GpuInfo) -> BoxFuture<'a, Result<(), GpuError>> {
            unreachable!("the test only discovers")
        }
        fn start_modes(
            &self,
        ) -> std::collections::BTreeMap<ongrid_core::GpuUuid, ongrid_core::GpuMode> {
            Default::default()
        }
    }

    #[tokio::test]
    async fn discoveries_are_timed_and_failures_counted() {
        let exporter = AgentExporter::new(Readiness::default());
        let gpus = MeteredGpus::wrap(Arc::new(Broken));
        assert!(gpus.discover().await.is_err());
        events().container_operation("create", Duration::from_millis(30), true);
        events().freeze_ended(Duration::from_secs(12), Some(3 << 20));
        let mut text = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut text, exporter.registry())
            .unwrap();
        for name in [
            "# TYPE ongrid_agent_container_operation_duration_seconds histogram",
            "ongrid_agent_container_operation_duration_seconds_count{operation=\"create\",result=\"ok\"}",
            "# TYPE ongrid_agent_freeze_duration_seconds histogram",
            "ongrid_agent_freeze_duration_seconds_count{result=\"done\"}",
            "# TYPE ongrid_agent_frozen_image_size_bytes histogram",
            "ongrid_agent_gpu_discovery_duration_seconds_count{backend=\"simulated\"}",
            "ongrid_agent_gpu_discovery_failures_total{backend=\"simulated\"}",
        ] {
            assert!(text.contains(name), "{name} missing from\n{text}");
        }
    }

    #[tokio::test]
    async fn ready_only_after_a_sync_that_reached_docker_and_the_manager() {
        let readiness = Readiness::default();
        let exporter = AgentExporter::new(readiness.clone());
        assert_eq!(
            exporter.ready().await,
            Err("no sync with the manager yet".to_owned())
        );
        readiness.set(Ok(()));
        assert_eq!(exporter.ready().await, Ok(()));
        readiness.set(Err("cannot sync with the manager: 503".to_owned()));
        assert_eq!(
            exporter.ready().await,
            Err("cannot sync with the manager: 503".to_owned())
        );
    }
}
