//! The agent's own GPU code run once from a shell, for `scripts/gpu-check.sh` on a machine with
//! real GPUs: `ongrid-agent gpus` (discovery and health through the `nvidia-smi` backend, as
//! `gpu::from_config` builds it for the sync loop), `ongrid-agent mig` (a MIG layout made, or
//! MIG mode turned off, on one GPU named by its UUID, through [`MigLayouts`] as the sync loop
//! makes an admin's change) and `ongrid-agent gpu-container` (a dev container on one GPU or MIG
//! device, created and started by the Docker runtime from [`ContainerSpec::for_session`], so it
//! carries the reconciler's `nvidia` device request).
//!
//! Nothing here runs in the agent's service: these are tools, and they print what they found
//! for the script to compare with what it reads from `nvidia-smi` itself. `--format fields`
//! prints one `UUID<TAB>FIELD<TAB>VALUE` line per value, so a shell needs nothing but `awk`.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use ongrid_core::api::{ContainerLimits, ContainerUser, DesiredSession, RunState};
use ongrid_core::{
    Dn, GpuHealth, GpuId, GpuInfo, GpuUuid, MemorySize, MigChange, MigLayout, MigModel, NodeName,
    SessionId, SessionName, UserName,
};
use serde::Serialize;

use crate::gpu::mig::{self, MigLayouts, MigWanted};
use crate::gpu::{from_config, GpuBackend, GpuBackendConfig, GpuError};
use crate::runtime::docker::DockerRuntime;
use crate::runtime::{ContainerRuntime, ContainerSpec, GpuAccess, RuntimeError};

/// Why a check command failed. The messages name the GPU and what to do.
#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    #[error(transparent)]
    Gpu(#[from] GpuError),
    #[error("nvidia-smi lists no GPU {gpu} (it lists: {listed}): give one of those UUIDs")]
    NoSuchGpu { gpu: GpuUuid, listed: String },
    #[error("GPU {gpu} is not healthy ({health}): the agent changes MIG only on healthy GPUs; see `ongrid-agent gpus`")]
    NotHealthy { gpu: GpuUuid, health: String },
    #[error("{change} on GPU {gpu} failed: {reason}")]
    ChangeFailed {
        gpu: GpuUuid,
        change: MigChange,
        reason: String,
    },
    #[error("{change} on GPU {gpu}: nvidia-smi reported no error, but discovery afterwards shows {seen}")]
    NotMade {
        gpu: GpuUuid,
        change: MigChange,
        seen: String,
    },
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    #[error("cannot write the output: {0}")]
    Output(#[from] std::io::Error),
}

/// How `nvidia-smi` is run: the `[gpu]` table of the agent's config, as options.
#[derive(Debug, Clone, clap::Args)]
pub struct NvidiaSmiArgs {
    /// The nvidia-smi binary (default: the first on PATH).
    #[arg(long, value_name = "PATH")]
    pub nvidia_smi: Option<PathBuf>,
    /// How long one run of nvidia-smi may take, e.g. "30 seconds" (default: the agent's 10 s).
    #[arg(long, value_name = "DURATION")]
    pub timeout: Option<String>,
    /// Where fatal Xid errors are read (default /dev/kmsg, where readable; "" for nowhere).
    #[arg(long, value_name = "PATH")]
    pub kernel_log: Option<PathBuf>,
}

impl NvidiaSmiArgs {
    /// The agent's config table these options stand for.
    pub fn config(&self) -> GpuBackendConfig {
        GpuBackendConfig::NvidiaSmi {
            path: self.nvidia_smi.clone(),
            timeout: self.timeout.clone(),
            kernel_log: self.kernel_log.clone(),
        }
    }
}

/// How GPUs are printed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// A JSON array of the agent's `GpuInfo`s, each with `mig_model`.
    Json,
    /// `UUID<TAB>FIELD<TAB>VALUE` lines, one value per line (a MIG device per `mig_device` line).
    Fields,
}

