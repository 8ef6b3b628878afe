//! The `simulated` GPU backend: GPUs described in a TOML file, for machines with no GPU, tests
//! and the quickstart.
//!
//! ```toml
//! [[gpu]]
//! uuid = "GPU-11111111-2222-3333-4444-555555555501"
//! model = "NVIDIA A100-SXM4-40GB"
//! capability = "8.0"
//! memory = "40960MiB"
//! pci_bus_id = "00000000:07:00.0"   # optional
//! failed = "fell off the bus"       # optional: the GPU is reported unhealthy with this reason
//! xid = 79                           # optional: a fatal Xid in the kernel log for this GPU
//! utilization = 0                    # optional: percent busy, what nvidia-smi's utilization.gpu says
//! mig_fail = "In use by another client"  # optional: making a MIG layout on it, or leaving MIG mode, fails so
//! mode = "shared:4"                  # optional: the mode the manager starts it in, as `devctl admin gpu mode` writes it
//! ```
//!
//! `mode` (`exclusive`, `shared:N`, `mig:LAYOUT`, parsed by [`GpuMode`]'s `FromStr`) is
//! reported at registration ([`GpuBackend::start_modes`]); the manager gives it only to a GPU it
//! does not know yet, so an admin's later `devctl admin gpu mode` wins, as for real GPUs.
//!
//! MIG: the backend keeps each GPU's MIG devices in memory, as the driver does until a reboot.
//! [`GpuBackend::apply_mig`] checks the layout against the model's profiles (as `nvidia-smi`
//! would refuse a profile the GPU lacks), gives every device a new `MIG-<uuid>`, and discovery
//! reports them under their GPU with MIG mode on; [`GpuBackend::leave_mig`] forgets them, and
//! the GPU is reported whole again. A restarted agent starts with no MIG devices, as a rebooted
//! node does.
//!
//! A top-level `hang = true` (before the first `[[gpu]]`) stands for an nvidia-smi that does
//! not answer: every GPU is reported unknown.
//!
//! The file is read again at every discovery, so an operator or a test injects faults by editing
//! it: `failed = "..."` marks a GPU unhealthy, `xid = 79` fails it as a fatal Xid in the kernel
//! log would, `hang = true` makes every GPU's health unknown, and deleting an entry makes the
//! GPU vanish, which is reported as a failure (like a GPU falling off the bus) rather than
//! silently. Simulated GPUs
//! need no NVIDIA container runtime. Editing `utilization` makes the sessions on a GPU busy or idle
//! for the manager's idle detection (the agent reports it with each session's activity).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};

use futures::future::BoxFuture;
use ongrid_core::{
    ComputeCapability, GpuHealth, GpuInfo, GpuMode, GpuUuid, MemorySize, MigDevice, MigLayout,
    MigUuid,
};
use serde::Deserialize;

use super::{GpuBackend, GpuError, SeenGpus};

/// Why the simulated GPU file could not be used. Entries are numbered from 1 in file order.
#[derive(Debug, thiserror::Error)]
pub enum SimulatedError {
    #[error("could not read the simulated GPU file {}: create it or fix `file` in the agent's [gpu] table", file.display())]
    Read {
        file: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("simulated GPU file {} is malformed: it must hold [[gpu]] tables with uuid, model, capability and memory, and optionally pci_bus_id, failed, xid, utilization, mig_fail and mode", file.display())]
    Syntax {
        file: PathBuf,
        #[source]
        source: toml::de::Error,
    },
    #[error("[[gpu]] entry #{number} in {}: {problem}", file.display())]
    Entry {
        file: PathBuf,
        number: usize,
        problem: String,
    },
    #[error("[[gpu]] entries #{first} and #{second} in {} have the same uuid {uuid}: give each GPU its own", file.display())]
    DuplicateUuid {
        file: PathBuf,
        uuid: GpuUuid,
        first: usize,
        second: usize,
    },
}

/// The file as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SimulatedFile {
    /// nvidia-smi hangs: every GPU's health is unknown.
    #[serde(default)]
    hang: bool,
    #[serde(default)]
    gpu: Vec<Entry>,
}

/// One `[[gpu]]` table as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry {
    uuid: String,
    model: String,
    capability: String,
    memory: String,
    pci_bus_id: Option<String>,
    failed: Option<String>,
    xid: Option<u32>,
    utilization: Option<i64>,
    mig_fail: Option<String>,
    mode: Option<String>,
}

