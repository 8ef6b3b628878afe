//! Pure parsers for what `nvidia-smi` prints, and the join of its two outputs into [`GpuInfo`]s.
//!
//! The backend asks two questions:
//! - `nvidia-smi --query-gpu=<fields> --format=csv,noheader,nounits`: one row per physical GPU
//!   (never per MIG device), cells joined by `", "`. Any `[...]` cell (`[N/A]`,
//!   `[Not Supported]`, `[Insufficient Permissions]`, ...) means "no value". Drivers older than
//!   R510 reject `compute_cap` (`Field "compute_cap" is not a valid field to query.`), so the
//!   fields are a parameter and [`rejected_field`] recognises that message.
//! - `nvidia-smi -L`: one `GPU n: <name> (UUID: GPU-...)` line per GPU, followed by its MIG devices
//!   `  MIG 3g.40gb     Device  0: (UUID: MIG-...)`. Older drivers print names without the
//!   `NVIDIA ` prefix, single spaces, and legacy `MIG-GPU-<uuid>/<gi>/<ci>` MIG UUIDs.
//!
//! Nothing here runs a process, so everything is tested against fixtures and property tests.

use std::collections::HashMap;
use std::sync::LazyLock;

use ongrid_core::{ComputeCapability, GpuHealth, GpuInfo, GpuUuid, MemorySize, MigUuid};
use regex::Regex;

/// Why an output of `nvidia-smi` could not be understood. Line numbers count from 1.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    #[error(
        "line {line} ({text:?}) has {found} comma-separated values where {expected} were asked for"
    )]
    WrongCellCount {
        line: usize,
        text: String,
        expected: usize,
        found: usize,
    },
    #[error("line {line} ({text:?}) has no {field} (nvidia-smi printed {printed:?}): a GPU without it cannot be offered; look at it with `nvidia-smi -q`")]
    MissingValue {
        line: usize,
        text: String,
        field: &'static str,
        printed: String,
    },
    #[error("line {line} ({text:?}) has {field} {value:?}, which is not {expected}")]
    BadValue {
        line: usize,
        text: String,
        field: &'static str,
        value: String,
        expected: &'static str,
    },
    #[error("GPU {uuid} appears twice, on lines {first} and {second}")]
    DuplicateGpu {
        uuid: GpuUuid,
        first: usize,
        second: usize,
    },
    #[error("GPU {uuid} on line {line} has no name, neither in the query nor in `nvidia-smi -L`")]
    NoName { line: usize, uuid: GpuUuid },
    #[error("GPU {uuid} ({model}) on line {line} reports no compute capability and its model is not in the table of known models: upgrade the NVIDIA driver to R510 or later, which reports compute_cap")]
    UnknownCapability {
        line: usize,
        uuid: GpuUuid,
        model: String,
    },
    #[error("line {line} ({text:?}) is neither a `GPU n: <name> (UUID: GPU-...)` line nor a `MIG <profile> Device n: (UUID: MIG-...)` line")]
    UnexpectedListLine { line: usize, text: String },
    #[error("line {line} ({text:?}) is a MIG device before any GPU line")]
    MigDeviceBeforeGpu { line: usize, text: String },
}

/// A column of `nvidia-smi --query-gpu`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Field {
    Uuid,
    Name,
    MemoryTotal,
    ComputeCap,
    DriverVersion,
    MigModeCurrent,
    PciBusId,
    /// `utilization.gpu`: percent of the last sample period a kernel ran. `[N/A]` in MIG mode.
    UtilizationGpu,
}

impl Field {
    /// Every field, in the order the backend asks for them.
    pub const ALL: [Field; 8] = [
        Field::Uuid,
        Field::Name,
        Field::MemoryTotal,
        Field::ComputeCap,
        Field::DriverVersion,
        Field::MigModeCurrent,
        Field::PciBusId,
        Field::UtilizationGpu,
    ];

    /// The name nvidia-smi knows the field by.
    pub fn as_str(self) -> &'static str {
        match self {
            Field::Uuid => "uuid",
            Field::Name => "name",
            Field::MemoryTotal => "memory.total",
            Field::ComputeCap => "compute_cap",
            Field::DriverVersion => "driver_version",
            Field::MigModeCurrent => "mig.mode.current",
            Field::PciBusId => "pci.bus_id",
            Field::UtilizationGpu => "utilization.gpu",
        }
    }

    pub fn from_name(name: &str) -> Option<Field> {
        Self::ALL.into_iter().find(|field| field.as_str() == name)
    }

    /// Whether discovery can do without the field when a driver does not know it. The UUID,
    /// name and memory it cannot.
    pub fn is_optional(self) -> bool {
        !matches!(self, Field::Uuid | Field::Name | Field::MemoryTotal)
    }
}

/// The `--query-gpu=` argument asking for `fields`.
pub fn query_argument(fields: &[Field]) -> String {
    let names: Vec<&str> = fields.iter().map(|field| field.as_str()).collect();
    format!("--query-gpu={}", names.join(","))
}