/// The check tools of `ongrid-agent`.
#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// Discover the GPUs and their health with the agent's nvidia-smi backend; print them.
    Gpus {
        #[command(flatten)]
        nvidia_smi: NvidiaSmiArgs,
        #[arg(long, value_enum, default_value_t = Format::Json)]
        format: Format,
    },
    /// Make a MIG layout on one GPU, or turn its MIG mode off, as the agent does.
    ///
    /// The change is made as the agent makes an admin's (nothing may run on the GPU: this
    /// command does not look), then the GPU is discovered again and printed. Needs root.
    Mig {
        #[command(flatten)]
        nvidia_smi: NvidiaSmiArgs,
        /// The GPU, by UUID.
        #[arg(long, value_name = "UUID", value_parser = GpuUuid::parse)]
        gpu: GpuUuid,
        /// The layout to make, e.g. 1g.10gb*1.
        #[arg(long, value_parser = MigLayout::parse, required_unless_present = "off", conflicts_with = "off")]
        layout: Option<MigLayout>,
        /// Destroy the GPU's MIG instances and turn MIG mode off.
        #[arg(long)]
        off: bool,
        #[arg(long, value_enum, default_value_t = Format::Json)]
        format: Format,
    },
    /// Start a dev container on one GPU or MIG device through the agent's Docker runtime.
    ///
    /// The session's spec with Docker's `nvidia` device request, on no network; its name is
    /// printed. Remove it with `docker rm -f -v NAME` and its home volume `ongrid-home-USER`
    /// with `docker volume rm`.
    GpuContainer {
        /// The node name its labels carry (`ongrid.node`), to find it by.
        #[arg(long, value_parser = NodeName::parse)]
        node: NodeName,
        /// The container's user (its home volume is `ongrid-home-USER`).
        #[arg(long, value_parser = UserName::parse)]
        user: UserName,
        #[arg(long, default_value_t = 60_123)]
        uid: u32,
        /// The GPU or MIG device, by UUID.
        #[arg(long, value_name = "UUID", value_parser = GpuId::parse)]
        gpu: GpuId,
        /// A local image with `sleep` (nothing is pulled).
        #[arg(long)]
        image: String,
    },
}

impl Command {
    /// Runs the command on a new tokio runtime; logs go to stderr (`ONGRID_LOG`, default
    /// `info`), results to stdout. 1 when it failed, with the error on stderr.
    pub fn run(self) -> ExitCode {
        ongrid_service::init_tracing();
        let runtime = match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(runtime) => runtime,
            Err(e) => {
                eprintln!("ongrid-agent: cannot start the async runtime: {e}");
                return ExitCode::FAILURE;
            }
        };
        match runtime.block_on(self.execute(&mut std::io::stdout().lock())) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                // With the causes: Docker's and nvidia-smi's own words are there.
                eprintln!("ongrid-agent: {:#}", anyhow::Error::from(e));
                ExitCode::FAILURE
            }
        }
    }

    async fn execute(self, out: &mut impl Write) -> Result<(), CheckError> {
        match self {
            Command::Gpus { nvidia_smi, format } => {
                let backend = from_config(&nvidia_smi.config())?;
                let gpus = discover(&*backend).await?;
                print(out, format, &gpus)?;
            }
            Command::Mig {
                nvidia_smi,
                gpu,
                layout,
                off: _,
                format,
            } => {
                let backend = from_config(&nvidia_smi.config())?;
                let change = layout.map_or(MigChange::Off, MigChange::Layout);
                let after = change_mig(&*backend, &gpu, change).await?;
                print(out, format, std::slice::from_ref(&after))?;
            }
            Command::GpuContainer {
                node,
                user,
                uid,
                gpu,
                image,
            } => {
                let name = start_container(ContainerCheck {
                    node,
                    user: ContainerUser { name: user, uid },
                    gpu,
                    image,
                })
                .await?;
                writeln!(out, "{name}")?;
            }
        }
        Ok(())
    }
}

/// A GPU as the check tools print it: what the backend discovered, and the MIG geometry ongrid
/// knows for its model (`None`: an admin cannot give it a `mig:` layout).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CheckedGpu {
    #[serde(flatten)]
    pub info: GpuInfo,
    pub mig_model: Option<&'static str>,
}

impl CheckedGpu {
    fn new(info: GpuInfo) -> Self {
        let mig_model = MigModel::of(&info.model).map(|model| model.name);
        Self { info, mig_model }
    }
}

/// One discovery, as the sync loop's first.
pub async fn discover(backend: &dyn GpuBackend) -> Result<Vec<CheckedGpu>, CheckError> {
    Ok(backend
        .discover()
        .await?
        .into_iter()
        .map(CheckedGpu::new)
        .collect())
}