/// One simulated GPU, validated; `utilization` is in `info.utilization_percent`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimulatedGpu {
    pub info: GpuInfo,
    /// Making a MIG layout fails with this message.
    pub mig_fail: Option<String>,
    /// The mode the manager starts it in, when it does not know it yet.
    pub mode: Option<GpuMode>,
}

/// Parses and validates the contents of a simulated GPU file; `file` names it in errors.
pub fn parse(text: &str, file: &Path) -> Result<Vec<SimulatedGpu>, SimulatedError> {
    parse_file(text, file).map(|(gpus, _hang)| gpus)
}

/// The GPUs of a simulated GPU file, and whether it says nvidia-smi hangs.
fn parse_file(text: &str, file: &Path) -> Result<(Vec<SimulatedGpu>, bool), SimulatedError> {
    let contents: SimulatedFile =
        toml::from_str(text).map_err(|source| SimulatedError::Syntax {
            file: file.to_owned(),
            source,
        })?;
    let mut numbers: HashMap<GpuUuid, usize> = HashMap::new();
    let mut gpus = Vec::with_capacity(contents.gpu.len());
    for (index, entry) in contents.gpu.into_iter().enumerate() {
        let number = index + 1;
        let gpu = validate(entry).map_err(|problem| SimulatedError::Entry {
            file: file.to_owned(),
            number,
            problem,
        })?;
        if let Some(&first) = numbers.get(&gpu.info.uuid) {
            return Err(SimulatedError::DuplicateUuid {
                file: file.to_owned(),
                uuid: gpu.info.uuid,
                first,
                second: number,
            });
        }
        numbers.insert(gpu.info.uuid.clone(), number);
        gpus.push(gpu);
    }
    Ok((gpus, contents.hang))
}

/// Reads and validates a simulated GPU file now, blocking: for start-up checks.
pub fn load(file: &Path) -> Result<Vec<SimulatedGpu>, SimulatedError> {
    let text = std::fs::read_to_string(file).map_err(|source| SimulatedError::Read {
        file: file.to_owned(),
        source,
    })?;
    parse(&text, file)
}

/// One entry as core types, or what is wrong with it.
fn validate(entry: Entry) -> Result<SimulatedGpu, String> {
    let non_empty = |name: &str, value: Option<String>| match value {
        Some(value) if value.trim().is_empty() => {
            Err(format!("{name} must not be empty: leave it out instead"))
        }
        other => Ok(other.map(|value| value.trim().to_owned())),
    };
    let uuid = GpuUuid::parse(entry.uuid.trim()).map_err(|error| error.to_string())?;
    let model = non_empty("model", Some(entry.model))?.unwrap_or_default();
    let capability =
        ComputeCapability::parse(&entry.capability).map_err(|error| error.to_string())?;
    let memory = MemorySize::parse(&entry.memory).map_err(|error| error.to_string())?;
    let pci_bus_id = non_empty("pci_bus_id", entry.pci_bus_id)?;
    let mig_fail = non_empty("mig_fail", entry.mig_fail)?;
    let mode = entry
        .mode
        .map(|text| {
            let mode: GpuMode = text.parse().map_err(|e| format!("mode: {e}"))?;
            if let Some(layout) = mode.mig_layout() {
                layout
                    .validate_for(&model)
                    .map_err(|e| format!("mode {mode} on {model}: {e}"))?;
            }
            Ok::<_, String>(mode)
        })
        .transpose()?;
    let xid = entry
        .xid
        .map(|code| {
            super::health::FATAL_XIDS
                .iter()
                .find(|(fatal, _)| *fatal == code)
                .map(|(_, meaning)| format!("Xid {code} (simulated): {meaning}"))
                .ok_or_else(|| {
                    let fatal: Vec<String> = super::health::FATAL_XIDS
                        .iter()
                        .map(|(code, _)| code.to_string())
                        .collect();
                    format!(
                        "xid {code} does not fail a GPU; use one of {}",
                        fatal.join(", ")
                    )
                })
        })
        .transpose()?;
    let health = match (non_empty("failed", entry.failed)?, xid) {
        (Some(reason), _) | (None, Some(reason)) => GpuHealth::Failed(reason),
        (None, None) => GpuHealth::Healthy,
    };
    let utilization = entry
        .utilization
        .map(|percent| {
            u32::try_from(percent)
                .ok()
                .filter(|&percent| percent <= 100)
                .ok_or_else(|| format!("utilization {percent} must be a percentage from 0 to 100"))
        })
        .transpose()?;
    Ok(SimulatedGpu {
        info: GpuInfo {
            uuid,
            model,
            capability,
            memory,
            pci_bus_id,
            driver_version: None,
            mig_enabled: false,
            health,
            utilization_percent: utilization,
            mig_devices: Vec::new(),
            mig_waiting: None,
        },
        mig_fail,
        mode,
    })
}

