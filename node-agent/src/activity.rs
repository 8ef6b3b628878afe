//! Activity sampling: how busy each running dev container was since the last sync, for the
//! manager's idle detection (`NodeReport.activity`).
//!
//! CPU: the container's cumulative CPU time (its cgroup's counter, read through
//! [`ContainerRuntime::cpu_time`]: from the host's cgroup filesystem at once, or from Docker's
//! stats, which answer in about a second, where an agent in a container of its own cannot see
//! it) is sampled at every sync; the percentage is the CPU time used between two samples over
//! the time between them, 100 = one core busy. A container's first sample only sets the
//! baseline, so it is reported from its second sync on; a counter that went backwards (the
//! container restarted) starts a new baseline.
//!
//! GPU: the highest utilisation among the session's GPUs (from the container's `ongrid.gpus`
//! label) in the inventory the `GpuBackend` just discovered. MIG devices have no utilisation of
//! their own in nvidia-smi, and a GPU without a figure is unknown: `None` when no GPU of the
//! session has one.
//!
//! A reading that takes longer than [`CPU_READ_BUDGET`] (a busy Docker answers its stats
//! slowly, where they are what is read) is left out of this sync like a failed one: the sync
//! is also the node's heartbeat, which the manager times with `node_timeout`, and idle
//! detection only misses one sample (the next reading measures over the whole gap).
//! [`SLOW_READINGS_WARNED`] in a row are a warning: a session whose CPU use is never reported
//! may be held as idle while it computes.
//!
//! Time between samples is tokio's clock, so tests drive it with a paused clock.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use chrono::{DateTime, Utc};
use futures::future::join_all;
use ongrid_core::api::ContainerState;
use ongrid_core::holds::ContainerActivity;
use ongrid_core::{GpuId, GpuInfo, GpuUuid};
use tokio::time::Instant;
use tracing::{debug, warn};

use crate::runtime::{error_chain, ContainerRuntime, ContainerStatus};

/// How long one container's CPU reading may take before the sync goes on without it.
pub const CPU_READ_BUDGET: Duration = Duration::from_secs(2);

/// One reading of a container's CPU counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuSample {
    /// CPU time used since the container started.
    pub used: Duration,
    pub at: Instant,
}

/// CPU use between two samples in percent of one core; `None` when it cannot be told (no time
/// passed, or the counter went backwards because the container restarted).
pub fn cpu_percent(before: CpuSample, after: CpuSample) -> Option<f64> {
    let wall = after.at.checked_duration_since(before.at)?;
    let used = after.used.checked_sub(before.used)?;
    if wall.is_zero() {
        return None;
    }
    Some(used.as_secs_f64() / wall.as_secs_f64() * 100.0)
}

/// The highest utilisation among `assigned` GPUs in `inventory`; MIG devices and GPUs without
/// a figure are unknown, and `None` is returned when nothing is known.
pub fn gpu_percent(assigned: &[GpuId], inventory: &[GpuInfo]) -> Option<f64> {
    let by_uuid: HashMap<&GpuUuid, &GpuInfo> = inventory.iter().map(|g| (&g.uuid, g)).collect();
    assigned
        .iter()
        .filter_map(|id| match id {
            GpuId::Gpu(uuid) => by_uuid.get(uuid)?.utilization_percent,
            GpuId::Mig(_) => None,
        })
        .max()
        .map(f64::from)
}

/// Slow readings in a row after which the agent warns: the session then shows no CPU use,
/// and may be held as idle although it computes.
pub const SLOW_READINGS_WARNED: u32 = 5;

/// Remembers each running container's last CPU sample between syncs.
#[derive(Debug, Default)]
pub struct ActivitySampler {
    /// By container id (a recreated container starts afresh).
    previous: HashMap<String, CpuSample>,
    /// Readings over the budget in a row, by container id.
    slow: HashMap<String, u32>,
}

impl ActivitySampler {
    pub fn new() -> Self {
        Self::default()
    }

