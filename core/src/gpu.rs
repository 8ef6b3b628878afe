//! GPUs as ongrid sees them: properties, the admin's sharing policy, and what a request
//! requires. Their identity (UUIDs, never ordinals) is `gpu_id.rs`, re-exported here.

use std::fmt;
use std::str::FromStr;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

pub use crate::gpu_id::{GpuId, GpuIdError, GpuUuid, MigUuid};
use crate::mig::{MigChange, MigDevice, MigError, MigLayout, MigProfile};
use crate::quantity::{ComputeCapability, MemorySize};

/// Health as the node's GPU backend last saw it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "status", content = "reason", rename_all = "snake_case")]
pub enum GpuHealth {
    Healthy,
    /// The GPU cannot take work, for example it fell off the bus; the text says what was seen.
    Failed(String),
    /// Nobody can tell: the node's `nvidia-smi` hangs or fails without naming a GPU, so none of
    /// its GPUs is taken for healthy. The text says what was seen.
    Unknown(String),
}

impl GpuHealth {
    pub fn is_healthy(&self) -> bool {
        matches!(self, Self::Healthy)
    }

    /// What was seen, for an unhealthy GPU: `failed: <reason>` or `unknown: <reason>`.
    pub fn problem(&self) -> Option<String> {
        match self {
            Self::Healthy => None,
            Self::Failed(reason) => Some(format!("failed: {reason}")),
            Self::Unknown(reason) => Some(format!("unknown: {reason}")),
        }
    }
}

/// One GPU of a node, as discovered by the node agent's `GpuBackend`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuInfo {
    pub uuid: GpuUuid,
    /// The model as `nvidia-smi` names it, e.g. `NVIDIA A100-SXM4-40GB`.
    pub model: String,
    pub capability: ComputeCapability,
    pub memory: MemorySize,
    /// PCI bus id, e.g. `00000000:36:00.0`, when known.
    pub pci_bus_id: Option<String>,
    pub driver_version: Option<String>,
    pub mig_enabled: bool,
    pub health: GpuHealth,
    /// Utilisation in percent when last discovered (`nvidia-smi` `utilization.gpu`); `None`
    /// when unknown, as for a GPU in MIG mode. Not part of the inventory: it changes every sync.
    #[serde(default)]
    pub utilization_percent: Option<u32>,
    /// The GPU's MIG devices, when MIG mode is on and instances exist.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mig_devices: Vec<MigDevice>,
    /// The MIG change (the admin's new layout, or MIG mode off) the agent waits to make until
    /// no session, job or container uses the GPU or its devices. Not part of the inventory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig_waiting: Option<MigChange>,
}

impl GpuInfo {
    /// Whether `other` says the same of the GPU as `self` in everything but its utilisation:
    /// the scheduler has nothing new to decide when only that changed.
    pub fn same_inventory(&self, other: &GpuInfo) -> bool {
        let without = |gpu: &GpuInfo| GpuInfo {
            utilization_percent: None,
            ..gpu.clone()
        };
        without(self) == without(other)
    }
}

/// How the admin lets sessions use a GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "mode", rename_all = "snake_case")]
pub enum GpuMode {
    /// One session at a time has the whole GPU.
    Exclusive,
    /// Up to `max_sessions` sessions share the GPU (time-slicing, no memory isolation).
    Shared { max_sessions: u32 },
    /// Partitioned into MIG devices by this layout; each device holds one session or job, and
    /// the GPU itself is never given out whole.
    Mig { layout: MigLayout },
}

impl GpuMode {
    /// How many sessions the GPU can hold at once, as a whole or shared GPU: 0 in MIG mode
    /// (its places are its MIG devices).
    pub fn capacity(self) -> u32 {
        match self {
            Self::Exclusive => 1,
            Self::Shared { max_sessions } => max_sessions,
            Self::Mig { .. } => 0,
        }
    }

