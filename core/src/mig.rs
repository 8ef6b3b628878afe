//! MIG (Multi-Instance GPU): profile names, the layouts an admin gives a GPU
//! (`1g.10gb*7`, `3g.40gb*1+2g.20gb*2`), the profiles each supported GPU model offers, and the
//! MIG devices an agent reports.
//!
//! A layout is checked against its GPU's model before it is accepted: every profile must be
//! one the model offers, at most as many instances of it as the model allows, and the layout's
//! compute and memory slices must fit in the GPU's. The hardware has placement rules beyond
//! these sums; a layout that passes here and still cannot be made is refused by `nvidia-smi` on
//! the node, and the agent leaves the GPU drained with its message.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::gpu_id::{GpuUuid, MigUuid};
use crate::quantity::MemorySize;

/// A GPU-instance profile: `<compute slices>g.<memory GB>gb`, `+me` with media extensions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct MigProfile {
    /// Compute slices (the `g` number), 1 to 7.
    pub slices: u8,
    /// Memory in GB as the name says it.
    pub memory_gb: u16,
    pub media: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MigError {
    #[error("MIG profile {0:?} must look like 1g.10gb, 3g.40gb or 1g.10gb+me")]
    BadProfile(String),
    #[error("MIG layout {0:?} must be PROFILE*COUNT joined by '+', e.g. 1g.10gb*7 or 3g.40gb*1+2g.20gb*2")]
    BadLayout(String),
    #[error("GPU model {0:?} has no known MIG profiles (known: A100-40GB, A100-80GB, H100-80GB, H200-141GB, A30); use exclusive or shared:N for it")]
    UnknownModel(String),
    #[error("{model} has no MIG profile {profile}; its profiles are {offered}")]
    NoSuchProfile {
        model: &'static str,
        profile: MigProfile,
        offered: String,
    },
    #[error("{model} allows at most {max} instance(s) of {profile}, the layout asks for {asked}")]
    TooMany {
        model: &'static str,
        profile: MigProfile,
        max: u8,
        asked: u32,
    },
    #[error("the layout needs {asked} {what} slices, {model} has {has}")]
    TooBig {
        model: &'static str,
        what: &'static str,
        asked: u32,
        has: u8,
    },
}

impl MigProfile {
    pub const fn new(slices: u8, memory_gb: u16, media: bool) -> Self {
        Self {
            slices,
            memory_gb,
            media,
        }
    }

    pub fn parse(value: &str) -> Result<Self, MigError> {
        let bad = || MigError::BadProfile(value.to_owned());
        let text = value.trim();
        let (text, media) = match text.strip_suffix("+me") {
            Some(rest) => (rest, true),
            None => (text, false),
        };
        let (g, mem) = text.split_once("g.").ok_or_else(bad)?;
        let mem = mem.strip_suffix("gb").ok_or_else(bad)?;
        let digits =
            |s: &str| !s.is_empty() && s.len() <= 4 && s.bytes().all(|b| b.is_ascii_digit());
        if !digits(g) || !digits(mem) {
            return Err(bad());
        }
        let slices: u8 = g.parse().map_err(|_| bad())?;
        let memory_gb: u16 = mem.parse().map_err(|_| bad())?;
        if !(1..=7).contains(&slices) || memory_gb == 0 {
            return Err(bad());
        }
        Ok(Self::new(slices, memory_gb, media))
    }

    /// Whether a slice of this profile meets a request for `wanted`: at least as many compute
    /// slices and as much memory, and media extensions when asked for.
    pub fn covers(self, wanted: MigProfile) -> bool {
        self.slices >= wanted.slices
            && self.memory_gb >= wanted.memory_gb
            && (self.media || !wanted.media)
    }

    /// The memory the name promises (`memory_gb` GiB); agents report what the driver says.
    pub fn nominal_memory(self) -> MemorySize {
        MemorySize::from_mib(u64::from(self.memory_gb) * 1024)
    }
}

impl fmt::Display for MigProfile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}g.{}gb", self.slices, self.memory_gb)?;
        if self.media {
            f.write_str("+me")?;
        }
        Ok(())
    }
}