    /// Samples every running dev container among `containers`; returns the activity of those
    /// sampled before. `inventory` is the GPU discovery of this sync. A container whose CPU
    /// time cannot be read is left out (and its baseline kept).
    pub async fn sample(
        &mut self,
        runtime: &dyn ContainerRuntime,
        containers: &[ContainerStatus],
        inventory: &[GpuInfo],
        now: DateTime<Utc>,
    ) -> Vec<ContainerActivity> {
        let running: Vec<&ContainerStatus> = containers
            .iter()
            .filter(|c| c.state == ContainerState::Running && c.dev_container_of().is_some())
            .collect();
        let readings = join_all(running.iter().map(|c| async move {
            let used = tokio::time::timeout(CPU_READ_BUDGET, runtime.cpu_time(c)).await;
            (used, Instant::now())
        }))
        .await;

        let running_ids: HashSet<&str> = running.iter().map(|c| c.id.as_str()).collect();
        let mut activity = Vec::new();
        let mut next = HashMap::new();
        for (container, (used, at)) in running.into_iter().zip(readings) {
            let Some(session_id) = container.dev_container_of() else {
                continue;
            };
            let sample = match used {
                Ok(Ok(Some(used))) => CpuSample { used, at },
                Ok(Ok(None)) => continue,
                Ok(Err(e)) => {
                    debug!(session = %session_id, container = %container.id, error = %error_chain(&e),
                           "Cannot read the container's CPU time; not reporting its activity this time.");
                    if let Some(previous) = self.previous.get(&container.id) {
                        next.insert(container.id.clone(), *previous);
                    }
                    continue;
                }
                Err(_) => {
                    let in_a_row = self.slow.entry(container.id.clone()).or_default();
                    *in_a_row += 1;
                    if *in_a_row == SLOW_READINGS_WARNED {
                        warn!(session = %session_id, container = %container.id, budget = ?CPU_READ_BUDGET, in_a_row = *in_a_row,
                              "Docker keeps answering the container's CPU time too slowly: its CPU use is not reported, so idle detection sees only its connections and GPUs. Check the Docker daemon's load.");
                    } else {
                        debug!(session = %session_id, container = %container.id, budget = ?CPU_READ_BUDGET,
                               "Reading the container's CPU time took too long; not reporting its activity this time.");
                    }
                    if let Some(previous) = self.previous.get(&container.id) {
                        next.insert(container.id.clone(), *previous);
                    }
                    continue;
                }
            };
            self.slow.remove(&container.id);
            let before = self.previous.get(&container.id).copied();
            next.insert(container.id.clone(), sample);
            let Some(cpu_percent) = before.and_then(|before| cpu_percent(before, sample)) else {
                continue;
            };
            let gpus = container.gpus.as_deref().unwrap_or_default();
            activity.push(ContainerActivity {
                session_id,
                sampled_at: now,
                cpu_percent,
                gpu_percent: gpu_percent(gpus, inventory),
            });
        }
        // Counts of containers that no longer run go.
        self.slow.retain(|id, _| running_ids.contains(id.as_str()));
        self.previous = next;
        activity
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use ongrid_core::{ComputeCapability, GpuHealth, MemorySize};

    use super::*;
    use crate::runtime::fake::FakeRuntime;

    const GPU_A: &str = "GPU-11111111-2222-3333-4444-555555555501";
    const GPU_B: &str = "GPU-11111111-2222-3333-4444-555555555502";
    const MIG: &str = "MIG-c7384736-a75d-5afc-978f-d2f1294409fd";

    fn gpu(uuid: &str, utilization: Option<u32>) -> GpuInfo {
        GpuInfo {
            uuid: GpuUuid::parse(uuid).unwrap(),
            model: "NVIDIA A100-SXM4-40GB".into(),
            capability: ComputeCapability::new(8, 0),
            memory: MemorySize::from_mib(40_960),
            pci_bus_id: None,
            driver_version: None,
            mig_enabled: false,
            health: GpuHealth::Healthy,
            utilization_percent: utilization,
            mig_devices: Vec::new(),
            mig_waiting: None,
        }
    }

    fn ids(ids: &[&str]) -> Vec<GpuId> {
        ids.iter().map(|id| GpuId::parse(id).unwrap()).collect()
    }

    #[test]
    fn cpu_percent_is_cpu_time_over_wall_time() {
        let start = Instant::now();
        let sample = |used_ms: u64, at_ms: u64| CpuSample {
            used: Duration::from_millis(used_ms),
            at: start + Duration::from_millis(at_ms),
        };
        assert_eq!(cpu_percent(sample(0, 0), sample(500, 1000)), Some(50.0));
        assert_eq!(
            cpu_percent(sample(1000, 0), sample(5000, 2000)),
            Some(200.0)
        );
        assert_eq!(cpu_percent(sample(0, 0), sample(0, 1000)), Some(0.0));
        assert_eq!(cpu_percent(sample(0, 0), sample(10, 0)), None, "no time");
        assert_eq!(
            cpu_percent(sample(900, 0), sample(10, 1000)),
            None,
            "restarted"
        );
    }

    #[test]
    fn gpu_percent_is_the_busiest_known_gpu() {
        let inventory = [gpu(GPU_A, Some(12)), gpu(GPU_B, Some(87))];
        assert_eq!(gpu_percent(&ids(&[GPU_A]), &inventory), Some(12.0));
        assert_eq!(gpu_percent(&ids(&[GPU_A, GPU_B]), &inventory), Some(87.0));
        assert_eq!(gpu_percent(&ids(&[MIG]), &inventory), None, "MIG");
        assert_eq!(gpu_percent(&ids(&[MIG, GPU_A]), &inventory), Some(12.0));
        assert_eq!(gpu_percent(&[], &inventory), None);
        let unknown = [gpu(GPU_A, None)];
        assert_eq!(gpu_percent(&ids(&[GPU_A]), &unknown), None);
        assert_eq!(gpu_percent(&ids(&[GPU_B]), &unknown), None, "not found");
    }

    #[tokio::test(start_paused = true)]
    async fn sampling_reports_from_the_second_sync_per_container() {
        let runtime = Arc::new(FakeRuntime::new());
        let busy = ongrid_core::SessionId::new_random();
        let idle = ongrid_core::SessionId::new_random();
        let busy_id = runtime.insert(&busy.container_name(), Some(busy), ContainerState::Running);
        let idle_id = runtime.insert(&idle.container_name(), Some(idle), ContainerState::Running);
        let stopped = ongrid_core::SessionId::new_random();
        runtime.insert(
            &stopped.container_name(),
            Some(stopped),
            ContainerState::Exited {
                exit_code: 143,
                oom_killed: false,
                error: None,
            },
        );
        let helper = runtime.insert("ongrid-chown-1", None, ContainerState::Running);
        runtime.set_cpu_time(&helper, Duration::from_secs(100));
        let mut containers = runtime.containers();
        for container in &mut containers {
            if container.id == busy_id {
                container.gpus = Some(ids(&[GPU_B]));
            }
        }
        let inventory = [gpu(GPU_A, Some(3)), gpu(GPU_B, Some(95))];
        let now = Utc::now();
        let mut sampler = ActivitySampler::new();

        runtime.set_cpu_time(&busy_id, Duration::from_secs(10));
        runtime.set_cpu_time(&idle_id, Duration::from_secs(10));
        let first = sampler
            .sample(&*runtime, &containers, &inventory, now)
            .await;
        assert_eq!(first, [], "a first sample is only a baseline");

        tokio::time::advance(Duration::from_secs(10)).await;
        runtime.set_cpu_time(&busy_id, Duration::from_secs(25)); // 1.5 cores
        runtime.set_cpu_time(&idle_id, Duration::from_millis(10_100)); // 1 %
        let mut second = sampler
            .sample(&*runtime, &containers, &inventory, now)
            .await;
        second.sort_by_key(|a| a.session_id != busy);
        assert_eq!(second.len(), 2, "{second:?}");
        assert_eq!(second[0].session_id, busy);
        assert!((second[0].cpu_percent - 150.0).abs() < 1e-6, "{second:?}");
        assert_eq!(second[0].gpu_percent, Some(95.0));
        assert_eq!(second[0].sampled_at, now);
        assert_eq!(second[1].session_id, idle);
        assert!((second[1].cpu_percent - 1.0).abs() < 1e-6, "{second:?}");
        assert_eq!(second[1].gpu_percent, None, "no GPU label");

        // The idle one restarted: its counter went back, so it starts a new baseline.
        tokio::time::advance(Duration::from_secs(10)).await;
        runtime.set_cpu_time(&busy_id, Duration::from_secs(35));
        runtime.set_cpu_time(&idle_id, Duration::from_secs(1));
        let third = sampler
            .sample(&*runtime, &containers, &inventory, now)
            .await;
        assert_eq!(third.len(), 1, "{third:?}");
        assert!((third[0].cpu_percent - 100.0).abs() < 1e-6, "{third:?}");
    }

    /// A container whose reading is slow is left out of this sync (its baseline kept), and the
    /// sampling waits no longer than the budget for it; the others are reported.
    #[tokio::test(start_paused = true)]
    async fn a_slow_reading_is_left_out_and_does_not_hold_the_sync() {
        let runtime = Arc::new(FakeRuntime::new());
        let quick = ongrid_core::SessionId::new_random();
        let slow = ongrid_core::SessionId::new_random();
        let quick_id = runtime.insert(
            &quick.container_name(),
            Some(quick),
            ContainerState::Running,
        );
        let slow_id = runtime.insert(&slow.container_name(), Some(slow), ContainerState::Running);
        let containers = runtime.containers();
        let now = Utc::now();
        let mut sampler = ActivitySampler::new();
        runtime.set_cpu_time(&quick_id, Duration::from_secs(10));
        runtime.set_cpu_time(&slow_id, Duration::from_secs(10));
        assert_eq!(sampler.sample(&*runtime, &containers, &[], now).await, []);

        tokio::time::advance(Duration::from_secs(10)).await;
        runtime.set_cpu_time(&quick_id, Duration::from_secs(15));
        runtime.set_cpu_time(&slow_id, Duration::from_secs(20));
        runtime.delay_cpu_time(&slow_id, Duration::from_secs(30));
        let started = Instant::now();
        let second = sampler.sample(&*runtime, &containers, &[], now).await;
        assert_eq!(started.elapsed(), CPU_READ_BUDGET);
        assert_eq!(second.len(), 1, "{second:?}");
        assert_eq!(second[0].session_id, quick);
        assert!((second[0].cpu_percent - 50.0).abs() < 1e-6, "{second:?}");

        // Quick again: its use since the first sample, the kept baseline.
        runtime.delay_cpu_time(&slow_id, Duration::ZERO);
        tokio::time::advance(Duration::from_secs(8)).await;
        let third = sampler.sample(&*runtime, &containers, &[], now).await;
        let slow_seen = third.iter().find(|a| a.session_id == slow).expect("slow");
        assert!((slow_seen.cpu_percent - 50.0).abs() < 1e-6, "{third:?}");
    }
}
