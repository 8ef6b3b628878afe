//! Quantities parsed at the edge: compute capability (`8.0`), memory sizes (`40G`, `40960M`,
//! `40GiB`) and durations in GPULab's words (`20 minutes`, `3 hours`, `2 weeks`, or `8h`).

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// A CUDA compute capability, `major.minor`, ordered numerically (`8.9 < 9.0 < 10.0`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct ComputeCapability {
    pub major: u16,
    pub minor: u16,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("compute capability {0:?} must look like 8.0 (major.minor)")]
pub struct ComputeCapabilityError(String);

impl ComputeCapability {
    pub const fn new(major: u16, minor: u16) -> Self {
        Self { major, minor }
    }

    pub fn parse(value: &str) -> Result<Self, ComputeCapabilityError> {
        let err = || ComputeCapabilityError(value.to_owned());
        let (major, minor) = value.trim().split_once('.').ok_or_else(err)?;
        let digits =
            |s: &str| !s.is_empty() && s.len() <= 3 && s.bytes().all(|b| b.is_ascii_digit());
        if !digits(major) || !digits(minor) {
            return Err(err());
        }
        Ok(Self {
            major: major.parse().map_err(|_| err())?,
            minor: minor.parse().map_err(|_| err())?,
        })
    }
}

impl fmt::Display for ComputeCapability {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

impl FromStr for ComputeCapability {
    type Err = ComputeCapabilityError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

impl TryFrom<String> for ComputeCapability {
    type Error = ComputeCapabilityError;
    fn try_from(value: String) -> Result<Self, Self::Error> {
        Self::parse(&value)
    }
}

impl From<ComputeCapability> for String {
    fn from(value: ComputeCapability) -> Self {
        value.to_string()
    }
}

/// An amount of memory in bytes.
///
/// Decimal suffixes follow the way GPUs are sold: `G`/`GB` is 10^9 bytes, so `80G` matches an
/// "H100 80GB" (which reports 81559 MiB) and `40G` an "A100 40GB". Binary suffixes (`Gi`, `GiB`,
/// `Mi`, `MiB`, ...) are powers of 1024. A bare number is bytes. Serialised as a byte count.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct MemorySize(pub u64);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MemorySizeError {
    #[error("memory size {0:?} must be a number with a unit, like 40G, 40960M or 40GiB")]
    Malformed(String),
    #[error("memory size {0:?} has unknown unit {1:?}: use K, M, G, T (powers of 1000) or Ki, Mi, Gi, Ti (powers of 1024), optionally followed by B")]
    UnknownUnit(String, String),
    #[error("memory size {0:?} is too large")]
    TooLarge(String),
}

impl MemorySize {
    pub const fn from_mib(mib: u64) -> Self {
        Self(mib * 1024 * 1024)
    }

    pub const fn bytes(self) -> u64 {
        self.0
    }

    pub const fn mib(self) -> u64 {
        self.0 / (1024 * 1024)
    }