/// The field an older driver rejected, from its message
/// `Field "compute_cap" is not a valid field to query.` (printed on stdout, exit status 2).
pub fn rejected_field(output: &str) -> Option<&str> {
    static REJECTED: LazyLock<Regex> = LazyLock::new(|| {
        Regex::new(r#"Field "([^"]+)" is not a valid field to query"#).expect("constant regex")
    });
    REJECTED
        .captures(output)
        .and_then(|captures| captures.get(1))
        .map(|name| name.as_str())
}

/// One row of the GPU query: one physical GPU. Optional values are `None` when the field was not
/// asked for or nvidia-smi printed a placeholder such as `[N/A]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueryRow {
    /// Line of the output, from 1, to name the row in errors.
    pub line: usize,
    pub uuid: GpuUuid,
    pub name: Option<String>,
    pub memory: MemorySize,
    pub compute_cap: Option<ComputeCapability>,
    pub driver_version: Option<String>,
    pub mig_enabled: Option<bool>,
    pub pci_bus_id: Option<String>,
    /// Percent, 0–100.
    pub utilization: Option<u32>,
}

/// A cell's value, or `None` for a placeholder: any `[...]` (`[N/A]`, `[Not Supported]`,
/// `[Insufficient Permissions]`, `[Unknown Error]`, ...), a bare `N/A`, or nothing.
fn cell_value(cell: &str) -> Option<&str> {
    let is_placeholder = cell.is_empty()
        || cell == "N/A"
        || (cell.len() >= 2 && cell.starts_with('[') && cell.ends_with(']'));
    (!is_placeholder).then_some(cell)
}

/// Parses the output of `nvidia-smi --query-gpu=<fields> --format=csv,noheader,nounits`.
/// `fields` must name [`Field::Uuid`] and [`Field::MemoryTotal`]; a row whose UUID or memory is
/// missing is an error naming the row. Blank lines are skipped.
pub fn parse_query_gpu(output: &str, fields: &[Field]) -> Result<Vec<QueryRow>, ParseError> {
    let mut rows = Vec::new();
    for (index, raw) in output.lines().enumerate() {
        let text = raw.trim();
        if !text.is_empty() {
            rows.push(parse_query_row(index + 1, text, fields)?);
        }
    }
    Ok(rows)
}

fn parse_query_row(line: usize, text: &str, fields: &[Field]) -> Result<QueryRow, ParseError> {
    let cells: Vec<&str> = text.split(',').map(str::trim).collect();
    if cells.len() != fields.len() {
        return Err(ParseError::WrongCellCount {
            line,
            text: text.to_owned(),
            expected: fields.len(),
            found: cells.len(),
        });
    }
    let cell_of = |wanted: Field| {
        fields
            .iter()
            .position(|&field| field == wanted)
            .map(|position| cells[position])
    };
    let missing = |field: Field, printed: Option<&str>| ParseError::MissingValue {
        line,
        text: text.to_owned(),
        field: field.as_str(),
        printed: printed.unwrap_or("nothing").to_owned(),
    };
    let bad = |field: Field, value: &str, expected: &'static str| ParseError::BadValue {
        line,
        text: text.to_owned(),
        field: field.as_str(),
        value: value.to_owned(),
        expected,
    };
    // The value of a field that was asked for and printed, or None.
    let value_of = |field: Field| cell_of(field).and_then(cell_value);
    let required = |field: Field| {
        let cell = cell_of(field);
        cell.and_then(cell_value)
            .ok_or_else(|| missing(field, cell))
    };

    let uuid_text = required(Field::Uuid)?;
    let uuid = GpuUuid::parse(uuid_text)
        .map_err(|_| bad(Field::Uuid, uuid_text, "a GPU UUID (GPU-xxxxxxxx-xxxx-...)"))?;
    let memory_text = required(Field::MemoryTotal)?;
    let memory = parse_mib(memory_text).ok_or_else(|| {
        bad(
            Field::MemoryTotal,
            memory_text,
            "a whole number of MiB (was `nounits` given?)",
        )
    })?;
    let compute_cap = value_of(Field::ComputeCap)
        .map(|value| {
            ComputeCapability::parse(value)
                .map_err(|_| bad(Field::ComputeCap, value, "a capability like 8.0"))
        })
        .transpose()?;
    let mig_enabled = value_of(Field::MigModeCurrent)
        .map(|value| match value {
            "Enabled" => Ok(true),
            "Disabled" => Ok(false),
            other => Err(bad(Field::MigModeCurrent, other, "Enabled or Disabled")),
        })
        .transpose()?;
    let utilization = value_of(Field::UtilizationGpu)
        .map(|value| {
            value
                .strip_suffix('%')
                .unwrap_or(value)
                .trim()
                .parse::<u32>()
                .ok()
                .filter(|percent| *percent <= 100)
                .ok_or_else(|| bad(Field::UtilizationGpu, value, "a percentage from 0 to 100"))
        })
        .transpose()?;
    Ok(QueryRow {
        line,
        uuid,
        name: value_of(Field::Name).map(str::to_owned),
        memory,
        compute_cap,
        driver_version: value_of(Field::DriverVersion).map(str::to_owned),
        mig_enabled,
        pci_bus_id: value_of(Field::PciBusId).map(str::to_owned),
        utilization,
    })
}

/// `40960` (or `40960 MiB`, had `nounits` been forgotten) as a memory size.
fn parse_mib(value: &str) -> Option<MemorySize> {
    let digits = value.strip_suffix("MiB").unwrap_or(value).trim();
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let mib: u64 = digits.parse().ok()?;
    mib.checked_mul(1024 * 1024).map(MemorySize)
}

