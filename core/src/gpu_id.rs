//! The identity of a GPU: a physical GPU's UUID, a MIG device's UUID, and [`GpuId`], either
//! of them, as a session or job is given it. Never ordinals. Below `gpu.rs` (properties,
//! modes, requests) and `mig.rs` (layouts and devices), which both name GPUs by these. A UUID
//! holds its text in an `Arc<str>`, so the many copies a scheduling round makes share it.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GpuIdError {
    #[error("GPU UUID {0:?} must look like GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx")]
    BadGpuUuid(String),
    #[error("MIG UUID {0:?} must look like MIG-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx or MIG-GPU-<uuid>/<gi>/<ci>")]
    BadMigUuid(String),
}

/// Hex digits and dashes, 32 hex digits in all, as NVIDIA prints UUIDs.
fn is_uuid_body(s: &str) -> bool {
    !s.is_empty()
        && s.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-')
        && s.bytes().filter(u8::is_ascii_hexdigit).count() == 32
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// A physical GPU's UUID, `GPU-<uuid>`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct GpuUuid(Arc<str>);

impl GpuUuid {
    pub fn parse(value: &str) -> Result<Self, GpuIdError> {
        match value.strip_prefix("GPU-") {
            Some(body) if is_uuid_body(body) => Ok(Self(value.into())),
            _ => Err(GpuIdError::BadGpuUuid(value.to_owned())),
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// A MIG device's UUID: `MIG-<uuid>` (driver R470 and later) or the legacy
/// `MIG-GPU-<parent uuid>/<GPU instance>/<compute instance>` (R450/R460).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct MigUuid(Arc<str>);

impl MigUuid {
    pub fn parse(value: &str) -> Result<Self, GpuIdError> {
        let bad = || GpuIdError::BadMigUuid(value.to_owned());
        let body = value.strip_prefix("MIG-").ok_or_else(bad)?;
        if let Some(legacy) = body.strip_prefix("GPU-") {
            let mut parts = legacy.split('/');
            let uuid = parts.next().ok_or_else(bad)?;
            let gi = parts.next().ok_or_else(bad)?;
            let ci = parts.next().ok_or_else(bad)?;
            let numeric =
                |s: &str| !s.is_empty() && s.len() <= 3 && s.bytes().all(|b| b.is_ascii_digit());
            if parts.next().is_some() || !is_uuid_body(uuid) || !numeric(gi) || !numeric(ci) {
                return Err(bad());
            }
            return Ok(Self(value.into()));
        }
        if is_uuid_body(body) {
            Ok(Self(value.into()))
        } else {
            Err(bad())
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

macro_rules! string_impls {
    ($name:ident) => {
        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }
        impl FromStr for $name {
            type Err = GpuIdError;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                Self::parse(s)
            }
        }
        impl TryFrom<String> for $name {
            type Error = GpuIdError;
            fn try_from(value: String) -> Result<Self, Self::Error> {
                Self::parse(&value)
            }
        }
        impl From<$name> for String {
            fn from(value: $name) -> Self {
                value.0.as_ref().to_owned()
            }
        }
    };
}

string_impls!(GpuUuid);
string_impls!(MigUuid);

/// What a session is given: a whole (or shared) GPU, or a MIG device. Serialised as the UUID
/// string, which is also what `CUDA_VISIBLE_DEVICES` and `NVIDIA_VISIBLE_DEVICES` take.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum GpuId {
    Gpu(GpuUuid),
    Mig(MigUuid),
}

impl GpuId {
    pub fn parse(value: &str) -> Result<Self, GpuIdError> {
        if value.starts_with("MIG-") {
            MigUuid::parse(value).map(Self::Mig)
        } else {
            GpuUuid::parse(value).map(Self::Gpu)
        }
    }

    pub fn as_str(&self) -> &str {
        match self {
            Self::Gpu(g) => g.as_str(),
            Self::Mig(m) => m.as_str(),
        }
    }
}

impl FromStr for GpuId {
    type Err = GpuIdError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

impl TryFrom<String> for GpuId {
    type Error = GpuIdError;
    fn try_from(value: String) -> Result<Self, Self::Error> {
        Self::parse(&value)
    }
}

impl From<GpuId> for String {
    fn from(value: GpuId) -> Self {
        value.as_str().to_owned()
    }
}

impl fmt::Display for GpuId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl From<GpuUuid> for GpuId {
    fn from(value: GpuUuid) -> Self {
        Self::Gpu(value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A100: &str = "GPU-5c89852c-d268-c3f3-1b07-005d5ae1dc3f";

    #[test]
    fn gpu_uuids() {
        assert!(GpuUuid::parse(A100).is_ok());
        assert!(GpuUuid::parse("GPU-xyz").is_err());
        assert!(GpuUuid::parse("5c89852c-d268-c3f3-1b07-005d5ae1dc3f").is_err());
        assert!(GpuUuid::parse("GPU-5c89852c").is_err());
        assert!(GpuUuid::parse("0").is_err());
    }

    #[test]
    fn mig_uuids() {
        assert!(MigUuid::parse("MIG-c7384736-a75d-5afc-978f-d2f1294409fd").is_ok());
        assert!(MigUuid::parse(&format!("MIG-{A100}/7/0")).is_ok());
        assert!(MigUuid::parse(&format!("MIG-{A100}/7")).is_err());
        assert!(MigUuid::parse(&format!("MIG-{A100}/7/0/1")).is_err());
        assert!(MigUuid::parse("MIG-zz").is_err());
        assert!(matches!(
            GpuId::parse("MIG-c7384736-a75d-5afc-978f-d2f1294409fd"),
            Ok(GpuId::Mig(_))
        ));
        assert!(matches!(GpuId::parse(A100), Ok(GpuId::Gpu(_))));
        let json = serde_json::to_string(&GpuId::parse(A100).unwrap()).unwrap();
        assert_eq!(json, format!("\"{A100}\""));
    }
}