/// Discovers the GPUs listed in a TOML file, read again at every discovery.
pub struct SimulatedBackend {
    file: PathBuf,
    seen: SeenGpus,
    /// The MIG devices made so far, per GPU.
    mig: Mutex<HashMap<GpuUuid, Vec<MigDevice>>>,
    /// The `mode` of each GPU in the file at the last discovery.
    start_modes: Mutex<BTreeMap<GpuUuid, GpuMode>>,
}

impl SimulatedBackend {
    pub fn new(file: PathBuf) -> Self {
        Self {
            file,
            seen: SeenGpus::default(),
            mig: Mutex::default(),
            start_modes: Mutex::default(),
        }
    }

    async fn read(&self) -> Result<(Vec<SimulatedGpu>, bool), SimulatedError> {
        let text = tokio::fs::read_to_string(&self.file)
            .await
            .map_err(|source| SimulatedError::Read {
                file: self.file.clone(),
                source,
            })?;
        parse_file(&text, &self.file)
    }

    /// Makes `layout` on `gpu`, as `nvidia-smi mig -dci; -dgi; -cgi ... -C` would.
    pub async fn apply_layout(&self, gpu: &GpuUuid, layout: MigLayout) -> Result<(), GpuError> {
        let fail = |problem: String| GpuError::Mig {
            gpu: gpu.clone(),
            layout,
            problem,
        };
        let (gpus, _) = self.read().await?;
        let entry = gpus
            .iter()
            .find(|g| &g.info.uuid == gpu)
            .ok_or_else(|| fail("no such GPU in the simulated GPU file".to_owned()))?;
        if let Some(problem) = &entry.mig_fail {
            // Half made: the old devices are gone, the new ones never came.
            self.mig
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .insert(gpu.clone(), Vec::new());
            return Err(fail(format!("{problem} (simulated: mig_fail)")));
        }
        layout
            .validate_for(&entry.info.model)
            .map_err(|e| fail(e.to_string()))?;
        let devices = layout
            .instances()
            .into_iter()
            .map(|profile| MigDevice {
                uuid: MigUuid::parse(&format!("MIG-{}", uuid::Uuid::new_v4()))
                    .expect("a v4 UUID is a MIG UUID body"),
                profile,
                memory: profile.nominal_memory(),
                parent: gpu.clone(),
            })
            .collect();
        self.mig
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(gpu.clone(), devices);
        Ok(())
    }

    /// Takes `gpu` out of MIG mode, as `nvidia-smi mig -dci; -dgi; -i GPU -mig 0` would: its
    /// devices are gone and it is a whole GPU again. `mig_fail` in its entry makes this fail
    /// too, leaving the devices as they are.
    pub async fn leave(&self, gpu: &GpuUuid) -> Result<(), GpuError> {
        let fail = |problem: String| GpuError::MigOff {
            gpu: gpu.clone(),
            problem,
        };
        let (gpus, _) = self.read().await?;
        let entry = gpus
            .iter()
            .find(|g| &g.info.uuid == gpu)
            .ok_or_else(|| fail("no such GPU in the simulated GPU file".to_owned()))?;
        if let Some(problem) = &entry.mig_fail {
            return Err(fail(format!("{problem} (simulated: mig_fail)")));
        }
        self.mig
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(gpu);
        Ok(())
    }