/// Makes `change` on `gpu` as the sync loop makes an admin's ([`MigLayouts::apply`], with
/// nothing in use: the caller has made sure), then discovers again and checks that the change
/// is there: the layout's devices, or MIG mode off without devices. Returns the GPU as
/// discovered afterwards.
pub async fn change_mig(
    backend: &dyn GpuBackend,
    gpu: &GpuUuid,
    change: MigChange,
) -> Result<CheckedGpu, CheckError> {
    let before = backend.discover().await?;
    let target = find(&before, gpu)?;
    if !target.health.is_healthy() {
        return Err(CheckError::NotHealthy {
            gpu: gpu.clone(),
            health: health_text(&target.health),
        });
    }
    let (mut layouts, mut off) = (BTreeMap::new(), BTreeSet::new());
    match change {
        MigChange::Layout(layout) => {
            layouts.insert(gpu.clone(), layout);
        }
        MigChange::Off => {
            off.insert(gpu.clone());
        }
    }
    let wanted = MigWanted {
        layouts: &layouts,
        off: &off,
    };
    let mut mig_layouts = MigLayouts::default();
    mig_layouts.apply(backend, wanted, &before, &[]).await;
    if let Some(problem) = mig_layouts.failure(gpu) {
        return Err(CheckError::ChangeFailed {
            gpu: gpu.clone(),
            change,
            reason: problem.to_owned(),
        });
    }

    let after = backend.discover().await?;
    let after = find(&after, gpu)?.clone();
    if let GpuHealth::Failed(reason) | GpuHealth::Unknown(reason) = &after.health {
        return Err(CheckError::ChangeFailed {
            gpu: gpu.clone(),
            change,
            reason: format!("the GPU is not healthy afterwards: {reason}"),
        });
    }
    let made = match change {
        MigChange::Layout(layout) => mig::matches(&after, layout),
        MigChange::Off => !after.mig_enabled && after.mig_devices.is_empty(),
    };
    if !made {
        let devices: Vec<String> = after
            .mig_devices
            .iter()
            .map(|device| device.profile.to_string())
            .collect();
        return Err(CheckError::NotMade {
            gpu: gpu.clone(),
            change,
            seen: format!(
                "MIG mode {} with devices [{}]",
                if after.mig_enabled { "on" } else { "off" },
                devices.join(", ")
            ),
        });
    }
    Ok(CheckedGpu::new(after))
}

fn find<'a>(gpus: &'a [GpuInfo], gpu: &GpuUuid) -> Result<&'a GpuInfo, CheckError> {
    gpus.iter()
        .find(|info| &info.uuid == gpu)
        .ok_or_else(|| CheckError::NoSuchGpu {
            gpu: gpu.clone(),
            listed: gpus
                .iter()
                .map(|info| info.uuid.as_str())
                .collect::<Vec<_>>()
                .join(", "),
        })
}

/// What the dev container of [`start_container`] gets.
#[derive(Debug, Clone)]
pub struct ContainerCheck {
    pub node: NodeName,
    pub user: ContainerUser,
    pub gpu: GpuId,
    pub image: String,
}

/// Creates and starts a dev container on `check.gpu` the way the reconciler does for a session
/// (the runtime's `create`, which also makes the home volume and writes the user into the
/// container, then `start`), on no network: a session's own network and its firewall rules are
/// the reconciler's, and the Docker tests check them. Returns the container's name; a container
/// that does not start is removed.
pub async fn start_container(check: ContainerCheck) -> Result<String, CheckError> {
    let runtime = DockerRuntime::connect(check.node.clone()).await?;
    let spec = container_spec(&check);
    let id = runtime.create(&spec).await?;
    if let Err(e) = runtime.start(&id).await {
        let _ = runtime.remove(&id).await;
        return Err(e.into());
    }
    Ok(spec.name)
}

fn container_spec(check: &ContainerCheck) -> ContainerSpec {
    let session = DesiredSession {
        session_id: SessionId::new_random(),
        name: SessionName::parse("gpu-check").expect("a valid session name"),
        owner: Dn::parse("/CN=ongrid gpu-check").expect("a valid DN"),
        user: check.user.clone(),
        image: check.image.clone(),
        gpus: vec![check.gpu.clone()],
        run: RunState::Running,
        limits: ContainerLimits {
            millicpus: 1000,
            memory: MemorySize::from_mib(1024),
            pids: 256,
        },
        labels: BTreeMap::new(),
        resume: false,
    };
    let mut spec =
        ContainerSpec::for_session(&check.node, &session, GpuAccess::NvidiaDeviceRequest);
    spec.network = "none".to_owned();
    spec
}

/// Prints `gpus` in `format`.
pub fn print(out: &mut impl Write, format: Format, gpus: &[CheckedGpu]) -> std::io::Result<()> {
    match format {
        Format::Json => {
            serde_json::to_writer_pretty(&mut *out, gpus)?;
            writeln!(out)
        }
        Format::Fields => {
            for gpu in gpus {
                write_fields(out, gpu)?;
            }
            Ok(())
        }
    }
}