impl FromStr for MigProfile {
    type Err = MigError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

impl TryFrom<String> for MigProfile {
    type Error = MigError;
    fn try_from(value: String) -> Result<Self, Self::Error> {
        Self::parse(&value)
    }
}

impl From<MigProfile> for String {
    fn from(value: MigProfile) -> Self {
        value.to_string()
    }
}

/// How many distinct profiles a layout can hold: every profile takes at least one of a GPU's
/// at most 7 compute slices.
const MAX_PARTS: usize = 7;

/// An admin's MIG layout for one GPU: profiles with their instance counts, in the order given
/// (the order `nvidia-smi mig -cgi` creates them in; larger profiles first avoids the known
/// "Insufficient Resources" of mixed layouts). `Copy`, so a [`crate::GpuMode`] stays `Copy`.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct MigLayout {
    parts: [(MigProfile, u8); MAX_PARTS],
    len: u8,
}

impl MigLayout {
    pub fn parse(value: &str) -> Result<Self, MigError> {
        let bad = || MigError::BadLayout(value.to_owned());
        let mut layout = Self {
            parts: [(MigProfile::new(1, 1, false), 0); MAX_PARTS],
            len: 0,
        };
        for part in value.trim().split('+') {
            let part = part.trim();
            // `1g.10gb+me*2`: the '+' of `+me` split it; glue it back to the previous part.
            if let Some(count) = part.strip_prefix("me") {
                let last = layout.len.checked_sub(1).ok_or_else(bad)? as usize;
                let (profile, n) = layout.parts[last];
                if n != 0 || profile.media {
                    return Err(bad());
                }
                let count = count.strip_prefix('*').ok_or_else(bad)?;
                let n: u8 = count.parse().map_err(|_| bad())?;
                if n == 0 {
                    return Err(bad());
                }
                layout.parts[last] = (
                    MigProfile {
                        media: true,
                        ..profile
                    },
                    n,
                );
                continue;
            }
            let (profile, count) = match part.split_once('*') {
                Some((p, c)) => (MigProfile::parse(p)?, Some(c)),
                None => (MigProfile::parse(part).map_err(|_| bad())?, None),
            };
            let n: u8 = match count {
                Some(c) => c.trim().parse().map_err(|_| bad())?,
                None => 0, // only valid when `+me*N` follows
            };
            if count.is_some() && n == 0 {
                return Err(bad());
            }
            if usize::from(layout.len) == MAX_PARTS {
                return Err(bad());
            }
            layout.parts[usize::from(layout.len)] = (profile, n);
            layout.len += 1;
        }
        if layout.len == 0 || layout.parts().iter().any(|&(_, n)| n == 0) {
            return Err(bad());
        }
        Ok(layout)
    }

    /// The profiles and their counts, in the admin's order.
    pub fn parts(&self) -> &[(MigProfile, u8)] {
        &self.parts[..usize::from(self.len)]
    }

    /// Every instance, one profile per MIG device, in creation order.
    pub fn instances(&self) -> Vec<MigProfile> {
        self.parts()
            .iter()
            .flat_map(|&(p, n)| std::iter::repeat_n(p, usize::from(n)))
            .collect()
    }

    /// Whether `devices` are exactly the layout's instances, in any order: the layout is made.
    pub fn is_made_by(&self, devices: &[MigDevice]) -> bool {
        let mut have: Vec<MigProfile> = devices.iter().map(|d| d.profile).collect();
        let mut want = self.instances();
        have.sort();
        want.sort();
        have == want
    }

    /// Checks the layout against the profiles of the GPU model `model` (as `nvidia-smi` names
    /// it, e.g. `NVIDIA A100-SXM4-40GB`).
    pub fn validate_for(&self, model: &str) -> Result<(), MigError> {
        let gpu = MigModel::of(model).ok_or_else(|| MigError::UnknownModel(model.to_owned()))?;
        let (mut compute, mut memory) = (0u32, 0u32);
        for &(profile, _) in self.parts() {
            let offer = gpu
                .profile(profile)
                .ok_or_else(|| MigError::NoSuchProfile {
                    model: gpu.name,
                    profile,
                    offered: gpu
                        .profiles
                        .iter()
                        .map(|p| p.profile.to_string())
                        .collect::<Vec<_>>()
                        .join(", "),
                })?;
            let asked: u32 = self
                .parts()
                .iter()
                .filter(|&&(p, _)| p == profile)
                .map(|&(_, n)| u32::from(n))
                .sum();
            if asked > u32::from(offer.max_instances) {
                return Err(MigError::TooMany {
                    model: gpu.name,
                    profile,
                    max: offer.max_instances,
                    asked,
                });
            }
        }
        for &(profile, n) in self.parts() {
            let offer = gpu.profile(profile).expect("checked above");
            compute += u32::from(profile.slices) * u32::from(n);
            memory += u32::from(offer.memory_slices) * u32::from(n);
        }
        if compute > u32::from(gpu.compute_slices) {
            return Err(MigError::TooBig {
                model: gpu.name,
                what: "compute",
                asked: compute,
                has: gpu.compute_slices,
            });
        }
        if memory > u32::from(gpu.memory_slices) {
            return Err(MigError::TooBig {
                model: gpu.name,
                what: "memory",
                asked: memory,
                has: gpu.memory_slices,
            });
        }
        Ok(())
    }
}