    /// The GPUs the file lists now, plus those it listed before, marked failed.
    pub async fn discover_gpus(&self) -> Result<Vec<GpuInfo>, SimulatedError> {
        let text = tokio::fs::read_to_string(&self.file)
            .await
            .map_err(|source| SimulatedError::Read {
                file: self.file.clone(),
                source,
            })?;
        let (gpus, hang) = parse_file(&text, &self.file)?;
        *self
            .start_modes
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = gpus
            .iter()
            .filter_map(|gpu| Some((gpu.info.uuid.clone(), gpu.mode?)))
            .collect();
        let mig = self
            .mig
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let present = gpus
            .into_iter()
            .map(|gpu| {
                let mut info = gpu.info;
                if let Some(devices) = mig.get(&info.uuid) {
                    info.mig_enabled = true;
                    info.utilization_percent = None;
                    info.mig_devices = devices.clone();
                }
                info
            })
            .collect();
        let gone_reason = format!(
            "not in the simulated GPU file {} any more: fallen off the bus (simulated)",
            self.file.display()
        );
        let mut report = self.seen.report(present, &gone_reason);
        if hang {
            let reason = format!(
                "nvidia-smi does not answer (simulated: hang = true in {})",
                self.file.display()
            );
            for gpu in &mut report {
                gpu.health = GpuHealth::Unknown(reason.clone());
                gpu.utilization_percent = None;
            }
        }
        Ok(report)
    }
}