fn write_fields(out: &mut impl Write, gpu: &CheckedGpu) -> std::io::Result<()> {
    let info = &gpu.info;
    let uuid = info.uuid.as_str();
    let mut line = |field: &str, value: &str| {
        // One line per value, whatever a reason holds.
        let value: String = value
            .chars()
            .map(|c| if c.is_control() { ' ' } else { c })
            .collect();
        writeln!(out, "{uuid}\t{field}\t{value}")
    };
    let or_none = |value: &Option<String>| value.clone().unwrap_or_else(|| "-".to_owned());
    line("uuid", uuid)?;
    line("model", &info.model)?;
    line("compute_capability", &info.capability.to_string())?;
    line("memory_mib", &info.memory.mib().to_string())?;
    line("driver_version", &or_none(&info.driver_version))?;
    line("pci_bus_id", &or_none(&info.pci_bus_id))?;
    line("mig_enabled", &info.mig_enabled.to_string())?;
    line("mig_model", gpu.mig_model.unwrap_or("-"))?;
    line("health", &health_text(&info.health))?;
    for device in &info.mig_devices {
        line("mig_device", &format!("{} {}", device.uuid, device.profile))?;
    }
    Ok(())
}

/// `healthy`, `failed: REASON` or `unknown: REASON`.
fn health_text(health: &GpuHealth) -> String {
    match health {
        GpuHealth::Healthy => "healthy".to_owned(),
        GpuHealth::Failed(reason) => format!("failed: {reason}"),
        GpuHealth::Unknown(reason) => format!("unknown: {reason}"),
    }
}

#[cfg(test)]
mod tests {
    use ongrid_core::{ComputeCapability, MigDevice, MigProfile, MigUuid};

    use super::*;

    fn h100() -> GpuInfo {
        GpuInfo {
            uuid: GpuUuid::parse("GPU-e4e4ec77-5783-45e9-8661-0b309a7e88d9").unwrap(),
            model: "NVIDIA H100 80GB HBM3".into(),
            capability: ComputeCapability::new(9, 0),
            memory: MemorySize::from_mib(81_559),
            pci_bus_id: Some("00000000:18:00.0".into()),
            driver_version: None,
            mig_enabled: true,
            health: GpuHealth::Failed("Xid 79\nat 10:00".into()),
            utilization_percent: None,
            mig_devices: vec![MigDevice {
                uuid: MigUuid::parse("MIG-5044c94d-ebd8-5d4e-95cd-24eadd74ac6d").unwrap(),
                profile: MigProfile::parse("3g.40gb").unwrap(),
                memory: MemorySize::from_mib(40_960),
                parent: GpuUuid::parse("GPU-e4e4ec77-5783-45e9-8661-0b309a7e88d9").unwrap(),
            }],
            mig_waiting: None,
        }
    }

    #[test]
    fn fields_are_one_value_per_line() {
        let mut out = Vec::new();
        print(&mut out, Format::Fields, &[CheckedGpu::new(h100())]).unwrap();
        let uuid = "GPU-e4e4ec77-5783-45e9-8661-0b309a7e88d9";
        let expected: String = [
            ("uuid", uuid),
            ("model", "NVIDIA H100 80GB HBM3"),
            ("compute_capability", "9.0"),
            ("memory_mib", "81559"),
            ("driver_version", "-"),
            ("pci_bus_id", "00000000:18:00.0"),
            ("mig_enabled", "true"),
            ("mig_model", "H100-80GB"),
            ("health", "failed: Xid 79 at 10:00"),
            (
                "mig_device",
                "MIG-5044c94d-ebd8-5d4e-95cd-24eadd74ac6d 3g.40gb",
            ),
        ]
        .iter()
        .map(|(field, value)| format!("{uuid}\t{field}\t{value}\n"))
        .collect();
        assert_eq!(String::from_utf8(out).unwrap(), expected);
    }

    #[test]
    fn json_is_the_gpu_info_with_its_mig_model() {
        let mut out = Vec::new();
        let unknown = GpuInfo {
            model: "Tesla T4".into(),
            ..h100()
        };
        print(&mut out, Format::Json, &[CheckedGpu::new(unknown.clone())]).unwrap();
        let value: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(value[0]["mig_model"], serde_json::Value::Null);
        let info: Vec<GpuInfo> = serde_json::from_value(value).unwrap();
        assert_eq!(info, [unknown]);
    }

    #[test]
    fn the_check_container_is_a_session_container_on_no_network() {
        let check = ContainerCheck {
            node: NodeName::parse("gpu-check-1").unwrap(),
            user: ContainerUser {
                name: UserName::parse("gc1").unwrap(),
                uid: 60_123,
            },
            gpu: GpuId::parse("MIG-5044c94d-ebd8-5d4e-95cd-24eadd74ac6d").unwrap(),
            image: "ubuntu:24.04".into(),
        };
        let spec = container_spec(&check);
        assert_eq!(spec.gpu_access, GpuAccess::NvidiaDeviceRequest);
        assert_eq!(spec.gpus, std::slice::from_ref(&check.gpu));
        assert_eq!(spec.network, "none");
        assert_eq!(spec.labels[crate::labels::LABEL_NODE], "gpu-check-1");
        assert!(spec
            .env
            .contains(&("NVIDIA_VISIBLE_DEVICES".to_owned(), check.gpu.to_string())));
    }
}