impl fmt::Display for MigLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, (profile, n)) in self.parts().iter().enumerate() {
            if i > 0 {
                f.write_str("+")?;
            }
            write!(f, "{profile}*{n}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for MigLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "MigLayout({self})")
    }
}

impl FromStr for MigLayout {
    type Err = MigError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

impl TryFrom<String> for MigLayout {
    type Error = MigError;
    fn try_from(value: String) -> Result<Self, Self::Error> {
        Self::parse(&value)
    }
}

impl From<MigLayout> for String {
    fn from(value: MigLayout) -> Self {
        value.to_string()
    }
}

/// One profile a GPU model offers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MigOffer {
    pub profile: MigProfile,
    /// The `nvidia-smi mig -lgip` profile ID.
    pub id: u8,
    pub max_instances: u8,
    /// Memory slices one instance takes (of the model's `memory_slices`).
    pub memory_slices: u8,
}

/// A GPU model's MIG geometry (NVIDIA's MIG user guide, "Supported MIG Profiles").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MigModel {
    pub name: &'static str,
    pub compute_slices: u8,
    pub memory_slices: u8,
    pub profiles: &'static [MigOffer],
}

const fn offer(slices: u8, gb: u16, media: bool, id: u8, max: u8, mem: u8) -> MigOffer {
    MigOffer {
        profile: MigProfile::new(slices, gb, media),
        id,
        max_instances: max,
        memory_slices: mem,
    }
}

const A100_40: MigModel = MigModel {
    name: "A100-40GB",
    compute_slices: 7,
    memory_slices: 8,
    profiles: &[
        offer(1, 5, false, 19, 7, 1),
        offer(1, 5, true, 20, 1, 1),
        offer(1, 10, false, 15, 4, 2),
        offer(2, 10, false, 14, 3, 2),
        offer(3, 20, false, 9, 2, 4),
        offer(4, 20, false, 5, 1, 4),
        offer(7, 40, false, 0, 1, 8),
    ],
};

/// A100-80GB and H100-80GB share names, IDs and counts.
const X100_80_PROFILES: &[MigOffer] = &[
    offer(1, 10, false, 19, 7, 1),
    offer(1, 10, true, 20, 1, 1),
    offer(1, 20, false, 15, 4, 2),
    offer(2, 20, false, 14, 3, 2),
    offer(3, 40, false, 9, 2, 4),
    offer(4, 40, false, 5, 1, 4),
    offer(7, 80, false, 0, 1, 8),
];

const A100_80: MigModel = MigModel {
    name: "A100-80GB",
    compute_slices: 7,
    memory_slices: 8,
    profiles: X100_80_PROFILES,
};

const H100_80: MigModel = MigModel {
    name: "H100-80GB",
    compute_slices: 7,
    memory_slices: 8,
    profiles: X100_80_PROFILES,
};

/// The H200 (141 GB, SXM and NVL): the 80 GB table's IDs and counts with its own sizes.
const H200_141: MigModel = MigModel {
    name: "H200-141GB",
    compute_slices: 7,
    memory_slices: 8,
    profiles: &[
        offer(1, 18, false, 19, 7, 1),
        offer(1, 18, true, 20, 1, 1),
        offer(1, 35, false, 15, 4, 2),
        offer(2, 35, false, 14, 3, 2),
        offer(3, 71, false, 9, 2, 4),
        offer(4, 71, false, 5, 1, 4),
        offer(7, 141, false, 0, 1, 8),
    ],
};