/// A GPU as `nvidia-smi -L` lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListedGpu {
    /// The ordinal nvidia-smi gave it. Ordinals change between boots: never an identity.
    pub index: u32,
    pub name: String,
    pub uuid: GpuUuid,
    /// Its MIG devices, in listed order; empty when MIG is disabled or no instance exists.
    pub mig_devices: Vec<ListedMigDevice>,
}

/// A MIG device (a compute instance of a GPU instance) as `nvidia-smi -L` lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListedMigDevice {
    /// The profile, e.g. `3g.40gb`, or `1c.3g.71gb` when a GPU instance is split.
    pub profile: String,
    /// The MIG device's index on its GPU (`NVIDIA_VISIBLE_DEVICES=<gpu>:<index>`).
    pub device_index: u32,
    pub uuid: MigUuid,
}

static GPU_LINE: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"^GPU ([0-9]+): (.+) \(UUID: ([^()\s]+)\)$").expect("constant regex")
});
static MIG_LINE: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"^MIG\s+(\S+)\s+Device\s+([0-9]+): \(UUID: ([^()\s]+)\)$").expect("constant regex")
});

/// Parses the output of `nvidia-smi -L`, modern or legacy. Blank lines are skipped; any other
/// line that is neither a GPU nor a MIG device is an error.
pub fn parse_list(output: &str) -> Result<Vec<ListedGpu>, ParseError> {
    let mut gpus: Vec<ListedGpu> = Vec::new();
    for (index, raw) in output.lines().enumerate() {
        let line = index + 1;
        let text = raw.trim();
        if text.is_empty() {
            continue;
        }
        let bad = |expected: &'static str, field: &'static str, value: &str| ParseError::BadValue {
            line,
            text: text.to_owned(),
            field,
            value: value.to_owned(),
            expected,
        };
        if let Some(captures) = GPU_LINE.captures(text) {
            let (index, name, uuid) = (&captures[1], &captures[2], &captures[3]);
            gpus.push(ListedGpu {
                index: index
                    .parse()
                    .map_err(|_| bad("a GPU index", "index", index))?,
                name: name.trim().to_owned(),
                uuid: GpuUuid::parse(uuid).map_err(|_| bad("a GPU UUID", "uuid", uuid))?,
                mig_devices: Vec::new(),
            });
        } else if let Some(captures) = MIG_LINE.captures(text) {
            let (profile, device_index, uuid) = (&captures[1], &captures[2], &captures[3]);
            let device = ListedMigDevice {
                profile: profile.to_owned(),
                device_index: device_index
                    .parse()
                    .map_err(|_| bad("a MIG device index", "device index", device_index))?,
                uuid: MigUuid::parse(uuid).map_err(|_| bad("a MIG UUID", "uuid", uuid))?,
            };
            let gpu = gpus
                .last_mut()
                .ok_or_else(|| ParseError::MigDeviceBeforeGpu {
                    line,
                    text: text.to_owned(),
                })?;
            gpu.mig_devices.push(device);
        } else {
            return Err(ParseError::UnexpectedListLine {
                line,
                text: text.to_owned(),
            });
        }
    }
    Ok(gpus)
}

/// Compute capability by model, for drivers older than R510 (which cannot report `compute_cap`)
/// and for a GPU that prints `[N/A]` there. The key is the model word of the name: after an
/// `NVIDIA ` or `Tesla ` prefix, up to the first space or dash (`Tesla V100-SXM2-32GB` → `V100`,
/// `NVIDIA A100 80GB PCIe` → `A100`). Values from NVIDIA's "CUDA GPUs" list. Data-centre models
/// only: anything newer than R510 reports `compute_cap` itself.
const CAPABILITY_BY_MODEL: &[(&str, ComputeCapability)] = &[
    ("P100", ComputeCapability::new(6, 0)),
    ("P40", ComputeCapability::new(6, 1)),
    ("V100", ComputeCapability::new(7, 0)),
    ("T4", ComputeCapability::new(7, 5)),
    ("A100", ComputeCapability::new(8, 0)),
    ("A30", ComputeCapability::new(8, 0)),
    ("A10", ComputeCapability::new(8, 6)),
    ("A10G", ComputeCapability::new(8, 6)),
    ("A40", ComputeCapability::new(8, 6)),
    ("L4", ComputeCapability::new(8, 9)),
    ("L40", ComputeCapability::new(8, 9)),
    ("L40S", ComputeCapability::new(8, 9)),
    ("H100", ComputeCapability::new(9, 0)),
    ("H200", ComputeCapability::new(9, 0)),
    ("GH200", ComputeCapability::new(9, 0)),
    ("B200", ComputeCapability::new(10, 0)),
];

/// The compute capability of a model named as nvidia-smi names it, from [`CAPABILITY_BY_MODEL`].
pub fn capability_from_model(name: &str) -> Option<ComputeCapability> {
    let name = name.trim();
    let name = name.strip_prefix("NVIDIA ").unwrap_or(name);
    let name = name.strip_prefix("Tesla ").unwrap_or(name);
    let model = name.split([' ', '-']).next().unwrap_or(name);
    CAPABILITY_BY_MODEL
        .iter()
        .find(|(known, _)| *known == model)
        .map(|&(_, capability)| capability)
}