impl GpuBackend for SimulatedBackend {
    fn kind(&self) -> &'static str {
        "simulated"
    }

    fn needs_nvidia_runtime(&self) -> bool {
        false
    }

    fn discover(&self) -> BoxFuture<'_, Result<Vec<GpuInfo>, GpuError>> {
        Box::pin(async move { Ok(self.discover_gpus().await?) })
    }

    fn apply_mig<'a>(
        &'a self,
        gpu: &'a GpuInfo,
        layout: MigLayout,
    ) -> BoxFuture<'a, Result<(), GpuError>> {
        Box::pin(self.apply_layout(&gpu.uuid, layout))
    }

    fn leave_mig<'a>(&'a self, gpu: &'a GpuInfo) -> BoxFuture<'a, Result<(), GpuError>> {
        Box::pin(self.leave(&gpu.uuid))
    }

    fn start_modes(&self) -> BTreeMap<GpuUuid, GpuMode> {
        self.start_modes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A100: &str = "GPU-11111111-2222-3333-4444-555555555501";
    const H100: &str = "GPU-11111111-2222-3333-4444-555555555502";

    /// The example of the brief, verbatim.
    const EXAMPLE: &str = r#"
[[gpu]]
uuid = "GPU-11111111-2222-3333-4444-555555555501"
model = "NVIDIA A100-SXM4-40GB"
capability = "8.0"
memory = "40960MiB"
pci_bus_id = "00000000:07:00.0"   # optional
failed = "fell off the bus"       # optional: the GPU is reported unhealthy with this reason
utilization = 0                    # optional, percent
"#;

    fn entry(uuid: &str, model: &str, extra: &str) -> String {
        format!(
            "[[gpu]]\nuuid = \"{uuid}\"\nmodel = \"{model}\"\ncapability = \"9.0\"\nmemory = \"81559MiB\"\n{extra}\n"
        )
    }

    fn file() -> &'static Path {
        Path::new("/etc/ongrid/simulated-gpus.toml")
    }

    #[test]
    fn parses_the_documented_example() {
        let gpus = parse(EXAMPLE, file()).unwrap();
        assert_eq!(
            gpus,
            [SimulatedGpu {
                info: GpuInfo {
                    uuid: GpuUuid::parse(A100).unwrap(),
                    model: "NVIDIA A100-SXM4-40GB".into(),
                    capability: ComputeCapability::new(8, 0),
                    memory: MemorySize::from_mib(40_960),
                    pci_bus_id: Some("00000000:07:00.0".into()),
                    driver_version: None,
                    mig_enabled: false,
                    health: GpuHealth::Failed("fell off the bus".into()),
                    utilization_percent: Some(0),
                    mig_devices: Vec::new(),
                    mig_waiting: None,
                },
                mig_fail: None,
                mode: None,
            }]
        );
    }

    #[test]
    fn optional_fields_and_empty_files() {
        let gpus = parse(&entry(H100, "NVIDIA H100 80GB HBM3", ""), file()).unwrap();
        assert_eq!(gpus[0].info.health, GpuHealth::Healthy);
        assert_eq!(gpus[0].info.pci_bus_id, None);
        assert_eq!(gpus[0].info.utilization_percent, None);
        assert_eq!(parse("", file()).unwrap(), []);
        assert_eq!(parse("# no GPUs here\n", file()).unwrap(), []);
    }

    #[test]
    fn bad_entries_are_named_by_file_and_number() {
        let good = entry(A100, "NVIDIA A100-SXM4-40GB", "");
        let cases = [
            (entry("GPU-1", "X", ""), "GPU-xxxxxxxx"),
            (entry(H100, "  ", ""), "model must not be empty"),
            (
                entry(H100, "X", "").replace("\"9.0\"", "\"nine\""),
                "compute capability",
            ),
            (
                entry(H100, "X", "").replace("81559MiB", "lots"),
                "memory size",
            ),
            (
                entry(H100, "X", "failed = \"\""),
                "failed must not be empty",
            ),
            (entry(H100, "X", "pci_bus_id = \" \""), "pci_bus_id"),
            (entry(H100, "X", "utilization = 101"), "from 0 to 100"),
            (entry(H100, "X", "utilization = -1"), "from 0 to 100"),
            (
                entry(H100, "X", "mode = \"shared:1\""),
                "\"shared:N\" with N from 2",
            ),
            (
                entry(H100, "X", "mode = \"half\""),
                "mode: GPU mode \"half\"",
            ),
            (
                entry(H100, "NVIDIA H100 80GB HBM3", "mode = \"mig:1g.5gb*7\""),
                "mode mig:1g.5gb*7 on NVIDIA H100 80GB HBM3",
            ),
        ];
        for (bad, expected) in cases {
            let err = parse(&format!("{good}{bad}"), file()).unwrap_err();
            assert!(
                matches!(err, SimulatedError::Entry { number: 2, .. }),
                "{bad}: {err:?}"
            );
            let message = err.to_string();
            assert!(message.contains("entry #2"), "{message}");
            assert!(message.contains("simulated-gpus.toml"), "{message}");
            assert!(message.contains(expected), "{message}");
        }
    }

    /// `mode` is parsed as `devctl admin gpu mode` writes it, and each discovery gives the
    /// modes of the GPUs the file lists then.
    #[tokio::test]
    async fn a_gpu_may_ask_to_start_shared_or_in_mig_mode() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("gpus.toml");
        let a100 = entry(A100, "NVIDIA A100-SXM4-40GB", "mode = \"shared:4\"");
        let h100 = entry(H100, "NVIDIA H100 80GB HBM3", "mode = \"mig:3g.40gb*2\"");
        std::fs::write(&path, format!("{a100}{h100}")).unwrap();
        let backend = SimulatedBackend::new(path.clone());
        assert!(backend.start_modes().is_empty(), "nothing read yet");
        backend.discover_gpus().await.unwrap();
        let modes = backend.start_modes();
        assert_eq!(
            modes.get(&GpuUuid::parse(A100).unwrap()),
            Some(&GpuMode::Shared { max_sessions: 4 })
        );
        assert_eq!(
            modes
                .get(&GpuUuid::parse(H100).unwrap())
                .map(ToString::to_string)
                .as_deref(),
            Some("mig:3g.40gb*2")
        );
        std::fs::write(&path, entry(A100, "NVIDIA A100-SXM4-40GB", "")).unwrap();
        backend.discover_gpus().await.unwrap();
        assert!(backend.start_modes().is_empty());
    }

    #[test]
    fn unknown_fields_and_duplicates_are_refused() {
        let typo = entry(A100, "X", "utilisation = 3");
        let err = parse(&typo, file()).unwrap_err();
        assert!(matches!(err, SimulatedError::Syntax { .. }), "{err:?}");
        let SimulatedError::Syntax { source, .. } = &err else {
            unreachable!()
        };
        assert!(source.to_string().contains("utilisation"), "{source}");

        let err = parse("[gpus]\n", file()).unwrap_err();
        assert!(matches!(err, SimulatedError::Syntax { .. }), "{err:?}");

        let twice = format!("{}{}", entry(A100, "X", ""), entry(A100, "Y", ""));
        let err = parse(&twice, file()).unwrap_err();
        assert!(
            matches!(
                err,
                SimulatedError::DuplicateUuid {
                    first: 1,
                    second: 2,
                    ..
                }
            ),
            "{err:?}"
        );
    }

    #[tokio::test]
    async fn faults_are_injected_by_editing_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("gpus.toml");
        let a100 = |extra: &str| entry(A100, "NVIDIA A100-SXM4-40GB", extra);
        let h100 = entry(H100, "NVIDIA H100 80GB HBM3", "utilization = 87");
        std::fs::write(&path, format!("{}{h100}", a100("utilization = 3"))).unwrap();
        let backend = SimulatedBackend::new(path.clone());

        let before = backend.discover_gpus().await.unwrap();
        assert_eq!(before.len(), 2);
        assert!(before.iter().all(|gpu| gpu.health.is_healthy()));
        let a100_uuid = GpuUuid::parse(A100).unwrap();
        let h100_uuid = GpuUuid::parse(H100).unwrap();
        let utilization = |gpus: &[GpuInfo]| -> Vec<Option<u32>> {
            gpus.iter().map(|gpu| gpu.utilization_percent).collect()
        };
        assert_eq!(utilization(&before), [Some(3), Some(87)]);

        // The A100 reports a failure; the H100 disappears from the file.
        std::fs::write(&path, a100("failed = \"Xid 79\"")).unwrap();
        let after = backend.discover_gpus().await.unwrap();
        assert_eq!(after.len(), 2);
        assert_eq!(after[0].uuid, a100_uuid);
        assert_eq!(after[0].health, GpuHealth::Failed("Xid 79".into()));
        assert_eq!(after[1].uuid, h100_uuid);
        assert_eq!(after[1].model, "NVIDIA H100 80GB HBM3");
        let GpuHealth::Failed(reason) = &after[1].health else {
            panic!("{:?}", after[1]);
        };
        assert!(reason.contains("fallen off the bus"), "{reason}");
        assert!(reason.contains("gpus.toml"), "{reason}");
        // Nothing is known of a vanished GPU's utilisation.
        assert_eq!(utilization(&after), [None, None]);

        // Both come back healthy.
        std::fs::write(&path, format!("{}{h100}", a100(""))).unwrap();
        let back = backend.discover_gpus().await.unwrap();
        assert!(back.iter().all(|gpu| gpu.health.is_healthy()), "{back:?}");

        assert_eq!(utilization(&back), [None, Some(87)]);

        // Utilisation is read again at every discovery, like the rest.
        std::fs::write(&path, format!("{}{h100}", a100("utilization = 99"))).unwrap();
        let busy = backend.discover_gpus().await.unwrap();
        assert_eq!(utilization(&busy), [Some(99), Some(87)]);

        // A fatal Xid fails the GPU; one that does not fail a GPU is refused.
        std::fs::write(&path, format!("{}{h100}", a100("xid = 79"))).unwrap();
        let xid = backend.discover_gpus().await.unwrap();
        assert_eq!(
            xid[0].health,
            GpuHealth::Failed("Xid 79 (simulated): GPU has fallen off the bus".into())
        );
        std::fs::write(&path, a100("xid = 13")).unwrap();
        let err = backend.discover_gpus().await.unwrap_err();
        assert!(
            err.to_string().contains("xid 13 does not fail a GPU"),
            "{err}"
        );

        // nvidia-smi hangs: every GPU is unknown, never healthy.
        std::fs::write(&path, format!("hang = true\n{}{h100}", a100(""))).unwrap();
        let hung = backend.discover_gpus().await.unwrap();
        assert_eq!(hung.len(), 2);
        for gpu in &hung {
            let GpuHealth::Unknown(reason) = &gpu.health else {
                panic!("{gpu:?}");
            };
            assert!(
                reason.starts_with("nvidia-smi does not answer (simulated"),
                "{reason}"
            );
        }

        // A broken file is an error.
        std::fs::write(&path, "[[gpu]]\nuuid = 1\n").unwrap();
        let err = backend.discover().await.unwrap_err();
        assert!(err.to_string().contains("gpus.toml"), "{err}");
    }

    #[tokio::test]
    async fn a_missing_file_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nowhere.toml");
        let err = SimulatedBackend::new(path).discover().await.unwrap_err();
        let message = err.to_string();
        assert!(message.contains("nowhere.toml"), "{message}");
        assert!(message.contains("create it"), "{message}");
    }
}