    pub fn mig_layout(self) -> Option<MigLayout> {
        match self {
            Self::Mig { layout } => Some(layout),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GpuModeError {
    #[error("GPU mode {0:?} must be \"exclusive\", \"shared:N\" with N from 2 to 64, or \"mig:LAYOUT\" (e.g. mig:1g.10gb*7)")]
    Bad(String),
    #[error(transparent)]
    Layout(#[from] MigError),
}

impl FromStr for GpuMode {
    type Err = GpuModeError;
    /// `exclusive` or `shared:N`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || GpuModeError::Bad(s.to_owned());
        match s.trim() {
            "exclusive" => Ok(Self::Exclusive),
            other if other.starts_with("mig:") => Ok(Self::Mig {
                layout: MigLayout::parse(&other["mig:".len()..])?,
            }),
            other => {
                let n = other.strip_prefix("shared:").ok_or_else(err)?;
                let n: u32 = n.parse().map_err(|_| err())?;
                if (2..=64).contains(&n) {
                    Ok(Self::Shared { max_sessions: n })
                } else {
                    Err(err())
                }
            }
        }
    }
}

impl fmt::Display for GpuMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Exclusive => f.write_str("exclusive"),
            Self::Shared { max_sessions } => write!(f, "shared:{max_sessions}"),
            Self::Mig { layout } => write!(f, "mig:{layout}"),
        }
    }
}

/// Why a node or a GPU is out of service: nothing new is placed on it, and what runs there
/// keeps running. Set by an admin (`devctl admin node drain`, `devctl admin gpu drain`) and
/// lifted only by an admin.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Drain {
    /// What the admin gave, or what was seen.
    pub reason: String,
    pub since: DateTime<Utc>,
    /// The admin's login name.
    pub by: String,
}

impl Drain {
    /// `drained 2026-11-25 10:00 UTC by alice: <reason>`, for messages.
    pub fn sentence(&self) -> String {
        format!(
            "drained {} by {}: {}",
            self.since.format("%Y-%m-%d %H:%M UTC"),
            self.by,
            self.reason
        )
    }
}

/// Which GPU modes a request accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Sharing {
    /// Only a whole GPU (a GPU in `exclusive` mode).
    #[default]
    Exclusive,
    /// Only a share of a GPU in `shared` mode.
    Shared,
    /// Either.
    Any,
    /// One MIG device of at least this profile (more compute slices or memory will do).
    Mig(MigProfile),
}

impl Sharing {
    /// Whether a whole or shared GPU in `mode` may be given: never a GPU in MIG mode, and
    /// never to a MIG request (those get MIG devices).
    pub fn accepts(self, mode: GpuMode) -> bool {
        matches!(
            (self, mode),
            (Self::Any, GpuMode::Exclusive | GpuMode::Shared { .. })
                | (Self::Exclusive, GpuMode::Exclusive)
                | (Self::Shared, GpuMode::Shared { .. })
        )
    }

    pub fn mig(self) -> Option<MigProfile> {
        match self {
            Self::Mig(profile) => Some(profile),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("sharing {0:?} must be one of exclusive, shared, any, mig:PROFILE (e.g. mig:1g.10gb)")]
pub struct SharingError(String);

impl FromStr for Sharing {
    type Err = SharingError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "exclusive" => Ok(Self::Exclusive),
            "shared" => Ok(Self::Shared),
            "any" => Ok(Self::Any),
            other => match other.strip_prefix("mig:").map(MigProfile::parse) {
                Some(Ok(profile)) => Ok(Self::Mig(profile)),
                _ => Err(SharingError(other.to_owned())),
            },
        }
    }
}

impl fmt::Display for Sharing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Exclusive => f.write_str("exclusive"),
            Self::Shared => f.write_str("shared"),
            Self::Any => f.write_str("any"),
            Self::Mig(profile) => write!(f, "mig:{profile}"),
        }
    }
}

/// What a session asks of the GPUs it gets. All GPUs of one session are on one node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuRequest {
    /// How many GPUs, at least 1.
    pub count: u32,
    pub min_capability: Option<ComputeCapability>,
    pub min_memory: Option<MemorySize>,
    pub sharing: Sharing,
}