/// Joins the query rows (which say which GPUs are present, and their properties) with `-L`
/// (which fills a missing name, and says MIG is on when the query could not). All GPUs are
/// `Healthy`: a GPU nvidia-smi lists is one it can talk to. A GPU listed by `-L` only (it
/// vanished between the two commands) is left out; the caller reports vanished GPUs.
pub fn join(rows: Vec<QueryRow>, listed: &[ListedGpu]) -> Result<Vec<GpuInfo>, ParseError> {
    let listed: HashMap<&GpuUuid, &ListedGpu> = listed.iter().map(|gpu| (&gpu.uuid, gpu)).collect();
    let mut lines: HashMap<GpuUuid, usize> = HashMap::new();
    let mut gpus = Vec::with_capacity(rows.len());
    for row in rows {
        if let Some(&first) = lines.get(&row.uuid) {
            return Err(ParseError::DuplicateGpu {
                uuid: row.uuid,
                first,
                second: row.line,
            });
        }
        lines.insert(row.uuid.clone(), row.line);
        let listed_gpu = listed.get(&row.uuid);
        let model = row
            .name
            .or_else(|| listed_gpu.map(|gpu| gpu.name.clone()))
            .ok_or_else(|| ParseError::NoName {
                line: row.line,
                uuid: row.uuid.clone(),
            })?;
        let capability = row
            .compute_cap
            .or_else(|| capability_from_model(&model))
            .ok_or_else(|| ParseError::UnknownCapability {
                line: row.line,
                uuid: row.uuid.clone(),
                model: model.clone(),
            })?;
        let mig_enabled = row
            .mig_enabled
            .unwrap_or_else(|| listed_gpu.is_some_and(|gpu| !gpu.mig_devices.is_empty()));
        let mig_devices = listed_gpu
            .map(|gpu| mig_devices(&row.uuid, &gpu.mig_devices))
            .unwrap_or_default();
        gpus.push(GpuInfo {
            uuid: row.uuid,
            model,
            capability,
            memory: row.memory,
            pci_bus_id: row.pci_bus_id,
            driver_version: row.driver_version,
            mig_enabled,
            health: GpuHealth::Healthy,
            // In MIG mode the GPU's own figure says nothing about its MIG devices.
            utilization_percent: row.utilization.filter(|_| !mig_enabled),
            mig_devices,
            mig_waiting: None,
        });
    }
    Ok(gpus)
}

