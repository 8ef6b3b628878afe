//! GPU discovery behind one trait: [`GpuBackend`]. `nvidia-smi` on real machines
//! ([`nvidia_smi`]), `simulated` (GPUs described in a TOML file, [`simulated`]) on machines with
//! no GPU, in tests and in the quickstart.
//!
//! Both backends remember every GPU they have reported (`SeenGpus`): a GPU that vanishes (fell
//! off the bus, removed from the simulated file) is reported `Failed` rather than dropped, so the
//! manager drains it instead of forgetting it. That memory lasts as long as the agent process.

pub mod health;
pub mod mig;
pub mod nvidia_smi;
pub mod simulated;

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use futures::future::BoxFuture;
use ongrid_core::{GpuHealth, GpuInfo, GpuMode, GpuUuid};
use serde::Deserialize;
use tracing::warn;

pub use nvidia_smi::{NvidiaSmiBackend, NvidiaSmiError, NvidiaSmiSource, RealNvidiaSmi};
pub use simulated::{SimulatedBackend, SimulatedError, SimulatedGpu};

/// Why discovery failed. The messages say what to do; print the whole source chain (the parse
/// error behind [`NvidiaSmiError::Output`], the I/O error behind a read) to see the detail.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error(transparent)]
    NvidiaSmi(#[from] NvidiaSmiError),
    #[error(transparent)]
    Simulated(#[from] SimulatedError),
    /// A MIG layout could not be made; the text is the backend's (nvidia-smi's) own.
    #[error("MIG layout {layout} on {gpu}: {problem}")]
    Mig {
        gpu: GpuUuid,
        layout: ongrid_core::MigLayout,
        problem: String,
    },
    /// MIG mode could not be turned off; the text is the backend's (nvidia-smi's) own.
    #[error("MIG mode off on {gpu}: {problem}")]
    MigOff { gpu: GpuUuid, problem: String },
}

/// A source of the node's GPU inventory and health.
pub trait GpuBackend: Send + Sync + 'static {
    /// `nvidia-smi` or `simulated`; reported to the manager.
    fn kind(&self) -> &'static str;

    /// Whether dev containers need Docker's `nvidia` device request (only for real GPUs).
    fn needs_nvidia_runtime(&self) -> bool;

    /// The GPUs present now, with their health. A GPU seen by an earlier discovery that has
    /// disappeared is still listed, with its last known properties and `GpuHealth::Failed`.
    fn discover(&self) -> BoxFuture<'_, Result<Vec<GpuInfo>, GpuError>>;

    /// Partitions `gpu` into the MIG devices of `layout`: MIG mode on, the GPU's current
    /// compute and GPU instances destroyed, the layout's instances created in its order. Called
    /// only when no container uses the GPU. The next discovery reports the new devices.
    fn apply_mig<'a>(
        &'a self,
        gpu: &'a GpuInfo,
        layout: ongrid_core::MigLayout,
    ) -> BoxFuture<'a, Result<(), GpuError>>;

    /// Takes `gpu` out of MIG mode: its compute and GPU instances destroyed, MIG mode off, so
    /// it is a whole GPU again. Called only when no container uses the GPU or its devices. A
    /// change the driver leaves pending (a GPU reset or reboot needed) is an error.
    fn leave_mig<'a>(&'a self, gpu: &'a GpuInfo) -> BoxFuture<'a, Result<(), GpuError>>;

    /// The modes the last discovery asked GPUs to start in (the simulated file's `mode`),
    /// reported at registration: the manager gives one only to a GPU it does not know yet.
    fn start_modes(&self) -> BTreeMap<GpuUuid, GpuMode>;
}

/// The `[gpu]` table of the agent's config.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(tag = "backend", rename_all = "kebab-case", deny_unknown_fields)]
pub enum GpuBackendConfig {
    /// Runs `nvidia-smi` (found on PATH unless `path` is given), killed after `timeout`
    /// (default 10 seconds), and watches `kernel_log` (default `/dev/kmsg`, read where
    /// permitted; `""` turns it off) for fatal Xid errors.
    NvidiaSmi {
        path: Option<PathBuf>,
        #[serde(default)]
        timeout: Option<String>,
        #[serde(default)]
        kernel_log: Option<PathBuf>,
    },
    /// Reads GPUs from a TOML file, re-read at every discovery so faults can be injected.
    Simulated { file: PathBuf },
}