const A30: MigModel = MigModel {
    name: "A30",
    compute_slices: 4,
    memory_slices: 4,
    profiles: &[
        offer(1, 6, false, 14, 4, 1),
        offer(1, 6, true, 21, 1, 1),
        offer(2, 12, false, 5, 2, 2),
        offer(2, 12, true, 6, 1, 2),
        offer(4, 24, false, 0, 1, 4),
    ],
};

impl MigModel {
    /// The geometry of a GPU model as `nvidia-smi` names it (`NVIDIA A100-SXM4-40GB`,
    /// `NVIDIA A100 80GB PCIe`, `NVIDIA H100 80GB HBM3`, `NVIDIA H100 PCIe`, `NVIDIA H200`,
    /// `NVIDIA H200 NVL`, `NVIDIA A30`), or `None` for a model without MIG or not known here
    /// (the H100 94/96 GB and GH200 variants have other profiles).
    pub fn of(model: &str) -> Option<Self> {
        let m = model.to_ascii_uppercase();
        if m.contains("A100") {
            Some(if m.contains("80GB") { A100_80 } else { A100_40 })
        } else if m.contains("H100")
            && !m.contains("94GB")
            && !m.contains("96GB")
            && !m.contains("NVL")
        {
            Some(H100_80)
        } else if m.contains("H200") && !m.contains("GH200") {
            // GH200 (Grace Hopper, 96 or 144 GB) has other profiles.
            Some(H200_141)
        } else if m.contains("A30") {
            Some(A30)
        } else {
            None
        }
    }

    pub fn profile(&self, profile: MigProfile) -> Option<MigOffer> {
        self.profiles.iter().copied().find(|o| o.profile == profile)
    }
}

/// One MIG device of a GPU, as the node's agent found it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigDevice {
    pub uuid: MigUuid,
    pub profile: MigProfile,
    pub memory: MemorySize,
    pub parent: GpuUuid,
}

/// A change of a GPU's MIG state that its agent makes only once nothing uses the GPU: a new
/// layout (MIG mode on where it is off), or MIG mode off (the GPU's instances destroyed), when
/// the admin sets `exclusive` or `shared:N` again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "to", content = "layout", rename_all = "snake_case")]
pub enum MigChange {
    Layout(MigLayout),
    Off,
}