impl Default for GpuRequest {
    fn default() -> Self {
        Self {
            count: 1,
            min_capability: None,
            min_memory: None,
            sharing: Sharing::Exclusive,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GpuRequestError {
    #[error("a session needs at least 1 GPU")]
    ZeroGpus,
    #[error("{0} GPUs is more than the limit of {max} per session", max = GpuRequest::MAX_COUNT)]
    TooMany(u32),
    #[error("a MIG request gets exactly 1 MIG device (a CUDA process uses one), not {0}")]
    MigCount(u32),
}

impl GpuRequest {
    pub const MAX_COUNT: u32 = 64;

    pub fn validate(&self) -> Result<(), GpuRequestError> {
        match self.count {
            0 => Err(GpuRequestError::ZeroGpus),
            n if n > Self::MAX_COUNT => Err(GpuRequestError::TooMany(n)),
            n if n != 1 && self.sharing.mig().is_some() => Err(GpuRequestError::MigCount(n)),
            _ => Ok(()),
        }
    }

    /// Whether one GPU with these properties meets the request's per-GPU requirements
    /// (capability, memory, mode). Health and free capacity are the scheduler's business.
    pub fn fits(&self, capability: ComputeCapability, memory: MemorySize, mode: GpuMode) -> bool {
        self.min_capability.is_none_or(|min| capability >= min)
            && self.min_memory.is_none_or(|min| memory >= min)
            && self.sharing.accepts(mode)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_and_sharing() {
        assert_eq!("exclusive".parse::<GpuMode>().unwrap(), GpuMode::Exclusive);
        assert_eq!(
            "shared:4".parse::<GpuMode>().unwrap(),
            GpuMode::Shared { max_sessions: 4 }
        );
        assert!("shared:1".parse::<GpuMode>().is_err());
        assert!("shared".parse::<GpuMode>().is_err());
        assert!(Sharing::Exclusive.accepts(GpuMode::Exclusive));
        assert!(!Sharing::Exclusive.accepts(GpuMode::Shared { max_sessions: 2 }));
        assert!(Sharing::Shared.accepts(GpuMode::Shared { max_sessions: 2 }));
        assert!(!Sharing::Shared.accepts(GpuMode::Exclusive));
        assert!(Sharing::Any.accepts(GpuMode::Exclusive));
        let mig: GpuMode = "mig:3g.40gb*1+2g.20gb*2".parse().unwrap();
        assert_eq!(mig.to_string(), "mig:3g.40gb*1+2g.20gb*2");
        assert_eq!(mig.capacity(), 0);
        for sharing in [Sharing::Any, Sharing::Exclusive, Sharing::Shared] {
            assert!(!sharing.accepts(mig), "{sharing} on a MIG GPU");
        }
        let slice: Sharing = "mig:1g.10gb".parse().unwrap();
        assert_eq!(slice.to_string(), "mig:1g.10gb");
        assert!(!slice.accepts(GpuMode::Exclusive));
        assert!(matches!(
            "mig:1g.10gb".parse::<GpuMode>(),
            Err(GpuModeError::Layout(_))
        ));
        assert_eq!(
            serde_json::to_string(&mig).unwrap(),
            r#"{"mode":"mig","layout":"3g.40gb*1+2g.20gb*2"}"#
        );
    }

    #[test]
    fn request_fits() {
        let req = GpuRequest {
            count: 1,
            min_capability: Some(ComputeCapability::new(8, 0)),
            min_memory: Some(MemorySize::parse("40G").unwrap()),
            sharing: Sharing::Exclusive,
        };
        let a100 = (ComputeCapability::new(8, 0), MemorySize::from_mib(40_960));
        let t4 = (ComputeCapability::new(7, 5), MemorySize::from_mib(15_360));
        assert!(req.fits(a100.0, a100.1, GpuMode::Exclusive));
        assert!(!req.fits(t4.0, t4.1, GpuMode::Exclusive));
        assert!(!req.fits(a100.0, a100.1, GpuMode::Shared { max_sessions: 2 }));
        assert_eq!(
            GpuRequest { count: 0, ..req }.validate(),
            Err(GpuRequestError::ZeroGpus)
        );
    }
}