    pub fn parse(value: &str) -> Result<Self, MemorySizeError> {
        let trimmed = value.trim();
        let split = trimmed
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(trimmed.len());
        let (number, unit) = trimmed.split_at(split);
        let unit = unit.trim();
        if number.is_empty()
            || number.starts_with('.')
            || number.ends_with('.')
            || number.matches('.').count() > 1
        {
            return Err(MemorySizeError::Malformed(value.to_owned()));
        }
        let multiplier: u64 = match unit.to_ascii_lowercase().as_str() {
            "" | "b" => 1,
            "k" | "kb" => 1000,
            "m" | "mb" => 1000u64.pow(2),
            "g" | "gb" => 1000u64.pow(3),
            "t" | "tb" => 1000u64.pow(4),
            "ki" | "kib" => 1 << 10,
            "mi" | "mib" => 1 << 20,
            "gi" | "gib" => 1 << 30,
            "ti" | "tib" => 1 << 40,
            _ => {
                return Err(MemorySizeError::UnknownUnit(
                    value.to_owned(),
                    unit.to_owned(),
                ))
            }
        };
        let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
        let too_large = || MemorySizeError::TooLarge(value.to_owned());
        let whole: u64 = whole.parse().map_err(|_| too_large())?;
        let mut bytes = whole.checked_mul(multiplier).ok_or_else(too_large)?;
        if !fraction.is_empty() {
            let digits = fraction.len().min(9) as u32;
            let frac: u64 = fraction[..digits as usize]
                .parse()
                .map_err(|_| too_large())?;
            let scale = 10u64.pow(digits);
            let extra = (u128::from(frac) * u128::from(multiplier) / u128::from(scale)) as u64;
            bytes = bytes.checked_add(extra).ok_or_else(too_large)?;
        }
        Ok(Self(bytes))
    }
}

impl fmt::Display for MemorySize {
    /// Sizes that are whole MiB (what GPUs and `nvidia-smi` report) print in the largest binary
    /// unit with one decimal (`40.0 GiB`, `79.6 GiB`); sizes that are whole decimal megabytes but
    /// not whole MiB (what users write, `80G`) print in decimal units (`80 GB`, `1.5 GB`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const BINARY: [(&str, u64); 4] = [
            ("TiB", 1 << 40),
            ("GiB", 1 << 30),
            ("MiB", 1 << 20),
            ("KiB", 1 << 10),
        ];
        const DECIMAL: [(&str, u64); 3] = [
            ("TB", 1_000_000_000_000),
            ("GB", 1_000_000_000),
            ("MB", 1_000_000),
        ];
        if !self.0.is_multiple_of(1 << 20) && self.0.is_multiple_of(1_000_000) {
            for (name, size) in DECIMAL {
                if self.0 >= size {
                    let tenths = self.0 * 10 / size;
                    return if tenths.is_multiple_of(10) {
                        write!(f, "{} {name}", tenths / 10)
                    } else {
                        write!(f, "{}.{} {name}", tenths / 10, tenths % 10)
                    };
                }
            }
        }
        for (name, size) in BINARY {
            if self.0 >= size {
                return write!(f, "{:.1} {name}", self.0 as f64 / size as f64);
            }
        }
        write!(f, "{} B", self.0)
    }
}

impl FromStr for MemorySize {
    type Err = MemorySizeError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

/// A duration written as people write it: `20 minutes`, `3 hours`, `2 weeks`, `1 day 12 hours`,
/// or compactly `90s`, `20m`, `8h`, `2d`, `1w`, `1h30m`. Serialised as whole seconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct HumanDuration(#[serde(with = "seconds")] pub Duration);

mod seconds {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(d.as_secs())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        u64::deserialize(d).map(Duration::from_secs)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DurationError {
    #[error("duration {0:?} must be a number and a unit, like \"20 minutes\", \"3 hours\", \"2 weeks\" or \"8h\"")]
    Malformed(String),
    #[error("duration {0:?} has unknown unit {1:?}: use seconds, minutes, hours, days or weeks (s, m, h, d, w)")]
    UnknownUnit(String, String),
    #[error("duration {0:?} is too long")]
    TooLong(String),
}

impl HumanDuration {
    pub const fn from_secs(secs: u64) -> Self {
        Self(Duration::from_secs(secs))
    }

    pub const fn as_duration(self) -> Duration {
        self.0
    }