/// Builds the configured backend. Checks what can be checked at start-up, so that a typo in
/// the config fails `--check-config` rather than the first discovery: that nvidia-smi exists,
/// or that the simulated GPU file reads and validates.
pub fn from_config(config: &GpuBackendConfig) -> Result<Arc<dyn GpuBackend>, GpuError> {
    match config {
        GpuBackendConfig::NvidiaSmi {
            path,
            timeout,
            kernel_log,
        } => {
            let path = match path {
                Some(path) if path.is_file() => path.clone(),
                Some(path) => {
                    return Err(NvidiaSmiError::NotFound { path: path.clone() }.into());
                }
                None => find_on_path(Path::new("nvidia-smi")).ok_or_else(|| {
                    NvidiaSmiError::NotFound {
                        path: PathBuf::from("nvidia-smi (searched PATH)"),
                    }
                })?,
            };
            let timeout = match timeout {
                None => nvidia_smi::DEFAULT_TIMEOUT,
                Some(text) => ongrid_core::HumanDuration::parse(text)
                    .map_err(|error| NvidiaSmiError::BadTimeout {
                        value: text.clone(),
                        problem: error.to_string(),
                    })?
                    .as_duration(),
            };
            let kernel_log = kernel_log
                .clone()
                .unwrap_or_else(|| PathBuf::from(DEFAULT_KERNEL_LOG));
            let mut backend = NvidiaSmiBackend::new(RealNvidiaSmi::new(path).with_timeout(timeout));
            if !kernel_log.as_os_str().is_empty() {
                backend = backend.with_kernel_log(health::KernelLog::new(kernel_log));
            }
            Ok(Arc::new(backend))
        }
        GpuBackendConfig::Simulated { file } => {
            simulated::load(file)?;
            Ok(Arc::new(SimulatedBackend::new(file.clone())))
        }
    }
}

/// Where the NVIDIA driver's Xid errors are read from unless the config says otherwise.
pub const DEFAULT_KERNEL_LOG: &str = "/dev/kmsg";

/// The first file called `name` in the directories of `PATH`.
fn find_on_path(name: &Path) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
}

/// The GPUs a backend has reported, so that one which disappears is reported failed instead of
/// silently vanishing. Shared by both backends.
#[derive(Debug, Default)]
pub(crate) struct SeenGpus {
    seen: Mutex<BTreeMap<GpuUuid, Seen>>,
}

#[derive(Debug)]
struct Seen {
    /// As last reported while present.
    info: GpuInfo,
    present: bool,
}

impl SeenGpus {
    /// `present`, in its order, followed by every GPU reported before that is not in `present`,
    /// with its last known properties and `GpuHealth::Failed(gone_reason)`, in UUID order.
    pub(crate) fn report(&self, present: Vec<GpuInfo>, gone_reason: &str) -> Vec<GpuInfo> {
        self.report_with(present, |_| gone_reason.to_owned())
    }

    /// Like [`SeenGpus::report`], with the reason of each vanished GPU from `gone_reason`.
    pub(crate) fn report_with(
        &self,
        present: Vec<GpuInfo>,
        gone_reason: impl Fn(&GpuInfo) -> String,
    ) -> Vec<GpuInfo> {
        let mut seen = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
        let here: HashSet<&GpuUuid> = present.iter().map(|gpu| &gpu.uuid).collect();
        for (uuid, entry) in seen.iter_mut() {
            let is_here = here.contains(uuid);
            if entry.present && !is_here {
                let reason = gone_reason(&entry.info);
                warn!(gpu = %uuid, %reason, "GPU disappeared; reporting it failed.");
            }
            entry.present = is_here;
        }
        for gpu in &present {
            let entry = Seen {
                info: gpu.clone(),
                present: true,
            };
            seen.insert(gpu.uuid.clone(), entry);
        }
        let gone: Vec<GpuInfo> = seen
            .values()
            .filter(|entry| !entry.present)
            .map(|entry| GpuInfo {
                health: GpuHealth::Failed(gone_reason(&entry.info)),
                utilization_percent: None,
                mig_devices: Vec::new(),
                ..entry.info.clone()
            })
            .collect();
        let mut report = present;
        report.extend(gone);
        report
    }