impl fmt::Display for MigChange {
    /// `MIG layout 1g.10gb*7` or `MIG mode off`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Layout(layout) => write!(f, "MIG layout {layout}"),
            Self::Off => f.write_str("MIG mode off"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_layout_is_made_by_exactly_its_instances() {
        let layout: MigLayout = "3g.40gb*1+2g.20gb*2".parse().unwrap();
        let gpu = GpuUuid::parse("GPU-11111111-2222-3333-4444-555555555501").unwrap();
        let device = |n: u8, profile: &str| MigDevice {
            uuid: MigUuid::parse(&format!("MIG-11111111-2222-3333-4444-5555555555{n:02}")).unwrap(),
            profile: profile.parse().unwrap(),
            memory: MemorySize::from_mib(20_480),
            parent: gpu.clone(),
        };
        let made = [
            device(1, "2g.20gb"),
            device(2, "3g.40gb"),
            device(3, "2g.20gb"),
        ];
        assert!(layout.is_made_by(&made));
        assert!(!layout.is_made_by(&made[..2]));
        assert!(!layout.is_made_by(&[]));
        let seven: MigLayout = "1g.10gb*7".parse().unwrap();
        assert!(!seven.is_made_by(&made));
    }

    #[test]
    fn a_mig_change_reads_as_words_and_json() {
        let layout = MigChange::Layout("1g.10gb*7".parse().unwrap());
        assert_eq!(layout.to_string(), "MIG layout 1g.10gb*7");
        assert_eq!(MigChange::Off.to_string(), "MIG mode off");
        assert_eq!(
            serde_json::to_string(&layout).unwrap(),
            r#"{"to":"layout","layout":"1g.10gb*7"}"#
        );
        assert_eq!(
            serde_json::to_string(&MigChange::Off).unwrap(),
            r#"{"to":"off"}"#
        );
        for change in [layout, MigChange::Off] {
            let json = serde_json::to_string(&change).unwrap();
            assert_eq!(serde_json::from_str::<MigChange>(&json).unwrap(), change);
        }
    }

    #[test]
    fn profiles_parse_and_print() {
        for text in ["1g.10gb", "3g.40gb", "1g.5gb+me", "7g.80gb"] {
            assert_eq!(MigProfile::parse(text).unwrap().to_string(), text);
        }
        for bad in [
            "",
            "1g",
            "10gb",
            "0g.5gb",
            "8g.5gb",
            "1g.0gb",
            "1g.10",
            "xg.10gb",
            "1g.10gb+m",
        ] {
            assert!(MigProfile::parse(bad).is_err(), "{bad}");
        }
        let small = MigProfile::parse("1g.10gb").unwrap();
        let big = MigProfile::parse("3g.40gb").unwrap();
        assert!(big.covers(small));
        assert!(!small.covers(big));
        assert!(!small.covers(MigProfile::parse("1g.10gb+me").unwrap()));
        assert!(MigProfile::parse("1g.10gb+me").unwrap().covers(small));
    }

    #[test]
    fn layouts_parse_and_print() {
        let l = MigLayout::parse("3g.40gb*1+2g.20gb*2").unwrap();
        assert_eq!(l.to_string(), "3g.40gb*1+2g.20gb*2");
        assert_eq!(l.instances().len(), 3);
        let l = MigLayout::parse("1g.10gb+me*1+1g.10gb*6").unwrap();
        assert_eq!(l.to_string(), "1g.10gb+me*1+1g.10gb*6");
        assert_eq!(l.instances().len(), 7);
        for bad in [
            "",
            "1g.10gb",
            "1g.10gb*0",
            "1g.10gb*x",
            "*2",
            "1g.10gb*2+",
            "+me*1",
        ] {
            assert!(MigLayout::parse(bad).is_err(), "{bad}");
        }
        let json = serde_json::to_string(&MigLayout::parse("1g.10gb*7").unwrap()).unwrap();
        assert_eq!(json, "\"1g.10gb*7\"");
    }

    #[test]
    fn layouts_are_checked_against_the_model() {
        let ok = |l: &str, m: &str| MigLayout::parse(l).unwrap().validate_for(m);
        assert_eq!(ok("1g.10gb*7", "NVIDIA A100-SXM4-80GB"), Ok(()));
        assert_eq!(ok("3g.40gb*1+2g.20gb*2", "NVIDIA H100 80GB HBM3"), Ok(()));
        assert_eq!(ok("1g.5gb*7", "NVIDIA A100-SXM4-40GB"), Ok(()));
        assert_eq!(ok("2g.12gb*2", "NVIDIA A30"), Ok(()));
        assert_eq!(ok("4g.40gb*1+3g.40gb*1", "NVIDIA A100 80GB PCIe"), Ok(()));
        assert_eq!(ok("3g.71gb*1+2g.35gb*1+1g.18gb*2", "NVIDIA H200"), Ok(()));
        assert_eq!(ok("1g.18gb*7", "NVIDIA H200 NVL"), Ok(()));
        assert!(matches!(
            ok("1g.18gb*1", "NVIDIA GH200 144G HBM3e"),
            Err(MigError::UnknownModel(_))
        ));
        let err = ok("1g.10gb*1", "NVIDIA H200").unwrap_err();
        assert!(
            err.to_string()
                .starts_with("H200-141GB has no MIG profile 1g.10gb; its profiles are 1g.18gb"),
            "{err}"
        );
        let err = ok("1g.10gb*7", "NVIDIA A100-SXM4-40GB").unwrap_err();
        assert_eq!(
            err.to_string(),
            "A100-40GB allows at most 4 instance(s) of 1g.10gb, the layout asks for 7"
        );
        let err = ok("1g.5gb*1", "NVIDIA H100 80GB HBM3").unwrap_err();
        assert!(
            err.to_string().starts_with(
                "H100-80GB has no MIG profile 1g.5gb; its profiles are 1g.10gb, 1g.10gb+me"
            ),
            "{err}"
        );
        let err = ok("3g.40gb*2+1g.10gb*2", "NVIDIA A100-SXM4-80GB").unwrap_err();
        assert_eq!(
            err.to_string(),
            "the layout needs 8 compute slices, A100-80GB has 7"
        );
        let err = ok("4g.40gb*1+1g.20gb*3", "NVIDIA A100-SXM4-80GB").unwrap_err();
        assert_eq!(
            err.to_string(),
            "the layout needs 10 memory slices, A100-80GB has 8"
        );
        let err = ok("1g.10gb*1", "Tesla T4").unwrap_err();
        assert!(matches!(err, MigError::UnknownModel(_)));
        assert!(err.to_string().contains("no known MIG profiles"));
    }
}