    pub fn parse(value: &str) -> Result<Self, DurationError> {
        let malformed = || DurationError::Malformed(value.to_owned());
        let mut rest = value.trim();
        if rest.is_empty() {
            return Err(malformed());
        }
        let mut total: u64 = 0;
        while !rest.is_empty() {
            let digits_end = rest
                .find(|c: char| !c.is_ascii_digit())
                .unwrap_or(rest.len());
            if digits_end == 0 {
                return Err(malformed());
            }
            let number: u64 = rest[..digits_end]
                .parse()
                .map_err(|_| DurationError::TooLong(value.to_owned()))?;
            rest = rest[digits_end..].trim_start();
            let unit_end = rest
                .find(|c: char| !c.is_ascii_alphabetic())
                .unwrap_or(rest.len());
            let unit = &rest[..unit_end];
            if unit.is_empty() {
                return Err(malformed());
            }
            let seconds_per = unit_seconds(unit)
                .ok_or_else(|| DurationError::UnknownUnit(value.to_owned(), unit.to_owned()))?;
            total = number
                .checked_mul(seconds_per)
                .and_then(|s| total.checked_add(s))
                .ok_or_else(|| DurationError::TooLong(value.to_owned()))?;
            rest = rest[unit_end..].trim_start();
            rest = rest.strip_prefix(',').unwrap_or(rest).trim_start();
            rest = rest.strip_prefix("and ").unwrap_or(rest).trim_start();
        }
        Ok(Self(Duration::from_secs(total)))
    }
}

fn unit_seconds(unit: &str) -> Option<u64> {
    Some(match unit.to_ascii_lowercase().as_str() {
        "s" | "sec" | "secs" | "second" | "seconds" => 1,
        "m" | "min" | "mins" | "minute" | "minutes" => 60,
        "h" | "hr" | "hrs" | "hour" | "hours" => 3600,
        "d" | "day" | "days" => 86_400,
        "w" | "week" | "weeks" => 604_800,
        _ => return None,
    })
}

impl fmt::Display for HumanDuration {
    /// The largest units first, at most two of them: `2 weeks`, `1 hour 30 minutes`, `45 seconds`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut secs = self.0.as_secs();
        if secs == 0 {
            return f.write_str("0 seconds");
        }
        let units = [
            ("week", 604_800),
            ("day", 86_400),
            ("hour", 3600),
            ("minute", 60),
            ("second", 1),
        ];
        let mut written = 0;
        for (name, size) in units {
            if written == 2 {
                break;
            }
            let n = secs / size;
            if n > 0 {
                if written > 0 {
                    f.write_str(" ")?;
                }
                write!(f, "{n} {name}{}", if n == 1 { "" } else { "s" })?;
                secs -= n * size;
                written += 1;
            } else if written > 0 {
                break;
            }
        }
        Ok(())
    }
}

impl FromStr for HumanDuration {
    type Err = DurationError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn capabilities() {
        assert_eq!(
            ComputeCapability::parse("8.0").unwrap(),
            ComputeCapability::new(8, 0)
        );
        assert!(
            ComputeCapability::parse("8.9").unwrap() < ComputeCapability::parse("9.0").unwrap()
        );
        assert!(
            ComputeCapability::parse("9.0").unwrap() < ComputeCapability::parse("10.0").unwrap()
        );
        assert!(
            ComputeCapability::parse("8.10").unwrap() > ComputeCapability::parse("8.9").unwrap()
        );
        for bad in ["8", "8.", ".0", "a.b", "8.0.1", "", "-1.0", "1234.0"] {
            assert!(ComputeCapability::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn memory_sizes() {
        let gb = 1_000_000_000u64;
        assert_eq!(MemorySize::parse("40G").unwrap().bytes(), 40 * gb);
        assert_eq!(MemorySize::parse("40GB").unwrap().bytes(), 40 * gb);
        assert_eq!(
            MemorySize::parse("40960M").unwrap().bytes(),
            40_960 * 1_000_000
        );
        assert_eq!(MemorySize::parse("40GiB").unwrap().bytes(), 40 << 30);
        assert_eq!(MemorySize::parse("40Gi").unwrap().bytes(), 40 << 30);
        assert_eq!(MemorySize::parse("1.5G").unwrap().bytes(), 1_500_000_000);
        assert_eq!(MemorySize::parse("512").unwrap().bytes(), 512);
        assert_eq!(MemorySize::parse(" 8 gib ").unwrap().bytes(), 8 << 30);
        // An H100 80GB reports 81559 MiB and must satisfy --min-gpu-memory 80G.
        assert!(MemorySize::from_mib(81_559) >= MemorySize::parse("80G").unwrap());
        assert!(MemorySize::from_mib(40_960) >= MemorySize::parse("40G").unwrap());
        assert!(matches!(
            MemorySize::parse("40X"),
            Err(MemorySizeError::UnknownUnit(..))
        ));
        assert!(matches!(
            MemorySize::parse("G"),
            Err(MemorySizeError::Malformed(_))
        ));
        assert!(matches!(
            MemorySize::parse("1.2.3G"),
            Err(MemorySizeError::Malformed(_))
        ));
        assert!(matches!(
            MemorySize::parse("99999999999T"),
            Err(MemorySizeError::TooLarge(_))
        ));
        assert_eq!(MemorySize::from_mib(40_960).to_string(), "40.0 GiB");
        assert_eq!(MemorySize::from_mib(81_559).to_string(), "79.6 GiB");
        assert_eq!(MemorySize::parse("80G").unwrap().to_string(), "80 GB");
        assert_eq!(MemorySize::parse("1.5G").unwrap().to_string(), "1.5 GB");
        assert_eq!(MemorySize::parse("40960M").unwrap().to_string(), "40.9 GB");
        assert_eq!(MemorySize::parse("16GiB").unwrap().to_string(), "16.0 GiB");
        assert_eq!(MemorySize(512).to_string(), "512 B");
    }

    #[test]
    fn durations() {
        let secs = |s: &str| HumanDuration::parse(s).unwrap().0.as_secs();
        assert_eq!(secs("20 minutes"), 1200);
        assert_eq!(secs("1 minute"), 60);
        assert_eq!(secs("3 hours"), 10_800);
        assert_eq!(secs("2 weeks"), 1_209_600);
        assert_eq!(secs("1 week"), 604_800);
        assert_eq!(secs("1 day 12 hours"), 129_600);
        assert_eq!(secs("1 day, 12 hours and 5 minutes"), 129_900);
        assert_eq!(secs("8h"), 28_800);
        assert_eq!(secs("1h30m"), 5400);
        assert_eq!(secs("90s"), 90);
        assert_eq!(secs("2 Weeks"), 1_209_600);
        assert!(matches!(
            HumanDuration::parse("20"),
            Err(DurationError::Malformed(_))
        ));
        assert!(matches!(
            HumanDuration::parse("minutes"),
            Err(DurationError::Malformed(_))
        ));
        assert!(matches!(
            HumanDuration::parse("3 fortnights"),
            Err(DurationError::UnknownUnit(..))
        ));
        assert!(matches!(
            HumanDuration::parse(""),
            Err(DurationError::Malformed(_))
        ));
        assert!(matches!(
            HumanDuration::parse("99999999999999999999 weeks"),
            Err(DurationError::TooLong(_))
        ));
        assert_eq!(HumanDuration::from_secs(1_209_600).to_string(), "2 weeks");
        assert_eq!(
            HumanDuration::from_secs(5400).to_string(),
            "1 hour 30 minutes"
        );
        assert_eq!(HumanDuration::from_secs(3605).to_string(), "1 hour");
        assert_eq!(HumanDuration::from_secs(0).to_string(), "0 seconds");
    }

    proptest! {
        #[test]
        fn duration_parse_never_panics(s in "\\PC{0,40}") {
            let _ = HumanDuration::parse(&s);
        }

        #[test]
        fn memory_parse_never_panics(s in "\\PC{0,30}") {
            let _ = MemorySize::parse(&s);
        }

        #[test]
        fn duration_display_parses_back_when_exact(secs in 0u64..10_000_000) {
            let d = HumanDuration::from_secs(secs);
            let back = HumanDuration::parse(&d.to_string()).unwrap();
            // Display keeps two units, so it rounds down and never up.
            prop_assert!(back <= d);
        }

        #[test]
        fn capability_roundtrip(major in 0u16..999, minor in 0u16..999) {
            let cc = ComputeCapability::new(major, minor);
            prop_assert_eq!(ComputeCapability::parse(&cc.to_string()).unwrap(), cc);
        }
    }
}