    /// Every GPU reported before, with its last known properties and `GpuHealth::Unknown`:
    /// what to report when the GPUs cannot be asked (nvidia-smi hangs or fails without naming
    /// a GPU), so that none is taken for healthy. In UUID order; empty before any discovery.
    pub(crate) fn all_unknown(&self, reason: &str) -> Vec<GpuInfo> {
        let seen = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
        seen.values()
            .map(|entry| GpuInfo {
                health: GpuHealth::Unknown(reason.to_owned()),
                utilization_percent: None,
                mig_devices: Vec::new(),
                ..entry.info.clone()
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use ongrid_core::{ComputeCapability, MemorySize};

    use super::*;

    fn gpu(uuid_suffix: char, health: GpuHealth) -> GpuInfo {
        GpuInfo {
            uuid: GpuUuid::parse(&format!(
                "GPU-11111111-2222-3333-4444-55555555550{uuid_suffix}"
            ))
            .unwrap(),
            model: "NVIDIA A100-SXM4-40GB".into(),
            capability: ComputeCapability::new(8, 0),
            memory: MemorySize::from_mib(40_960),
            pci_bus_id: None,
            driver_version: None,
            mig_enabled: false,
            health,
            utilization_percent: Some(50),
            mig_devices: Vec::new(),
            mig_waiting: None,
        }
    }

    #[test]
    fn seen_gpus_report_the_vanished_as_failed() {
        let seen = SeenGpus::default();
        let (a, b, c) = (
            gpu('1', GpuHealth::Healthy),
            gpu('2', GpuHealth::Healthy),
            gpu('3', GpuHealth::Failed("hot".into())),
        );
        let all = vec![a.clone(), b.clone(), c.clone()];
        assert_eq!(seen.report(all.clone(), "gone"), all);

        let gone = |info: &GpuInfo| GpuInfo {
            health: GpuHealth::Failed("gone".into()),
            utilization_percent: None,
            mig_devices: Vec::new(),
            ..info.clone()
        };
        assert_eq!(
            seen.report(vec![b.clone()], "gone"),
            [b.clone(), gone(&a), gone(&c)]
        );
        assert_eq!(
            seen.report(vec![b.clone()], "gone"),
            [b.clone(), gone(&a), gone(&c)]
        );
        // Back, with what it says now.
        assert_eq!(
            seen.report(vec![c.clone(), b.clone()], "gone"),
            [c, b, gone(&a)]
        );
    }

    #[test]
    fn config_table() {
        let config: GpuBackendConfig =
            toml::from_str("backend = \"nvidia-smi\"\npath = \"/usr/bin/nvidia-smi\"").unwrap();
        assert_eq!(
            config,
            GpuBackendConfig::NvidiaSmi {
                path: Some("/usr/bin/nvidia-smi".into()),
                timeout: None,
                kernel_log: None,
            }
        );
        let config: GpuBackendConfig =
            toml::from_str("backend = \"nvidia-smi\"\ntimeout = \"5 seconds\"\nkernel_log = \"\"")
                .unwrap();
        assert_eq!(
            config,
            GpuBackendConfig::NvidiaSmi {
                path: None,
                timeout: Some("5 seconds".into()),
                kernel_log: Some("".into()),
            }
        );
        let config: GpuBackendConfig =
            toml::from_str("backend = \"simulated\"\nfile = \"/etc/gpus.toml\"").unwrap();
        assert_eq!(
            config,
            GpuBackendConfig::Simulated {
                file: "/etc/gpus.toml".into()
            }
        );
        assert!(toml::from_str::<GpuBackendConfig>("backend = \"simulated\"").is_err());
        assert!(toml::from_str::<GpuBackendConfig>("backend = \"nvml\"").is_err());
        assert!(toml::from_str::<GpuBackendConfig>(
            "backend = \"simulated\"\nfile = \"x\"\npath = \"y\""
        )
        .is_err());
    }

    #[tokio::test]
    async fn from_config_builds_the_configured_backend() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("gpus.toml");
        std::fs::write(
            &file,
            "[[gpu]]\nuuid = \"GPU-11111111-2222-3333-4444-555555555501\"\nmodel = \"NVIDIA A100-SXM4-40GB\"\ncapability = \"8.0\"\nmemory = \"40960MiB\"\n",
        )
        .unwrap();
        let backend = from_config(&GpuBackendConfig::Simulated { file: file.clone() }).unwrap();
        assert_eq!(backend.kind(), "simulated");
        assert!(!backend.needs_nvidia_runtime());
        assert_eq!(backend.discover().await.unwrap().len(), 1);

        let err = from_config(&GpuBackendConfig::Simulated {
            file: dir.path().join("missing.toml"),
        })
        .err()
        .unwrap();
        assert!(err.to_string().contains("missing.toml"), "{err}");

        // Any existing file will do as nvidia-smi at start-up; it is run at discovery.
        let backend = from_config(&GpuBackendConfig::NvidiaSmi {
            path: Some(file.clone()),
            timeout: None,
            kernel_log: None,
        })
        .unwrap();
        assert_eq!(backend.kind(), "nvidia-smi");
        assert!(backend.needs_nvidia_runtime());

        let err = from_config(&GpuBackendConfig::NvidiaSmi {
            path: Some(file.clone()),
            timeout: Some("soon".into()),
            kernel_log: None,
        })
        .err()
        .unwrap();
        assert!(err.to_string().starts_with("timeout \"soon\""), "{err}");

        let err = from_config(&GpuBackendConfig::NvidiaSmi {
            path: Some(dir.path().join("nvidia-smi")),
            timeout: None,
            kernel_log: None,
        })
        .err()
        .unwrap();
        assert!(
            matches!(err, GpuError::NvidiaSmi(NvidiaSmiError::NotFound { .. })),
            "{err:?}"
        );
        assert!(
            err.to_string().contains("install the NVIDIA driver"),
            "{err}"
        );
    }
}