/// The listed MIG devices of GPU `parent` as the manager sees them: profile (of the GPU
/// instance, so `1c.3g.71gb` counts as `3g.71gb`) and the memory its name promises. A device
/// whose profile ongrid cannot read is left out (it is never offered), with a warning.
fn mig_devices(parent: &GpuUuid, listed: &[ListedMigDevice]) -> Vec<ongrid_core::MigDevice> {
    listed
        .iter()
        .filter_map(|device| {
            let name = device
                .profile
                .split_once("c.")
                .filter(|(ci, _)| ci.bytes().all(|b| b.is_ascii_digit()))
                .map_or(device.profile.as_str(), |(_, gi)| gi);
            match ongrid_core::MigProfile::parse(name) {
                Ok(profile) => Some(ongrid_core::MigDevice {
                    uuid: device.uuid.clone(),
                    profile,
                    memory: profile.nominal_memory(),
                    parent: parent.clone(),
                }),
                Err(error) => {
                    tracing::warn!(gpu = %parent, device = %device.uuid, %error,
                                   "MIG device with a profile ongrid cannot read; not offered.");
                    None
                }
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    macro_rules! fixture {
        ($name:literal) => {
            include_str!(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/tests/fixtures/nvidia-smi/",
                $name
            ))
        };
    }

    fn gpu_uuid(s: &str) -> GpuUuid {
        GpuUuid::parse(s).unwrap()
    }

    fn joined(query: &str, list: &str, fields: &[Field]) -> Vec<GpuInfo> {
        let rows = parse_query_gpu(query, fields).unwrap();
        join(rows, &parse_list(list).unwrap()).unwrap()
    }

    #[test]
    fn two_a100s() {
        let gpus = joined(
            fixture!("a100x2.query.csv"),
            fixture!("a100x2.list.txt"),
            &Field::ALL,
        );
        assert_eq!(
            gpus[0],
            GpuInfo {
                uuid: gpu_uuid("GPU-08148167-439d-189d-b2e3-62da23b5f7b1"),
                model: "NVIDIA A100-SXM4-40GB".into(),
                capability: ComputeCapability::new(8, 0),
                memory: MemorySize::from_mib(40_960),
                pci_bus_id: Some("00000000:07:00.0".into()),
                driver_version: Some("535.129.03".into()),
                mig_enabled: false,
                health: GpuHealth::Healthy,
                utilization_percent: Some(37),
                mig_devices: Vec::new(),
                mig_waiting: None,
            }
        );
        assert_eq!(gpus[1].utilization_percent, Some(0));
        assert_eq!(
            gpus[1].uuid,
            gpu_uuid("GPU-eb3d02e1-a97d-8670-9761-924f871f590f")
        );
        assert_eq!(gpus[1].pci_bus_id.as_deref(), Some("00000000:0F:00.0"));
        assert_eq!(gpus.len(), 2);
    }

    #[test]
    fn h100_reports_its_odd_memory_size() {
        let gpus = joined(
            fixture!("h100.query.csv"),
            fixture!("h100.list.txt"),
            &Field::ALL,
        );
        assert_eq!(gpus.len(), 1);
        assert_eq!(gpus[0].model, "NVIDIA H100 80GB HBM3");
        assert_eq!(gpus[0].capability, ComputeCapability::new(9, 0));
        assert_eq!(gpus[0].memory, MemorySize::from_mib(81_559));
        // What `--min-gpu-memory 80G` must accept.
        assert!(gpus[0].memory >= MemorySize::parse("80G").unwrap());
        assert_eq!(gpus[0].driver_version.as_deref(), Some("550.54.15"));
    }

    #[test]
    fn mixed_mig_host() {
        let listed = parse_list(fixture!("mixed-mig.list.txt")).unwrap();
        assert_eq!(listed.len(), 2);
        let mig: Vec<(&str, u32, &str)> = listed[0]
            .mig_devices
            .iter()
            .map(|d| (d.profile.as_str(), d.device_index, d.uuid.as_str()))
            .collect();
        assert_eq!(
            mig,
            [
                ("3g.40gb", 0, "MIG-5044c94d-ebd8-5d4e-95cd-24eadd74ac6d"),
                ("2g.20gb", 1, "MIG-95417381-72f1-5b70-98e9-23ac5935bd95"),
                ("1g.10gb", 2, "MIG-7e9b13ac-a7b0-5cb1-b65e-519ef6474468"),
            ]
        );
        assert_eq!(listed[1].index, 1);
        assert!(listed[1].mig_devices.is_empty());

        let gpus = joined(
            fixture!("mixed-mig.query.csv"),
            fixture!("mixed-mig.list.txt"),
            &Field::ALL,
        );
        assert!(gpus[0].mig_enabled);
        assert!(!gpus[1].mig_enabled);
        assert_eq!(gpus[0].memory, MemorySize::from_mib(81_559));
        // nvidia-smi has no utilisation for a GPU in MIG mode, nor for its MIG devices.
        assert_eq!(gpus[0].utilization_percent, None);
        assert_eq!(gpus[1].utilization_percent, Some(82));
    }

    #[test]
    fn mig_enabled_without_instances() {
        let listed = parse_list(fixture!("mig-no-instances.list.txt")).unwrap();
        assert!(listed[0].mig_devices.is_empty());
        let gpus = joined(
            fixture!("mig-no-instances.query.csv"),
            fixture!("mig-no-instances.list.txt"),
            &Field::ALL,
        );
        assert!(gpus[0].mig_enabled, "the query says Enabled");
    }

    #[test]
    fn legacy_driver() {
        assert_eq!(
            rejected_field(fixture!("legacy.query-error.txt")),
            Some("compute_cap")
        );
        let fields: Vec<Field> = Field::ALL
            .into_iter()
            .filter(|&f| f != Field::ComputeCap)
            .collect();
        let listed = parse_list(fixture!("legacy.list.txt")).unwrap();
        assert_eq!(listed[0].name, "A100-SXM4-40GB");
        let mig: Vec<(&str, u32, &str)> = listed[0]
            .mig_devices
            .iter()
            .map(|d| (d.profile.as_str(), d.device_index, d.uuid.as_str()))
            .collect();
        assert_eq!(
            mig,
            [
                (
                    "3g.20gb",
                    0,
                    "MIG-GPU-1bc30b3f-2664-422d-9ef1-00fae9636688/2/0"
                ),
                (
                    "3g.20gb",
                    1,
                    "MIG-GPU-1bc30b3f-2664-422d-9ef1-00fae9636688/1/0"
                ),
            ]
        );
        let gpus = joined(
            fixture!("legacy.query.csv"),
            fixture!("legacy.list.txt"),
            &fields,
        );
        assert_eq!(gpus[0].capability, ComputeCapability::new(8, 0));
        assert!(gpus[0].mig_enabled);
        assert_eq!(gpus[1].model, "Tesla V100-SXM2-32GB");
        assert_eq!(gpus[1].capability, ComputeCapability::new(7, 0));
        assert!(!gpus[1].mig_enabled, "[N/A] and no MIG devices listed");
        assert_eq!(gpus[1].driver_version.as_deref(), Some("450.80.02"));
    }

    #[test]
    fn placeholders_are_no_value() {
        let rows = parse_query_gpu(fixture!("special-cells.query.csv"), &Field::ALL).unwrap();
        assert_eq!(rows[0].mig_enabled, None);
        assert_eq!(rows[0].utilization, None, "[N/A]");
        assert_eq!(rows[1].compute_cap, None);
        assert_eq!(rows[1].pci_bus_id, None);
        assert_eq!(rows[1].utilization, None, "[Not Supported]");
        let gpus = joined(
            fixture!("special-cells.query.csv"),
            fixture!("special-cells.list.txt"),
            &Field::ALL,
        );
        assert_eq!(gpus[0].capability, ComputeCapability::new(7, 5));
        assert!(!gpus[0].mig_enabled);
        assert_eq!(gpus[1].model, "NVIDIA L4");
        assert_eq!(
            gpus[1].capability,
            ComputeCapability::new(8, 9),
            "from the model table"
        );
        assert_eq!(gpus[1].pci_bus_id, None);
    }

    #[test]
    fn a_row_without_memory_is_an_error_naming_it() {
        let err = parse_query_gpu(fixture!("insufficient-permissions.query.csv"), &Field::ALL)
            .unwrap_err();
        assert!(
            matches!(&err, ParseError::MissingValue { line: 1, field: "memory.total", printed, .. } if printed == "[Insufficient Permissions]"),
            "{err:?}"
        );
        let message = err.to_string();
        assert!(message.contains("GPU-54c443bf-2dd8-443f-b698-c4ab923a4b6e"));
        assert!(message.contains("[Insufficient Permissions]"));
    }

    #[test]
    fn a_row_without_uuid_is_an_error_naming_it() {
        let err = parse_query_gpu(fixture!("missing-uuid.query.csv"), &Field::ALL).unwrap_err();
        assert!(
            matches!(
                &err,
                ParseError::MissingValue {
                    line: 2,
                    field: "uuid",
                    ..
                }
            ),
            "{err:?}"
        );
        assert!(err.to_string().starts_with("line 2 "), "{err}");
    }

    #[test]
    fn malformed_rows() {
        let row =
            "GPU-08148167-439d-189d-b2e3-62da23b5f7b1, X, 40960, 8.0, 535.1, Disabled, 0:0:0.0, 12";
        let err = parse_query_gpu(row, &Field::ALL[..6]).unwrap_err();
        assert!(matches!(
            err,
            ParseError::WrongCellCount {
                expected: 6,
                found: 8,
                ..
            }
        ));
        for (bad, field) in [
            (row.replace("40960", "40 GB"), "memory.total"),
            (row.replace("8.0", "eight"), "compute_cap"),
            (row.replace("Disabled", "Pending"), "mig.mode.current"),
            (row.replace("GPU-08148167", "GPU-0814"), "uuid"),
            (row.replace("40960", "99999999999999999999"), "memory.total"),
            (row.replace(", 12", ", 101"), "utilization.gpu"),
            (row.replace(", 12", ", busy"), "utilization.gpu"),
        ] {
            let err = parse_query_gpu(&bad, &Field::ALL).unwrap_err();
            assert!(
                matches!(&err, ParseError::BadValue { field: f, .. } if *f == field),
                "{bad}: {err:?}"
            );
        }
        // Units, had `nounits` been left out, are tolerated for memory.
        let with_units = row.replace("40960", "40960 MiB");
        let rows = parse_query_gpu(&with_units, &Field::ALL).unwrap();
        assert_eq!(rows[0].memory, MemorySize::from_mib(40_960));
        // ... and for utilisation.
        let rows = parse_query_gpu(&row.replace(", 12", ", 12 %"), &Field::ALL).unwrap();
        assert_eq!(rows[0].utilization, Some(12));
    }

    #[test]
    fn malformed_lists() {
        let err = parse_list(
            "  MIG 1g.5gb Device 0: (UUID: MIG-GPU-08148167-439d-189d-b2e3-62da23b5f7b1/7/0)",
        )
        .unwrap_err();
        assert!(matches!(
            err,
            ParseError::MigDeviceBeforeGpu { line: 1, .. }
        ));
        let err = parse_list(
            "GPU 0: A100 (UUID: GPU-08148167-439d-189d-b2e3-62da23b5f7b1)\nNo devices were found\n",
        )
        .unwrap_err();
        assert!(matches!(
            err,
            ParseError::UnexpectedListLine { line: 2, .. }
        ));
        let err = parse_list("GPU 0: A100 (UUID: GPU-zz)").unwrap_err();
        assert!(matches!(err, ParseError::BadValue { field: "uuid", .. }));
        let err =
            parse_list("GPU 99999999999: A100 (UUID: GPU-08148167-439d-189d-b2e3-62da23b5f7b1)")
                .unwrap_err();
        assert!(matches!(err, ParseError::BadValue { field: "index", .. }));
        assert_eq!(parse_list("\n\n").unwrap(), []);
    }

    #[test]
    fn join_rejects_duplicates_and_unknown_models() {
        let a = "GPU-08148167-439d-189d-b2e3-62da23b5f7b1, NVIDIA A100-SXM4-40GB, 40960, 535.1";
        let fields = [
            Field::Uuid,
            Field::Name,
            Field::MemoryTotal,
            Field::DriverVersion,
        ];
        let rows = parse_query_gpu(&format!("{a}\n{a}\n"), &fields).unwrap();
        let err = join(rows, &[]).unwrap_err();
        assert!(matches!(
            err,
            ParseError::DuplicateGpu {
                first: 1,
                second: 2,
                ..
            }
        ));

        let rows = parse_query_gpu(&a.replace("A100-SXM4-40GB", "Mystery 9000"), &fields).unwrap();
        let err = join(rows, &[]).unwrap_err();
        assert!(matches!(err, ParseError::UnknownCapability { line: 1, .. }));
        assert!(err.to_string().contains("R510"), "{err}");

        let rows = parse_query_gpu(&a.replace("NVIDIA A100-SXM4-40GB", "[N/A]"), &fields).unwrap();
        let err = join(rows.clone(), &[]).unwrap_err();
        assert!(matches!(err, ParseError::NoName { line: 1, .. }));
        // ... unless -L names it.
        let listed = parse_list(fixture!("a100x2.list.txt")).unwrap();
        let gpus = join(rows, &listed).unwrap();
        assert_eq!(gpus[0].model, "NVIDIA A100-SXM4-40GB");
        assert_eq!(gpus[0].capability, ComputeCapability::new(8, 0));
    }

    #[test]
    fn model_table() {
        let cases = [
            ("NVIDIA A100-SXM4-40GB", Some((8, 0))),
            ("A100-SXM4-40GB", Some((8, 0))),
            ("NVIDIA A100 80GB PCIe", Some((8, 0))),
            ("NVIDIA A10", Some((8, 6))),
            ("NVIDIA A10G", Some((8, 6))),
            ("NVIDIA A30", Some((8, 0))),
            ("NVIDIA L4", Some((8, 9))),
            ("NVIDIA L40S", Some((8, 9))),
            ("NVIDIA H100 80GB HBM3", Some((9, 0))),
            ("NVIDIA H200", Some((9, 0))),
            ("Tesla V100-SXM2-32GB", Some((7, 0))),
            ("Tesla T4", Some((7, 5))),
            ("Tesla P100-PCIE-16GB", Some((6, 0))),
            ("NVIDIA B200", Some((10, 0))),
            ("NVIDIA GeForce RTX 4090", None),
            ("", None),
        ];
        for (name, expected) in cases {
            assert_eq!(
                capability_from_model(name),
                expected.map(|(major, minor)| ComputeCapability::new(major, minor)),
                "{name}"
            );
        }
    }

    #[test]
    fn query_arguments() {
        assert_eq!(
            query_argument(&Field::ALL),
            "--query-gpu=uuid,name,memory.total,compute_cap,driver_version,mig.mode.current,pci.bus_id,utilization.gpu"
        );
        for field in Field::ALL {
            assert_eq!(Field::from_name(field.as_str()), Some(field));
        }
        assert_eq!(rejected_field("GPU-1, A100, 40960"), None);
        assert_eq!(
            rejected_field("Field \"mig.mode.current\" is not a valid field to query.\n"),
            Some("mig.mode.current")
        );
    }

    // ---- property tests ----

    const PLACEHOLDERS: [&str; 4] = [
        "[N/A]",
        "[Not Supported]",
        "[Insufficient Permissions]",
        "[Unknown Error]",
    ];

    fn uuid_body() -> impl Strategy<Value = String> {
        "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
    }

    fn gpu_uuid_strategy() -> impl Strategy<Value = GpuUuid> {
        uuid_body().prop_map(|body| GpuUuid::parse(&format!("GPU-{body}")).unwrap())
    }

    fn name_strategy() -> impl Strategy<Value = String> {
        "[A-Za-z0-9][A-Za-z0-9 .-]{0,30}[A-Za-z0-9]"
    }

    /// A well-formed row, the fields it was asked with, and the text nvidia-smi would print.
    fn query_case() -> impl Strategy<Value = (Vec<Field>, QueryRow, Vec<usize>)> {
        (
            gpu_uuid_strategy(),
            proptest::option::of(name_strategy()),
            0u64..4_000_000,
            proptest::option::of((0u16..20, 0u16..10)),
            proptest::option::of("[0-9]{3}\\.[0-9]{2,3}(\\.[0-9]{2})?"),
            proptest::option::of(any::<bool>()),
            proptest::option::of("[0-9A-F]{8}:[0-9A-F]{2}:[0-9A-F]{2}\\.[0-7]"),
            proptest::option::of(0u32..=100),
            proptest::sample::subsequence(
                vec![
                    Field::ComputeCap,
                    Field::DriverVersion,
                    Field::MigModeCurrent,
                    Field::PciBusId,
                    Field::UtilizationGpu,
                ],
                0..=5,
            ),
            proptest::collection::vec(0..PLACEHOLDERS.len(), 8),
        )
            .prop_map(
                |(uuid, name, mib, cap, driver, mig, pci, utilization, optional, placeholders)| {
                    let mut fields = vec![Field::Uuid, Field::Name, Field::MemoryTotal];
                    fields.extend(optional);
                    let asked = |field: Field| fields.contains(&field);
                    let row = QueryRow {
                        line: 1,
                        uuid,
                        name,
                        memory: MemorySize::from_mib(mib),
                        compute_cap: cap
                            .filter(|_| asked(Field::ComputeCap))
                            .map(|(major, minor)| ComputeCapability::new(major, minor)),
                        driver_version: driver.filter(|_| asked(Field::DriverVersion)),
                        mig_enabled: mig.filter(|_| asked(Field::MigModeCurrent)),
                        pci_bus_id: pci.filter(|_| asked(Field::PciBusId)),
                        utilization: utilization.filter(|_| asked(Field::UtilizationGpu)),
                    };
                    (fields, row, placeholders)
                },
            )
    }

    /// Prints a row as nvidia-smi would, absent values as one of the placeholders.
    fn print_row(fields: &[Field], row: &QueryRow, placeholders: &[usize]) -> String {
        let cells: Vec<String> = fields
            .iter()
            .zip(placeholders)
            .map(|(field, &placeholder)| {
                let value = match field {
                    Field::Uuid => Some(row.uuid.to_string()),
                    Field::Name => row.name.clone(),
                    Field::MemoryTotal => Some(row.memory.mib().to_string()),
                    Field::ComputeCap => row.compute_cap.map(|c| c.to_string()),
                    Field::DriverVersion => row.driver_version.clone(),
                    Field::MigModeCurrent => row
                        .mig_enabled
                        .map(|on| if on { "Enabled" } else { "Disabled" }.to_owned()),
                    Field::PciBusId => row.pci_bus_id.clone(),
                    Field::UtilizationGpu => row.utilization.map(|u| u.to_string()),
                };
                value.unwrap_or_else(|| PLACEHOLDERS[placeholder].to_owned())
            })
            .collect();
        cells.join(", ")
    }

    fn listed_gpu() -> impl Strategy<Value = (ListedGpu, bool)> {
        let mig_device = (
            "[1-7](c\\.[1-7])?g\\.[0-9]{1,3}gb(\\+me)?",
            0u32..100,
            uuid_body(),
            proptest::option::of((0u32..15, 0u32..8)),
        );
        (
            0u32..64,
            name_strategy(),
            gpu_uuid_strategy(),
            proptest::collection::vec(mig_device, 0..8),
            any::<bool>(),
        )
            .prop_map(|(index, name, uuid, devices, legacy)| {
                let mig_devices = devices
                    .into_iter()
                    .map(|(profile, device_index, body, legacy_ids)| {
                        let uuid = match legacy_ids {
                            Some((gi, ci)) => format!("MIG-{uuid}/{gi}/{ci}"),
                            None => format!("MIG-{body}"),
                        };
                        ListedMigDevice {
                            profile,
                            device_index,
                            uuid: MigUuid::parse(&uuid).unwrap(),
                        }
                    })
                    .collect();
                let gpu = ListedGpu {
                    index,
                    name,
                    uuid,
                    mig_devices,
                };
                (gpu, legacy)
            })
    }

    /// Prints `nvidia-smi -L`: padded columns (modern) or single spaces (legacy).
    fn print_list(gpus: &[(ListedGpu, bool)]) -> String {
        let mut out = String::new();
        for (gpu, legacy) in gpus {
            out.push_str(&format!(
                "GPU {}: {} (UUID: {})\n",
                gpu.index, gpu.name, gpu.uuid
            ));
            for device in &gpu.mig_devices {
                if *legacy {
                    out.push_str(&format!(
                        "  MIG {} Device {}: (UUID: {})\n",
                        device.profile, device.device_index, device.uuid
                    ));
                } else {
                    out.push_str(&format!(
                        "  MIG {:<11} Device {:>2}: (UUID: {})\n",
                        device.profile, device.device_index, device.uuid
                    ));
                }
            }
        }
        out
    }

    proptest! {
        #[test]
        fn query_parser_never_panics(output in "\\PC*(\n\\PC*){0,3}", n in 0usize..=8) {
            let _ = parse_query_gpu(&output, &Field::ALL[..n]);
        }

        #[test]
        fn query_parser_never_panics_on_near_misses(
            cells in proptest::collection::vec("(\\[[A-Za-z ]*\\]|GPU-[0-9a-f-]{0,40}|[0-9.]{0,25}|Enabled|Disabled|\\PC{0,8})", 0..9)
        ) {
            let _ = parse_query_gpu(&cells.join(", "), &Field::ALL);
        }

        #[test]
        fn list_parser_never_panics(output in "\\PC*(\n\\PC*){0,3}") {
            let _ = parse_list(&output);
        }

        #[test]
        fn list_parser_never_panics_on_near_misses(
            lines in proptest::collection::vec("(GPU [0-9]{1,12}: |  MIG [0-9a-z.]{0,8} +Device +[0-9]{1,12}: )?[A-Za-z0-9 ]{0,10}(\\(UUID: (GPU|MIG|MIG-GPU)-[0-9a-f/-]{0,45}\\))?", 0..6)
        ) {
            let _ = parse_list(&lines.join("\n"));
        }

        #[test]
        fn query_rows_round_trip(cases in proptest::collection::vec(query_case(), 1..5)) {
            // Rows of one output share the fields: use the first case's.
            let fields = cases[0].0.clone();
            let mut expected = Vec::new();
            let mut output = String::new();
            for (line, (_, row, placeholders)) in cases.into_iter().enumerate() {
                let row = QueryRow {
                    line: line + 1,
                    compute_cap: row.compute_cap.filter(|_| fields.contains(&Field::ComputeCap)),
                    driver_version: row.driver_version.filter(|_| fields.contains(&Field::DriverVersion)),
                    mig_enabled: row.mig_enabled.filter(|_| fields.contains(&Field::MigModeCurrent)),
                    pci_bus_id: row.pci_bus_id.filter(|_| fields.contains(&Field::PciBusId)),
                    utilization: row.utilization.filter(|_| fields.contains(&Field::UtilizationGpu)),
                    ..row
                };
                output.push_str(&print_row(&fields, &row, &placeholders));
                output.push('\n');
                expected.push(row);
            }
            prop_assert_eq!(parse_query_gpu(&output, &fields).unwrap(), expected);
        }

        #[test]
        fn lists_round_trip(gpus in proptest::collection::vec(listed_gpu(), 0..5)) {
            let output = print_list(&gpus);
            let expected: Vec<ListedGpu> = gpus.into_iter().map(|(gpu, _)| gpu).collect();
            prop_assert_eq!(parse_list(&output).unwrap(), expected);
        }
    }
}
