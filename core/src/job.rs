//! Batch jobs (DESIGN.md "Batch"): what a job asks for, its state machine in GPULab's words,
//! the typed reasons of its transitions, and the facts of a restart chain.
//!
//! - [`JobSpec`] is a validated job: a frozen image (tag or digest, as `devctl image` names
//!   them), a command, a [`GpuRequest`], limits, GPULab's scheduling options and the
//!   environment. It is target-neutral: the local target (the manager's scheduler and agents)
//!   and grid targets (HTCondor, Slurm) read the same spec. [`JobSpecFile`] is the same fields as
//!   `devctl job submit`'s flags, as written in a TOML file (`deploy/examples/job.toml`), and
//!   [`JobSpecFile::validate`] turns it into a spec with errors naming the field and the fix.
//! - [`JobState`]: `QUEUED → RUNNING → FINISHED | FAILED | CANCELLED` and
//!   `RUNNING → MUSTHALT → HALTING → HALTED`. [`JobLifecycle::transition`] is the only way to
//!   move, and refuses illegal moves; every transition carries a [`JobReason`], which is data
//!   (stored and sent as JSON) and rendered to a sentence for people, never parsed back.
//! - Halting is SIGUSR1, then exit code [`HALT_EXIT_CODE`] (123) within [`HALT_GRACE`] (15 s),
//!   else SIGKILL. Exit code [`CHECKPOINT_EXIT_CODE`] (85, HTCondor's convention) asks to be
//!   re-queued. [`JobState::after_exit`] maps an exit to the next state and reason.
//! - A re-queued job is a new job of the same [`RestartChain`]: the restart count goes up, the
//!   initial job id stays, and the max duration left is what the chain has not used
//!   ([`remaining_max_duration`]). [`RestartChain::env`] is what the job sees of it.
//!
//! Pure: no I/O, no clock (`now` is an argument where time matters).

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::container::{ContainerLimits, ContainerUser};
use crate::gpu::{GpuId, GpuRequest, Sharing};
use crate::image::ImageLookup;
use crate::names::NodeName;
use crate::quantity::{ComputeCapability, HumanDuration, MemorySize};

/// The exit code of a job that stopped because it was asked to halt (GPULab's convention).
pub const HALT_EXIT_CODE: i32 = 123;
/// The exit code of a job that wrote a checkpoint and asks to be re-queued (HTCondor's
/// `checkpoint_exit_code` convention).
pub const CHECKPOINT_EXIT_CODE: i32 = 85;
/// How long a job has between SIGUSR1 and SIGKILL, unless the node's agent is configured
/// otherwise (`[images] job_halt_grace` in its config).
pub const HALT_GRACE: Duration = Duration::from_secs(15);
/// The signal that asks a job to halt.
pub const HALT_SIGNAL: &str = "SIGUSR1";

/// The job's own id, in its environment.
pub const ENV_JOB_ID: &str = "ONGRID_JOB_ID";
/// How many times the chain was re-queued before this job (0 for the first job).
pub const ENV_RESTART_COUNT: &str = "ONGRID_RESTART_COUNT";
/// The id of the chain's first job.
pub const ENV_RESTART_INITIAL_JOB_ID: &str = "ONGRID_RESTART_INITIAL_JOB_ID";

/// A job's permanent identifier; a re-queued job gets a new one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct JobId(pub uuid::Uuid);

impl JobId {
    pub fn new_random() -> Self {
        Self(uuid::Uuid::new_v4())
    }

    /// The Docker container name of this job: `ongrid-job-<id>`.
    pub fn container_name(&self) -> String {
        format!("ongrid-job-{}", self.0.simple())
    }
}

impl fmt::Display for JobId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl FromStr for JobId {
    type Err = uuid::Error;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        uuid::Uuid::parse_str(s).map(Self)
    }
}

// ---------------------------------------------------------------------------------------------
// The pieces of a spec, each parsed at the edge.

/// Why one field of a job was refused: the field (as the flag and the file name it) and what to
/// do. Displayed as `<field>: <problem>`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {problem}")]
pub struct JobSpecError {
    pub field: &'static str,
    pub problem: String,
}

impl JobSpecError {
    fn new(field: &'static str, problem: impl fmt::Display) -> Self {
        Self {
            field,
            problem: problem.to_string(),
        }
    }
}

/// The program to run and its arguments, as an argv: no shell is involved. At least the
/// program; at most [`Command::MAX_ARGS`] entries; no NUL bytes.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "Vec<String>", into = "Vec<String>")]
pub struct Command(Vec<String>);

impl Command {
    pub const MAX_ARGS: usize = 4096;
    /// All arguments together, in bytes.
    pub const MAX_BYTES: usize = 128 * 1024;

    pub fn new(argv: Vec<String>) -> Result<Self, JobSpecError> {
        let bad = |problem: &str| JobSpecError::new("command", problem);
        match argv.first() {
            None => {
                return Err(bad(
                    "is empty: give the program and its arguments, like -- python train.py \
                     (command = [\"python\", \"train.py\"] in a file)",
                ))
            }
            Some(program) if program.trim().is_empty() => {
                return Err(bad("starts with an empty program name"))
            }
            Some(_) => {}
        }
        if argv.len() > Self::MAX_ARGS {
            return Err(bad(&format!(
                "has {} arguments, more than {}: pass long lists in a file",
                argv.len(),
                Self::MAX_ARGS
            )));
        }
        if argv.iter().map(String::len).sum::<usize>() > Self::MAX_BYTES {
            return Err(bad(&format!(
                "is longer than {} KiB: pass long lists in a file",
                Self::MAX_BYTES / 1024
            )));
        }
        if argv.iter().any(|arg| arg.contains('\0')) {
            return Err(bad("contains a NUL byte"));
        }
        Ok(Self(argv))
    }

    pub fn program(&self) -> &str {
        &self.0[0]
    }

    pub fn args(&self) -> &[String] {
        &self.0[1..]
    }

    pub fn argv(&self) -> &[String] {
        &self.0
    }
}

impl TryFrom<Vec<String>> for Command {
    type Error = JobSpecError;
    fn try_from(value: Vec<String>) -> Result<Self, Self::Error> {
        Self::new(value)
    }
}

impl From<Command> for Vec<String> {
    fn from(value: Command) -> Self {
        value.0
    }
}

/// CPUs for the job's container, in thousandths (`1.5` is 1500), as Docker's `--cpus` takes
/// them. Written and serialised as a number of CPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Cpus(u32);

impl Cpus {
    pub const MAX: u32 = 1024;

    pub fn from_millis(millis: u32) -> Result<Self, JobSpecError> {
        if millis == 0 || millis > Self::MAX * 1000 {
            return Err(JobSpecError::new(
                "cpus",
                format!(
                    "{} must be more than 0 and at most {}",
                    Self(millis),
                    Self::MAX
                ),
            ));
        }
        Ok(Self(millis))
    }

    /// `4`, `0.5`, `1.25`: at most three decimals.
    pub fn parse(text: &str) -> Result<Self, JobSpecError> {
        let bad = || {
            JobSpecError::new(
                "cpus",
                format!("{text:?} must be a number of CPUs like 4 or 0.5 (at most 3 decimals)"),
            )
        };
        let text = text.trim();
        let (whole, fraction) = text.split_once('.').unwrap_or((text, ""));
        let digits = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
        if whole.is_empty() || whole.len() > 7 || !digits(whole) {
            return Err(bad());
        }
        if fraction.len() > 3 || !digits(fraction) || (text.contains('.') && fraction.is_empty()) {
            return Err(bad());
        }
        let whole: u32 = whole.parse().map_err(|_| bad())?;
        let fraction: u32 = format!("{fraction:0<3}").parse().map_err(|_| bad())?;
        let millis = whole
            .checked_mul(1000)
            .and_then(|m| m.checked_add(fraction))
            .ok_or_else(bad)?;
        Self::from_millis(millis)
    }

    pub fn millis(self) -> u32 {
        self.0
    }

    /// What Docker's `NanoCpus` takes.
    pub fn nano_cpus(self) -> i64 {
        i64::from(self.0) * 1_000_000
    }
}

impl fmt::Display for Cpus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (whole, fraction) = (self.0 / 1000, self.0 % 1000);
        if fraction == 0 {
            write!(f, "{whole}")
        } else {
            let decimals = format!("{fraction:03}");
            write!(f, "{whole}.{}", decimals.trim_end_matches('0'))
        }
    }
}

impl FromStr for Cpus {
    type Err = JobSpecError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

impl Serialize for Cpus {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_f64(f64::from(self.0) / 1000.0)
    }
}

impl<'de> Deserialize<'de> for Cpus {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let number = CpuNumber::deserialize(deserializer)?;
        Self::parse(&number.to_string()).map_err(serde::de::Error::custom)
    }
}

/// A number of CPUs as written: `4` or `0.5`.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(untagged)]
pub enum CpuNumber {
    Whole(u64),
    Fraction(f64),
}

impl fmt::Display for CpuNumber {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Whole(n) => write!(f, "{n}"),
            // Round to the milli-CPU the type keeps; `{}` of an f64 never uses exponents.
            Self::Fraction(x) => write!(f, "{}", (x * 1000.0).round() / 1000.0),
        }
    }
}

/// A bucket's name: lower-case letters, digits, `-` and `_`, 1 to 40 characters.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct BucketName(String);

impl BucketName {
    pub const MAX_LEN: usize = 40;

    pub fn parse(value: &str) -> Result<Self, JobSpecError> {
        let ok = !value.is_empty()
            && value.len() <= Self::MAX_LEN
            && value
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_');
        if ok {
            Ok(Self(value.to_owned()))
        } else {
            Err(JobSpecError::new(
                "bucket",
                format!(
                    "name {value:?} must be 1 to {} lower-case letters, digits, - or _",
                    Self::MAX_LEN
                ),
            ))
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for BucketName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl TryFrom<String> for BucketName {
    type Error = JobSpecError;
    fn try_from(value: String) -> Result<Self, Self::Error> {
        Self::parse(&value)
    }
}

impl From<BucketName> for String {
    fn from(value: BucketName) -> Self {
        value.0
    }
}

/// `NAME:MAX`: at most `max` of the owner's jobs in bucket `name` run at once.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Bucket {
    pub name: BucketName,
    pub max: u32,
}

impl Bucket {
    pub const MAX_RUNNING: u32 = 10_000;

    pub fn parse(text: &str) -> Result<Self, JobSpecError> {
        let bad = |why: &str| {
            JobSpecError::new(
                "bucket",
                format!("{text:?} {why}: write NAME:MAX, like sweep:4 (at most 4 of your jobs in bucket sweep run at once)"),
            )
        };
        let (name, max) = text.split_once(':').ok_or_else(|| bad("has no :MAX"))?;
        let name = BucketName::parse(name)?;
        let max: u32 = max
            .parse()
            .map_err(|_| bad("has a MAX that is not a whole number"))?;
        if max == 0 || max > Self::MAX_RUNNING {
            return Err(bad(&format!(
                "has a MAX outside 1 to {}",
                Self::MAX_RUNNING
            )));
        }
        Ok(Self { name, max })
    }
}

impl fmt::Display for Bucket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.name, self.max)
    }
}

impl FromStr for Bucket {
    type Err = JobSpecError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

impl TryFrom<String> for Bucket {
    type Error = JobSpecError;
    fn try_from(value: String) -> Result<Self, Self::Error> {
        Self::parse(&value)
    }
}

impl From<Bucket> for String {
    fn from(value: Bucket) -> Self {
        value.to_string()
    }
}

/// Variables a job may not set: ongrid's own (`ONGRID_*`, its job id and restart chain) and the
/// ones that decide which GPUs the container gets.
const RESERVED_ENV: [&str; 2] = ["CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"];

/// The job's own environment variables, by name. Names are `[A-Za-z_][A-Za-z0-9_]*`; ongrid's
/// `ONGRID_*` and the GPU variables (`CUDA_VISIBLE_DEVICES`, `NVIDIA_VISIBLE_DEVICES`) are
/// refused, since ongrid sets them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(
    try_from = "BTreeMap<String, String>",
    into = "BTreeMap<String, String>"
)]
pub struct JobEnv(BTreeMap<String, String>);

impl JobEnv {
    pub const MAX_VARS: usize = 256;
    pub const MAX_VALUE: usize = 32 * 1024;

    /// Checks one variable's name and value.
    pub fn check(name: &str, value: &str) -> Result<(), JobSpecError> {
        let bad = |problem: String| JobSpecError::new("env", problem);
        let mut chars = name.chars();
        let first_ok = chars
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_');
        if !first_ok || !chars.all(|c| c.is_ascii_alphanumeric() || c == '_') || name.len() > 128 {
            return Err(bad(format!(
                "name {name:?} must be letters, digits and _ (not starting with a digit), at most 128"
            )));
        }
        if name.to_ascii_uppercase().starts_with("ONGRID_") {
            return Err(bad(format!(
                "{name} is ongrid's own (ONGRID_JOB_ID, ONGRID_RESTART_COUNT, ...): choose another name"
            )));
        }
        if RESERVED_ENV.contains(&name) {
            return Err(bad(format!(
                "{name} is set by ongrid to the job's GPUs: ask for GPUs with --gpus instead"
            )));
        }
        if value.contains('\0') {
            return Err(bad(format!("the value of {name} contains a NUL byte")));
        }
        if value.len() > Self::MAX_VALUE {
            return Err(bad(format!(
                "the value of {name} is longer than {} KiB",
                Self::MAX_VALUE / 1024
            )));
        }
        Ok(())
    }

    pub fn new(vars: BTreeMap<String, String>) -> Result<Self, JobSpecError> {
        if vars.len() > Self::MAX_VARS {
            return Err(JobSpecError::new(
                "env",
                format!("has {} variables, more than {}", vars.len(), Self::MAX_VARS),
            ));
        }
        for (name, value) in &vars {
            Self::check(name, value)?;
        }
        Ok(Self(vars))
    }

    /// From `K=V` pairs as `--env` takes them; a name given twice is refused.
    pub fn from_pairs<'a>(pairs: impl IntoIterator<Item = &'a str>) -> Result<Self, JobSpecError> {
        let mut vars = BTreeMap::new();
        for pair in pairs {
            let (name, value) = pair
                .split_once('=')
                .ok_or_else(|| JobSpecError::new("env", format!("{pair:?} must be NAME=VALUE")))?;
            if vars.insert(name.to_owned(), value.to_owned()).is_some() {
                return Err(JobSpecError::new("env", format!("{name} is given twice")));
            }
        }
        Self::new(vars)
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        self.0.iter().map(|(k, v)| (k.as_str(), v.as_str()))
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl TryFrom<BTreeMap<String, String>> for JobEnv {
    type Error = JobSpecError;
    fn try_from(value: BTreeMap<String, String>) -> Result<Self, Self::Error> {
        Self::new(value)
    }
}

impl From<JobEnv> for BTreeMap<String, String> {
    fn from(value: JobEnv) -> Self {
        value.0
    }
}

/// Where a job runs: on the site's own GPUs through the manager's scheduler, or handed to a
/// grid batch system.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum JobTarget {
    #[default]
    Local,
    Htcondor,
    Slurm,
}

impl FromStr for JobTarget {
    type Err = JobSpecError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "local" => Ok(Self::Local),
            "htcondor" => Ok(Self::Htcondor),
            "slurm" => Ok(Self::Slurm),
            other => Err(JobSpecError::new(
                "target",
                format!("{other:?} must be one of local, htcondor, slurm"),
            )),
        }
    }
}

impl fmt::Display for JobTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Local => "local",
            Self::Htcondor => "htcondor",
            Self::Slurm => "slurm",
        })
    }
}

/// A time as `--not-before`/`--not-after` take it: RFC 3339 (`2026-11-24T08:00:00Z`,
/// `2026-11-24T09:00:00+01:00`), `now`, or a duration from now (`+2h`, `in 30 minutes`).
pub fn parse_time(
    field: &'static str,
    text: &str,
    now: DateTime<Utc>,
) -> Result<DateTime<Utc>, JobSpecError> {
    let trimmed = text.trim();
    if trimmed == "now" {
        return Ok(now);
    }
    let relative = trimmed
        .strip_prefix('+')
        .or_else(|| trimmed.strip_prefix("in "));
    if let Some(relative) = relative {
        let duration = HumanDuration::parse(relative).map_err(|e| JobSpecError::new(field, e))?;
        return chrono::Duration::from_std(duration.as_duration())
            .ok()
            .and_then(|d| now.checked_add_signed(d))
            .ok_or_else(|| JobSpecError::new(field, format!("{text:?} is too far ahead")));
    }
    DateTime::parse_from_rfc3339(trimmed)
        .map(|t| t.with_timezone(&Utc))
        .map_err(|_| {
            JobSpecError::new(
                field,
                format!(
                    "{text:?} must be a time with its zone, like 2026-11-24T08:00:00Z or \
                     2026-11-24T09:00:00+01:00, or a time from now, like +2h"
                ),
            )
        })
}

// ---------------------------------------------------------------------------------------------
// The spec.

/// A validated job. Every field is valid on its own (its type says so) and together
/// (`min_duration <= max_duration`, `not_before < not_after`), also when deserialised: the
/// manager can trust a spec it received.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "UncheckedJobSpec")]
pub struct JobSpec {
    /// A frozen image as `devctl image` names it: `name:version` (the caller's own),
    /// `login/name:version` (its owner's, shared) or `sha256:<hex>`.
    #[serde(with = "image_lookup")]
    pub image: ImageLookup,
    pub command: Command,
    pub gpus: GpuRequest,
    /// CPU limit; the site's default when absent.
    pub cpus: Option<Cpus>,
    /// Memory limit; the site's default when absent.
    pub memory: Option<MemorySize>,
    /// Halted when still running this long after it started; the site's default when absent
    /// (and never more than the site's maximum).
    pub max_duration: Option<HumanDuration>,
    /// Never halted for an interactive session within this long after it started.
    pub min_duration: Option<HumanDuration>,
    /// A HALTED job is re-queued as a new job with the max duration it has left.
    pub restartable: bool,
    /// Never started before this time.
    pub not_before: Option<DateTime<Utc>>,
    /// CANCELLED when not started by this time.
    pub not_after: Option<DateTime<Utc>>,
    pub bucket: Option<Bucket>,
    pub env: JobEnv,
    /// Mount the owner's home volume read-write (it is not mounted otherwise).
    pub home: bool,
    /// Where it runs; `None`: the site's default (`[targets] default` in the manager's config),
    /// which the manager writes into the spec it stores.
    #[serde(default)]
    pub target: Option<JobTarget>,
}

/// [`JobSpec`]'s fields before the checks that span several of them.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct UncheckedJobSpec {
    #[serde(with = "image_lookup")]
    image: ImageLookup,
    command: Command,
    gpus: GpuRequest,
    #[serde(default)]
    cpus: Option<Cpus>,
    #[serde(default)]
    memory: Option<MemorySize>,
    #[serde(default)]
    max_duration: Option<HumanDuration>,
    #[serde(default)]
    min_duration: Option<HumanDuration>,
    #[serde(default)]
    restartable: bool,
    #[serde(default)]
    not_before: Option<DateTime<Utc>>,
    #[serde(default)]
    not_after: Option<DateTime<Utc>>,
    #[serde(default)]
    bucket: Option<Bucket>,
    #[serde(default)]
    env: JobEnv,
    #[serde(default)]
    home: bool,
    #[serde(default)]
    target: Option<JobTarget>,
}

impl TryFrom<UncheckedJobSpec> for JobSpec {
    type Error = JobSpecError;
    fn try_from(u: UncheckedJobSpec) -> Result<Self, Self::Error> {
        let spec = Self {
            image: u.image,
            command: u.command,
            gpus: u.gpus,
            cpus: u.cpus,
            memory: u.memory,
            max_duration: u.max_duration,
            min_duration: u.min_duration,
            restartable: u.restartable,
            not_before: u.not_before,
            not_after: u.not_after,
            bucket: u.bucket,
            env: u.env,
            home: u.home,
            target: u.target,
        };
        spec.check()?;
        Ok(spec)
    }
}

impl JobSpec {
    /// The rules that span fields. Construct specs through [`JobSpecFile::validate`] or serde,
    /// which call this; call it again after changing fields by hand.
    pub fn check(&self) -> Result<(), JobSpecError> {
        self.gpus
            .validate()
            .map_err(|e| JobSpecError::new("gpus", e.to_string().replace("session", "job")))?;
        if self.memory.is_some_and(|m| m.bytes() < 4 * 1024 * 1024) {
            return Err(JobSpecError::new(
                "memory",
                "must be at least 4 MiB (Docker's minimum), like 16G",
            ));
        }
        if self.max_duration.is_some_and(|d| d.as_duration().is_zero()) {
            return Err(JobSpecError::new(
                "max-duration",
                "must be longer than 0, like 8h",
            ));
        }
        if let (Some(min), Some(max)) = (self.min_duration, self.max_duration) {
            if min > max {
                return Err(JobSpecError::new(
                    "min-duration",
                    format!(
                        "{min} is longer than max-duration {max}: shorten it or raise max-duration"
                    ),
                ));
            }
        }
        if let (Some(before), Some(after)) = (self.not_before, self.not_after) {
            if before >= after {
                return Err(JobSpecError::new(
                    "not-after",
                    format!(
                        "{} is not later than not-before {}: the job could never start",
                        after.to_rfc3339(),
                        before.to_rfc3339()
                    ),
                ));
            }
        }
        Ok(())
    }
}

mod image_lookup {
    use serde::{Deserialize, Deserializer, Serializer};

    use crate::image::ImageLookup;

    pub fn serialize<S: Serializer>(image: &ImageLookup, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(image)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<ImageLookup, D::Error> {
        let text = String::deserialize(d)?;
        ImageLookup::parse(&text).map_err(serde::de::Error::custom)
    }
}

/// A time in a job file: a TOML date-time (`not_before = 2026-11-24T08:00:00Z`) or a string
/// as the flag takes it (`"+2h"`).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(untagged)]
pub enum TimeText {
    Native(toml::value::Datetime),
    Text(String),
}

impl TimeText {
    fn parse(
        &self,
        field: &'static str,
        now: DateTime<Utc>,
    ) -> Result<DateTime<Utc>, JobSpecError> {
        match self {
            Self::Native(datetime) if datetime.offset.is_none() => Err(JobSpecError::new(
                field,
                format!("{datetime} has no time zone: add Z (UTC) or an offset like +01:00"),
            )),
            Self::Native(datetime) => parse_time(field, &datetime.to_string(), now),
            Self::Text(text) => parse_time(field, text, now),
        }
    }
}

impl From<&str> for TimeText {
    fn from(value: &str) -> Self {
        Self::Text(value.to_owned())
    }
}

/// A job as written in a TOML file or given as `devctl job submit` flags: the same fields,
/// as text, not yet checked. See `deploy/examples/job.toml`. Field names are the flags' with
/// `_` for `-`; unknown fields are refused.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobSpecFile {
    /// `mymodel:v1`, `alice/mymodel:v1` (shared) or `sha256:<hex>`.
    pub image: Option<String>,
    /// The program and its arguments.
    #[serde(default)]
    pub command: Vec<String>,
    /// How many GPUs (1 when absent).
    pub gpus: Option<u32>,
    /// e.g. `"8.0"`.
    pub min_capability: Option<String>,
    /// e.g. `"40G"`.
    pub min_gpu_memory: Option<String>,
    /// `exclusive` (default), `shared`, `any`, or `mig:PROFILE` for one MIG device of at least
    /// that profile (e.g. `mig:1g.10gb`; `gpus` must then be 1).
    pub share: Option<String>,
    /// e.g. `4` or `0.5`.
    pub cpus: Option<CpuNumber>,
    /// e.g. `"16G"`.
    pub memory: Option<String>,
    /// e.g. `"8h"` or `"2 days"`.
    pub max_duration: Option<String>,
    /// e.g. `"1h"`.
    pub min_duration: Option<String>,
    #[serde(default)]
    pub restartable: bool,
    pub not_before: Option<TimeText>,
    pub not_after: Option<TimeText>,
    /// `NAME:MAX`.
    pub bucket: Option<String>,
    /// `NAME = "value"`.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Mount the home volume read-write.
    #[serde(default)]
    pub home: bool,
    /// `local`, `htcondor` or `slurm`; absent: the site's default.
    pub target: Option<String>,
}

impl JobSpecFile {
    /// Parses a job file's text (not yet validated: see [`JobSpecFile::validate`]).
    pub fn from_toml(text: &str) -> Result<Self, toml::de::Error> {
        toml::from_str(text)
    }

    /// Checks every field and turns the file into a spec. `now` resolves relative times.
    pub fn validate(self, now: DateTime<Utc>) -> Result<JobSpec, JobSpecError> {
        let image = self.image.as_deref().ok_or_else(|| {
            JobSpecError::new("image", "is missing: name a frozen image, like mymodel:v1")
        })?;
        let image = ImageLookup::parse(image).map_err(|e| JobSpecError::new("image", e))?;
        let command = Command::new(self.command)?;
        let parse_memory = |field, text: Option<String>| {
            text.map(|t| MemorySize::parse(&t).map_err(|e| JobSpecError::new(field, e)))
                .transpose()
        };
        let parse_duration = |field, text: Option<String>| {
            text.map(|t| HumanDuration::parse(&t).map_err(|e| JobSpecError::new(field, e)))
                .transpose()
        };
        let gpus = GpuRequest {
            count: self.gpus.unwrap_or(1),
            min_capability: self
                .min_capability
                .map(|t| {
                    ComputeCapability::parse(&t).map_err(|e| JobSpecError::new("min-capability", e))
                })
                .transpose()?,
            min_memory: parse_memory("min-gpu-memory", self.min_gpu_memory)?,
            sharing: self
                .share
                .map(|t| {
                    t.parse::<Sharing>()
                        .map_err(|e| JobSpecError::new("share", e))
                })
                .transpose()?
                .unwrap_or_default(),
        };
        let spec = JobSpec {
            image,
            command,
            gpus,
            cpus: self.cpus.map(|n| Cpus::parse(&n.to_string())).transpose()?,
            memory: parse_memory("memory", self.memory)?,
            max_duration: parse_duration("max-duration", self.max_duration)?,
            min_duration: parse_duration("min-duration", self.min_duration)?,
            restartable: self.restartable,
            not_before: self
                .not_before
                .map(|t| t.parse("not-before", now))
                .transpose()?,
            not_after: self
                .not_after
                .map(|t| t.parse("not-after", now))
                .transpose()?,
            bucket: self.bucket.map(|t| Bucket::parse(&t)).transpose()?,
            env: JobEnv::new(self.env)?,
            home: self.home,
            target: self.target.map(|t| t.parse()).transpose()?,
        };
        spec.check()?;
        if let Some(not_after) = spec.not_after.filter(|&t| t <= now) {
            return Err(JobSpecError::new(
                "not-after",
                format!(
                    "{} has passed: the job would be cancelled at once; give a later time",
                    not_after.to_rfc3339()
                ),
            ));
        }
        Ok(spec)
    }
}

/// A GPU request in words, as a halt reason names a session's need: "1 GPU", "2 GPUs with
/// compute capability 8.0 or more and 40 GB of memory or more, shared".
pub fn describe_need(request: &GpuRequest) -> String {
    let mut text = format!(
        "{} GPU{}",
        request.count,
        if request.count == 1 { "" } else { "s" }
    );
    let mut parts = Vec::new();
    if let Some(capability) = request.min_capability {
        parts.push(format!("compute capability {capability} or more"));
    }
    if let Some(memory) = request.min_memory {
        parts.push(format!("{memory} of memory or more"));
    }
    if let Some((last, rest)) = parts.split_last() {
        text.push_str(" with ");
        if !rest.is_empty() {
            text.push_str(&rest.join(", "));
            text.push_str(" and ");
        }
        text.push_str(last);
    }
    match request.sharing {
        Sharing::Exclusive => {}
        Sharing::Shared => text.push_str(", shared"),
        Sharing::Any => text.push_str(", whole or shared"),
        Sharing::Mig(profile) => text.push_str(&format!(", a MIG {profile} device or larger")),
    }
    text
}

// ---------------------------------------------------------------------------------------------
// States and reasons.

/// A job's state, in GPULab's words.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum JobState {
    /// Waiting for GPUs (and for its notBefore, and room in its bucket).
    Queued,
    /// Its container runs on a node.
    Running,
    /// Asked to halt; the agent has not sent SIGUSR1 yet. Still holds its GPUs.
    #[serde(rename = "MUSTHALT")]
    MustHalt,
    /// SIGUSR1 sent; it has 15 s to exit with code 123. Still holds its GPUs.
    Halting,
    /// Stopped on request (or by its own checkpoint exit); a restartable job's chain goes on
    /// as a new job.
    Halted,
    /// Exited with code 0.
    Finished,
    /// Could not run, or exited with an error; the reason says which.
    Failed,
    /// Cancelled by its owner, or not started by its notAfter.
    Cancelled,
}

impl JobState {
    pub const ALL: [JobState; 8] = [
        Self::Queued,
        Self::Running,
        Self::MustHalt,
        Self::Halting,
        Self::Halted,
        Self::Finished,
        Self::Failed,
        Self::Cancelled,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Queued => "QUEUED",
            Self::Running => "RUNNING",
            Self::MustHalt => "MUSTHALT",
            Self::Halting => "HALTING",
            Self::Halted => "HALTED",
            Self::Finished => "FINISHED",
            Self::Failed => "FAILED",
            Self::Cancelled => "CANCELLED",
        }
    }

    /// Whether nothing can follow.
    pub fn is_final(self) -> bool {
        matches!(
            self,
            Self::Halted | Self::Finished | Self::Failed | Self::Cancelled
        )
    }

    /// States in which the job holds GPUs: its container exists on a node.
    pub fn holds_gpus(self) -> bool {
        matches!(self, Self::Running | Self::MustHalt | Self::Halting)
    }

    /// Whether `self → to` is allowed.
    pub fn can_become(self, to: JobState) -> bool {
        use JobState::*;
        match (self, to) {
            (Queued, Running | Cancelled | Failed) => true,
            // Halted straight from running: its own checkpoint exit, or a node lost under a
            // restartable job.
            (Running, MustHalt | Halted | Finished | Failed | Cancelled) => true,
            // It may exit on its own before the agent sends the signal.
            (MustHalt, Halting | Halted | Finished | Failed | Cancelled) => true,
            (Halting, Halted | Finished | Failed) => true,
            _ => false,
        }
    }

    /// The state and reason after the job's main process exited with `code` in this state.
    /// `None` when the job had no process (QUEUED or final).
    ///
    /// 0 is FINISHED; 123 (and a halt that ended any other way than 0) is HALTED; 85 is HALTED
    /// with the checkpoint reason (re-queued whether restartable or not); anything else while
    /// running is FAILED.
    pub fn after_exit(self, code: i32) -> Option<(JobState, JobReason)> {
        use JobState::*;
        if !self.holds_gpus() {
            return None;
        }
        Some(match (self, code) {
            (_, 0) => (Finished, JobReason::Exited { code }),
            (_, CHECKPOINT_EXIT_CODE) => (Halted, JobReason::CheckpointExit),
            (Running, HALT_EXIT_CODE) => (Halted, JobReason::Exited { code }),
            (MustHalt | Halting, HALT_EXIT_CODE) => (Halted, JobReason::HaltedCleanly),
            (Running, _) => (Failed, JobReason::Exited { code }),
            (MustHalt | Halting, _) => (Failed, JobReason::Exited { code }),
            _ => return None,
        })
    }
}

impl fmt::Display for JobState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown job state {0:?}: one of QUEUED, RUNNING, MUSTHALT, HALTING, HALTED, FINISHED, FAILED, CANCELLED")]
pub struct UnknownJobState(pub String);

impl FromStr for JobState {
    type Err = UnknownJobState;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|state| state.as_str().eq_ignore_ascii_case(s))
            .ok_or_else(|| UnknownJobState(s.to_owned()))
    }
}

/// Why a job changed state. Stored and sent as data (JSON, tagged by `reason`); shown to people
/// through `Display`, one sentence without a trailing period.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "reason", rename_all = "snake_case")]
pub enum JobReason {
    /// Created by `devctl job submit`.
    Submitted,
    /// Created as the next job of a restart chain.
    Requeued {
        previous: JobId,
        restart_count: u32,
    },
    Started {
        node: NodeName,
        gpus: Vec<GpuId>,
    },
    /// The main process exited with this code.
    Exited {
        code: i32,
    },
    MaxDurationReached {
        max: HumanDuration,
    },
    /// Halted so that an interactive session needing this could start; names the need, never
    /// the session's user.
    ForInteractiveSession {
        need: GpuRequest,
    },
    /// Ran as backfill on GPUs an owner group owns, and that group's work needed them.
    ForOwnerWork {
        group: String,
    },
    /// Ran on GPUs of a reservation of another group, which started.
    ReservationStarted {
        reservation: String,
        group: String,
    },
    HaltedByUser,
    /// The agent sent SIGUSR1 (MUSTHALT → HALTING).
    HaltSignalSent,
    /// Exited with code 123 after SIGUSR1.
    HaltedCleanly,
    /// Did not exit within 15 s of SIGUSR1 and was killed.
    IgnoredHaltSignal,
    NotStartedByNotAfter {
        not_after: DateTime<Utc>,
    },
    CancelledByUser,
    /// The node stopped syncing while the job ran there.
    NodeLost {
        node: NodeName,
        requeued: bool,
    },
    /// Exited with code 85: re-queued, keeping its working directory.
    CheckpointExit,
    /// The agent could not run it (the image could not be built from its SIF, the container
    /// could not be created, ...): its words, one line.
    CouldNotRun {
        message: String,
    },
    /// A re-queued job pinned to the node that holds its chain's working directory (and so its
    /// checkpoint), and that node is gone or offline.
    CheckpointNodeLost {
        node: NodeName,
    },
    /// A grid target (Slurm, HTCondor) started it: its engine's job id and where it runs.
    TargetStarted {
        target: JobTarget,
        engine_id: String,
        /// The engine's hosts, as it names them (`node[1-2]`, `slot1@gpu7`); empty if unknown.
        hosts: String,
    },
    /// A grid target ended it without an exit code of its own (node failure, out of memory,
    /// removed by an administrator, ...): the engine's reason in words a user understands.
    TargetEnded {
        target: JobTarget,
        message: String,
    },
    /// A grid target refused the job at submission: its words.
    TargetRefused {
        target: JobTarget,
        message: String,
    },
    /// A grid target no longer knows the job (purged from its queue and its records before the
    /// manager saw it end).
    TargetLost {
        target: JobTarget,
        engine_id: String,
    },
    /// A GPU it ran on failed (or its health became unknown): the node's health check saw it.
    GpuFailed {
        gpu: crate::gpu::GpuUuid,
        /// What was seen, e.g. `failed: Xid 79 ...`.
        problem: String,
        requeued: bool,
    },
}

impl fmt::Display for JobReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Submitted => f.write_str("submitted"),
            Self::Requeued {
                previous,
                restart_count,
            } => write!(f, "re-queued as restart {restart_count} of job {previous}"),
            Self::Started { node, gpus } => {
                let gpus: Vec<&str> = gpus.iter().map(GpuId::as_str).collect();
                write!(f, "started on {node} ({})", gpus.join(", "))
            }
            Self::Exited { code } => write!(f, "exited with code {code}"),
            Self::MaxDurationReached { max } => {
                write!(f, "halted: reached its max duration of {max}")
            }
            Self::ForInteractiveSession { need } => write!(
                f,
                "halted for an interactive session needing {}",
                describe_need(need)
            ),
            Self::ForOwnerWork { group } => write!(
                f,
                "halted: it ran as backfill on GPUs owned by group {group}, whose work needed them"
            ),
            Self::ReservationStarted { reservation, group } => write!(
                f,
                "halted: reservation {reservation} of group {group} started on its GPUs"
            ),
            Self::HaltedByUser => f.write_str("halted by its owner"),
            Self::HaltSignalSent => write!(
                f,
                "sent {HALT_SIGNAL}: waiting for exit code {HALT_EXIT_CODE} until the node's halt \
                 grace ends ({} seconds unless the site set another)",
                HALT_GRACE.as_secs()
            ),
            Self::HaltedCleanly => {
                write!(f, "exited with code {HALT_EXIT_CODE} after {HALT_SIGNAL}")
            }
            Self::IgnoredHaltSignal => write!(
                f,
                "ignored {HALT_SIGNAL}: killed when the node's halt grace ended ({} seconds unless \
                 the site set another)",
                HALT_GRACE.as_secs()
            ),
            Self::NotStartedByNotAfter { not_after } => write!(
                f,
                "cancelled: not started by its notAfter {}",
                not_after.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
            ),
            Self::CancelledByUser => f.write_str("cancelled by its owner"),
            Self::NodeLost { node, requeued } => {
                write!(f, "node {node} was lost")?;
                f.write_str(if *requeued {
                    ": re-queued (restartable)"
                } else {
                    " (submit it with --restartable to have it re-queued)"
                })
            }
            Self::CheckpointExit => write!(
                f,
                "exited with code {CHECKPOINT_EXIT_CODE} (checkpoint): re-queued, keeping its working directory"
            ),
            Self::CouldNotRun { message } => write!(f, "could not run: {message}"),
            Self::CheckpointNodeLost { node } => write!(
                f,
                "its checkpoint (the chain's working directory) is on node {node}, which is gone \
                 or offline: submit the job again to start over"
            ),
            Self::TargetStarted {
                target,
                engine_id,
                hosts,
            } => {
                write!(f, "started by {target} as its job {engine_id}")?;
                if !hosts.is_empty() {
                    write!(f, " on {hosts}")?;
                }
                Ok(())
            }
            Self::TargetEnded { target, message } => write!(f, "ended by {target}: {message}"),
            Self::TargetRefused { target, message } => {
                write!(f, "refused by {target}: {message}")
            }
            Self::TargetLost { target, engine_id } => write!(
                f,
                "{target} no longer knows its job {engine_id} (it ended without a record the \
                 manager could read): see the site's {target} logs, or submit it again"
            ),
            Self::GpuFailed {
                gpu,
                problem,
                requeued,
            } => {
                write!(f, "its GPU {gpu} is out of service ({problem})")?;
                f.write_str(if *requeued {
                    ": re-queued (restartable) for another GPU"
                } else {
                    " (submit it again, or with --restartable to have it re-queued)"
                })
            }
        }
    }
}

/// One recorded change of a job's state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobTransition {
    /// `None` for the creation of the job.
    pub from: Option<JobState>,
    pub to: JobState,
    pub at: DateTime<Utc>,
    pub reason: JobReason,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("a job cannot go from {from} to {to}")]
pub struct InvalidJobTransition {
    pub from: JobState,
    pub to: JobState,
}

/// A job's state with its full history; [`JobLifecycle::transition`] is the only way to change
/// the state, so the history is always complete.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobLifecycle {
    state: JobState,
    history: Vec<JobTransition>,
}

impl JobLifecycle {
    /// A new job, QUEUED since `at` (`Submitted`, or `Requeued` for a restart).
    pub fn new(at: DateTime<Utc>, reason: JobReason) -> Self {
        Self {
            state: JobState::Queued,
            history: vec![JobTransition {
                from: None,
                to: JobState::Queued,
                at,
                reason,
            }],
        }
    }

    /// Rebuilds a lifecycle from stored history, checking that it is a valid sequence.
    pub fn from_history(history: Vec<JobTransition>) -> Result<Self, InvalidJobTransition> {
        let mut state: Option<JobState> = None;
        for t in &history {
            match (state, t.from) {
                (None, None) if t.to == JobState::Queued => {}
                (Some(current), Some(from)) if current == from && from.can_become(t.to) => {}
                (current, _) => {
                    return Err(InvalidJobTransition {
                        from: current.unwrap_or(JobState::Cancelled),
                        to: t.to,
                    })
                }
            }
            state = Some(t.to);
        }
        match state {
            Some(state) => Ok(Self { state, history }),
            None => Err(InvalidJobTransition {
                from: JobState::Cancelled,
                to: JobState::Queued,
            }),
        }
    }

    pub fn state(&self) -> JobState {
        self.state
    }

    pub fn history(&self) -> &[JobTransition] {
        &self.history
    }

    pub fn last(&self) -> &JobTransition {
        // `new` and `from_history` guarantee at least one entry.
        &self.history[self.history.len() - 1]
    }

    /// When it started running (the first RUNNING), if it did.
    pub fn started_at(&self) -> Option<DateTime<Utc>> {
        self.history
            .iter()
            .find(|t| t.to == JobState::Running)
            .map(|t| t.at)
    }

    /// Moves to `to`, recording when and why. An invalid move changes nothing.
    pub fn transition(
        &mut self,
        to: JobState,
        at: DateTime<Utc>,
        reason: JobReason,
    ) -> Result<&JobTransition, InvalidJobTransition> {
        if !self.state.can_become(to) {
            return Err(InvalidJobTransition {
                from: self.state,
                to,
            });
        }
        self.history.push(JobTransition {
            from: Some(self.state),
            to,
            at,
            reason,
        });
        self.state = to;
        Ok(self.last())
    }
}

// ---------------------------------------------------------------------------------------------
// Restart chains.

/// Where a job stands in its restart chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RestartChain {
    /// The chain's first job.
    pub initial_job: JobId,
    /// How many times the chain was re-queued before this job (0 for the first job).
    pub restart_count: u32,
}

impl RestartChain {
    /// The chain of a newly submitted job.
    pub fn first(job: JobId) -> Self {
        Self {
            initial_job: job,
            restart_count: 0,
        }
    }

    /// The chain of the job that re-queues this one.
    pub fn next(self) -> Self {
        Self {
            initial_job: self.initial_job,
            restart_count: self.restart_count.saturating_add(1),
        }
    }

    /// The variables the job's container gets: `ONGRID_JOB_ID`, `ONGRID_RESTART_COUNT`,
    /// `ONGRID_RESTART_INITIAL_JOB_ID`.
    pub fn env(&self, job: JobId) -> [(&'static str, String); 3] {
        [
            (ENV_JOB_ID, job.to_string()),
            (ENV_RESTART_COUNT, self.restart_count.to_string()),
            (ENV_RESTART_INITIAL_JOB_ID, self.initial_job.to_string()),
        ]
    }
}

/// The max duration a re-queued job gets: what the chain's `max` leaves after `elapsed`
/// (the running time of this job, already net of its own predecessors). `None` when nothing is
/// left (less than a second), in which case the chain ends.
pub fn remaining_max_duration(max: HumanDuration, elapsed: Duration) -> Option<HumanDuration> {
    let left = max.as_duration().saturating_sub(elapsed);
    (left.as_secs() > 0).then(|| HumanDuration::from_secs(left.as_secs()))
}

/// Whether a job that ended with this state and reason continues its chain as a new job: a
/// restartable job that HALTED (for any reason), and any job that exited with code 85.
pub fn continues_chain(state: JobState, reason: &JobReason, restartable: bool) -> bool {
    match (state, reason) {
        (JobState::Halted, JobReason::CheckpointExit) => true,
        (JobState::Halted, _) => restartable,
        _ => false,
    }
}

// ---------------------------------------------------------------------------------------------
// Wire types of the user API.

/// `POST /v1/jobs`: submit a job. Strict like the spec inside it: a field beside the spec
/// (`"privileged": true`, a misspelt `"reservaton"`) is refused, never dropped.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SubmitJob {
    pub spec: JobSpec,
    /// The reservation of the caller's group whose GPUs it runs on, within its window
    /// (`devctl job submit --reservation NAME`). Older clients sent it as `?reservation=NAME`,
    /// which the manager still takes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reservation: Option<String>,
}

/// A job as users see it (`devctl job show`, `job ls`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobView {
    pub id: JobId,
    pub owner: crate::names::Dn,
    pub user_name: crate::names::UserName,
    pub state: JobState,
    /// The last transition's reason, as a sentence.
    pub reason: String,
    pub spec: JobSpec,
    /// The max duration it runs under: the spec's, else the site's default, capped by the
    /// site's maximum; for a re-queued job, what its chain has left.
    pub max_duration: Option<HumanDuration>,
    /// `sha256:<hex>` of the image it runs, once resolved.
    pub image_digest: Option<String>,
    pub node: Option<NodeName>,
    pub gpus: Vec<GpuId>,
    pub chain: RestartChain,
    /// The job this one re-queues, and the job that re-queued this one.
    pub previous_job: Option<JobId>,
    pub next_job: Option<JobId>,
    pub exit_code: Option<i32>,
    pub queued_at: DateTime<Utc>,
    pub started_at: Option<DateTime<Utc>>,
    pub finished_at: Option<DateTime<Utc>>,
    /// 1-based position among the site's QUEUED jobs, when QUEUED.
    pub queue_position: Option<u32>,
    /// Why a QUEUED job has not started: its notBefore, its bucket being full, the node that
    /// holds its checkpoint, or no fitting GPUs free.
    #[serde(default)]
    pub waiting: Option<String>,
    pub transitions: Vec<JobTransition>,
    /// Where a job of a grid target (Slurm, HTCondor) is in its engine; `None` for the local
    /// target.
    #[serde(default)]
    pub grid: Option<GridJobView>,
    /// The manager has all of its output: its node (or grid engine) said nothing follows. False
    /// while it runs, and for an ended job whose output did not all come.
    #[serde(default)]
    pub output_complete: bool,
}

/// A job handed to a grid target, as `devctl job show` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GridJobView {
    pub target: JobTarget,
    /// The local account it runs under (the site's mapping of the owner's DN or group).
    pub account: String,
    /// The engine's job id (`42` for Slurm, `17.0` for HTCondor); `None` until the engine
    /// answered the submission.
    pub engine_id: Option<String>,
    /// What the engine said last, in its own words (`PENDING (Resources)`), and when.
    pub engine_state: Option<String>,
    pub polled_at: Option<DateTime<Utc>>,
}

/// `GET /v1/targets`: one target the site offers (`devctl job targets`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TargetInfo {
    pub target: JobTarget,
    /// Jobs that name no target go here.
    pub default: bool,
    /// One line about where it runs jobs (`the site's own GPUs`, `Slurm cluster via
    /// /usr/bin/sbatch, partition gpu`).
    pub description: String,
    /// The local account the caller's jobs run under there; `None` for the local target, or
    /// when the caller has no mapping (then `refusal` says why).
    pub account: Option<String>,
    /// Why the caller cannot submit there, if they cannot.
    pub refusal: Option<String>,
}

// ---------------------------------------------------------------------------------------------
// Wire types between the manager and the agents (the local target).

/// Where a job's working directory is mounted inside its container. The directory is the same
/// for every job of a restart chain (it is named after the chain's initial job), so a job finds
/// there the checkpoints an earlier job of its chain wrote.
pub const WORK_DIR_IN_CONTAINER: &str = "/ongrid/work";

/// How many bytes of a job's output (stdout and stderr together, in the order they came) are
/// kept; output past this is dropped and one line saying so is kept instead.
pub const JOB_LOG_CAP: u64 = 16 * 1024 * 1024;

/// At most this many bytes of one job's output travel in one agent report.
pub const JOB_LOG_CHUNK_MAX: usize = 256 * 1024;

/// A job the manager wants on a node (`DesiredState::jobs`). The agent converges to it like to
/// a session: it prepares the image, creates and starts the container once, halts or kills it
/// when `run` says so, and reports what happened in `NodeReport::jobs` until the manager stops
/// listing the job (then the agent removes the container; the working directory of the chain
/// stays until the chain has ended).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DesiredJob {
    pub job_id: JobId,
    /// The chain's initial job: names the working directory on the node.
    pub chain_id: JobId,
    pub owner: crate::names::Dn,
    pub user: ContainerUser,
    pub image: JobImage,
    pub command: Command,
    /// The complete environment of the job: the spec's variables, `ONGRID_JOB_ID` and the
    /// restart chain's variables. The agent adds only the GPU variables.
    pub env: BTreeMap<String, String>,
    pub gpus: Vec<GpuId>,
    pub limits: ContainerLimits,
    /// Mount the owner's home volume read-write.
    pub mount_home: bool,
    pub run: JobRun,
    /// How many bytes of the job's output the manager already has: the agent sends what
    /// follows (at most [`JOB_LOG_CHUNK_MAX`] per report).
    pub log_offset: u64,
}

/// The frozen image a job runs. The SIF in the image store is the source of truth: an agent
/// whose Docker has no `docker_image` builds it from the SIF (once per digest).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobImage {
    /// `sha256:<hex>` of the SIF file (`<image store>/sha256/<hex>.sif`).
    pub digest: String,
    /// The Docker image name the agent runs (and builds from the SIF when missing).
    pub docker_image: String,
}

/// What the manager wants of a job's container.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "action", rename_all = "snake_case")]
pub enum JobRun {
    /// Start it (once: a job that exited is never started again) and let it run.
    Run,
    /// Send [`HALT_SIGNAL`] to its main process once; if it is still running
    /// [`HALT_GRACE`] after `since`, kill it.
    Halt { since: DateTime<Utc> },
    /// Kill it now (cancelled by its owner, or past its not-after time before it started).
    Kill,
}

/// Where one job stands on its node, as the agent reports it (`NodeReport::jobs`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObservedJob {
    pub job_id: JobId,
    pub status: ObservedJobStatus,
    /// Output that follows the manager's `log_offset`, when there is any.
    #[serde(default)]
    pub log: Option<LogChunk>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum ObservedJobStatus {
    /// Building the Docker image from the SIF, or creating the container.
    Preparing {
        detail: String,
    },
    Running {
        started_at: DateTime<Utc>,
    },
    /// [`HALT_SIGNAL`] was sent at `signalled_at`; the job has not exited yet.
    Halting {
        started_at: DateTime<Utc>,
        signalled_at: DateTime<Utc>,
    },
    /// The main process ended. `killed` says the agent killed it (a halt that outlived
    /// [`HALT_GRACE`], or a kill the manager asked for); `signalled_at` when [`HALT_SIGNAL`] was
    /// sent before it ended (a job that exits within one sync of the signal is never reported
    /// `Halting`, so its exit report carries the time).
    Exited {
        started_at: DateTime<Utc>,
        finished_at: DateTime<Utc>,
        exit_code: i32,
        oom_killed: bool,
        killed: bool,
        #[serde(default)]
        signalled_at: Option<DateTime<Utc>>,
    },
    /// It could not be started; `error` says why and what to do (broken SIF, ...).
    Failed {
        error: String,
    },
}

/// A piece of a job's output: the bytes from `offset` on. `complete` is true when the job has
/// ended and nothing follows these bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogChunk {
    pub offset: u64,
    #[serde(with = "base64_bytes")]
    pub data: Vec<u8>,
    pub complete: bool,
}

mod base64_bytes {
    use base64::Engine;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(data: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&base64::engine::general_purpose::STANDARD.encode(data))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let text = String::deserialize(d)?;
        base64::engine::general_purpose::STANDARD
            .decode(text)
            .map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use JobState::*;

    fn t0() -> DateTime<Utc> {
        DateTime::from_timestamp(1_800_000_000, 0).unwrap()
    }

    fn job(n: u128) -> JobId {
        JobId(uuid::Uuid::from_u128(n))
    }

    fn minimal() -> JobSpecFile {
        JobSpecFile {
            image: Some("mymodel:v1".into()),
            command: vec!["python".into(), "train.py".into()],
            ..JobSpecFile::default()
        }
    }

    fn error(file: JobSpecFile) -> String {
        file.validate(t0()).unwrap_err().to_string()
    }

    #[test]
    fn observed_jobs_survive_json_with_their_output() {
        let observed = ObservedJob {
            job_id: job(7),
            status: ObservedJobStatus::Exited {
                started_at: t0(),
                finished_at: t0() + chrono::Duration::seconds(90),
                exit_code: HALT_EXIT_CODE,
                oom_killed: false,
                killed: false,
                signalled_at: Some(t0() + chrono::Duration::seconds(88)),
            },
            log: Some(LogChunk {
                offset: 10,
                data: b"epoch 3\n\xff\x00".to_vec(),
                complete: true,
            }),
        };
        let json = serde_json::to_value(&observed).unwrap();
        assert_eq!(json["status"]["status"], "exited");
        assert_eq!(json["log"]["data"], "ZXBvY2ggMwr/AA==");
        assert_eq!(
            serde_json::from_value::<ObservedJob>(json).unwrap(),
            observed
        );
        let halt = JobRun::Halt { since: t0() };
        let json = serde_json::to_value(halt).unwrap();
        assert_eq!(json["action"], "halt");
        assert_eq!(serde_json::from_value::<JobRun>(json).unwrap(), halt);
    }

    #[test]
    fn the_example_file_parses_and_validates() {
        let text = include_str!("../../deploy/examples/job.toml");
        let spec = JobSpecFile::from_toml(text)
            .unwrap()
            .validate(t0())
            .unwrap();
        assert_eq!(spec.image.to_string(), "mymodel:v1");
        assert_eq!(spec.command.program(), "python");
        assert_eq!(spec.gpus.count, 1);
        assert_eq!(spec.gpus.min_capability, Some(ComputeCapability::new(8, 0)));
        assert_eq!(spec.max_duration, Some(HumanDuration::from_secs(8 * 3600)));
        assert_eq!(spec.min_duration, Some(HumanDuration::from_secs(3600)));
        assert!(spec.restartable);
        assert_eq!(spec.bucket.as_ref().unwrap().to_string(), "sweep:4");
        assert_eq!(spec.cpus.unwrap().to_string(), "4");
        assert!(spec.env.iter().any(|(k, v)| k == "EPOCHS" && v == "20"));
        assert_eq!(spec.target, Some(JobTarget::Local));
        // The spec survives JSON, the way it travels to the manager.
        let json = serde_json::to_string(&spec).unwrap();
        assert_eq!(serde_json::from_str::<JobSpec>(&json).unwrap(), spec);
    }

    #[test]
    fn a_minimal_file_gets_the_defaults() {
        let spec = JobSpecFile::from_toml(
            &("image = \"sha256:".to_owned() + &"ab".repeat(32) + "\"\ncommand = [\"./run\"]\n"),
        )
        .unwrap()
        .validate(t0())
        .unwrap();
        assert!(matches!(spec.image, ImageLookup::Digest(_)));
        assert_eq!(spec.gpus, GpuRequest::default());
        assert_eq!(spec.command.args(), &[] as &[String]);
        assert!(!spec.restartable && !spec.home && spec.env.is_empty());
        assert_eq!(spec.max_duration, None);
    }

    #[test]
    fn unknown_fields_are_refused() {
        let err = JobSpecFile::from_toml("image = \"m:1\"\ncommand = [\"x\"]\ngpu = 2\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("unknown field `gpu`"), "{err}");
    }

    #[test]
    fn errors_name_the_field_and_the_fix() {
        let cases: Vec<(JobSpecFile, &str)> = vec![
            (
                JobSpecFile {
                    image: None,
                    ..minimal()
                },
                "image: is missing: name a frozen image, like mymodel:v1",
            ),
            (
                JobSpecFile {
                    image: Some("MyModel".into()),
                    ..minimal()
                },
                "image: image reference \"MyModel\" has no version",
            ),
            (
                JobSpecFile {
                    command: vec![],
                    ..minimal()
                },
                "command: is empty",
            ),
            (
                JobSpecFile {
                    gpus: Some(0),
                    ..minimal()
                },
                "gpus: a job needs at least 1 GPU",
            ),
            (
                JobSpecFile {
                    min_capability: Some("eight".into()),
                    ..minimal()
                },
                "min-capability: compute capability \"eight\" must look like 8.0",
            ),
            (
                JobSpecFile {
                    min_gpu_memory: Some("40X".into()),
                    ..minimal()
                },
                "min-gpu-memory: memory size \"40X\" has unknown unit",
            ),
            (
                JobSpecFile {
                    share: Some("some".into()),
                    ..minimal()
                },
                "share: sharing \"some\" must be one of exclusive, shared, any",
            ),
            (
                JobSpecFile {
                    share: Some("mig:1g.10gb".into()),
                    gpus: Some(2),
                    ..minimal()
                },
                "gpus: a MIG request gets exactly 1 MIG device (a CUDA process uses one), not 2",
            ),
            (
                JobSpecFile {
                    cpus: Some(CpuNumber::Whole(0)),
                    ..minimal()
                },
                "cpus: 0 must be more than 0",
            ),
            (
                JobSpecFile {
                    memory: Some("1K".into()),
                    ..minimal()
                },
                "memory: must be at least 4 MiB",
            ),
            (
                JobSpecFile {
                    max_duration: Some("forever".into()),
                    ..minimal()
                },
                "max-duration: duration \"forever\" must be a number and a unit",
            ),
            (
                JobSpecFile {
                    max_duration: Some("1h".into()),
                    min_duration: Some("2h".into()),
                    ..minimal()
                },
                "min-duration: 2 hours is longer than max-duration 1 hour: shorten it or raise max-duration",
            ),
            (
                JobSpecFile {
                    not_before: Some("+2h".into()),
                    not_after: Some("+1h".into()),
                    ..minimal()
                },
                "not-after: 2027-01-15T09:00:00+00:00 is not later than not-before",
            ),
            (
                JobSpecFile {
                    not_before: Some("tomorrow".into()),
                    ..minimal()
                },
                "not-before: \"tomorrow\" must be a time with its zone",
            ),
            (
                JobSpecFile {
                    bucket: Some("sweep".into()),
                    ..minimal()
                },
                "bucket: \"sweep\" has no :MAX: write NAME:MAX",
            ),
            (
                JobSpecFile {
                    bucket: Some("sweep:0".into()),
                    ..minimal()
                },
                "bucket: \"sweep:0\" has a MAX outside 1 to 10000",
            ),
            (
                JobSpecFile {
                    env: [("ONGRID_JOB_ID".to_owned(), "x".to_owned())].into(),
                    ..minimal()
                },
                "env: ONGRID_JOB_ID is ongrid's own",
            ),
            (
                JobSpecFile {
                    env: [("NVIDIA_VISIBLE_DEVICES".to_owned(), "all".to_owned())].into(),
                    ..minimal()
                },
                "env: NVIDIA_VISIBLE_DEVICES is set by ongrid to the job's GPUs",
            ),
            (
                JobSpecFile {
                    env: [("1X".to_owned(), "x".to_owned())].into(),
                    ..minimal()
                },
                "env: name \"1X\" must be letters, digits and _",
            ),
            (
                JobSpecFile {
                    target: Some("lsf".into()),
                    ..minimal()
                },
                "target: \"lsf\" must be one of local, htcondor, slurm",
            ),
        ];
        for (file, expected) in cases {
            let message = error(file);
            assert!(
                message.starts_with(expected),
                "{message}\n  wanted {expected}"
            );
        }
    }

    #[test]
    fn a_job_file_may_ask_for_one_mig_device() {
        let spec = JobSpecFile::from_toml(
            "image = \"mymodel:v1\"\ncommand = [\"python\", \"train.py\"]\nshare = \"mig:1g.10gb\"\n",
        )
        .unwrap()
        .validate(t0())
        .unwrap();
        assert_eq!(spec.gpus.count, 1);
        assert_eq!(spec.gpus.sharing, Sharing::Mig("1g.10gb".parse().unwrap()));
        assert_eq!(
            describe_need(&spec.gpus),
            "1 GPU, a MIG 1g.10gb device or larger"
        );
    }

    #[test]
    fn a_not_after_in_the_past_is_refused() {
        let err = error(JobSpecFile {
            not_after: Some("2020-01-01T00:00:00Z".into()),
            ..minimal()
        });
        assert!(
            err.starts_with("not-after: 2020-01-01T00:00:00+00:00 has passed"),
            "{err}"
        );
    }

    #[test]
    fn times_are_absolute_relative_or_native_toml() {
        let text = "image = \"m:1\"\ncommand = [\"x\"]\nnot_before = 2027-01-15T10:00:00+01:00\n\
                    not_after = \"+1 day\"\n";
        let spec = JobSpecFile::from_toml(text)
            .unwrap()
            .validate(t0())
            .unwrap();
        assert_eq!(
            spec.not_before.unwrap().to_rfc3339(),
            "2027-01-15T09:00:00+00:00"
        );
        assert_eq!(spec.not_after.unwrap(), t0() + chrono::Duration::days(1));
        let local = "image = \"m:1\"\ncommand = [\"x\"]\nnot_before = 2027-01-15T10:00:00\n";
        let err = JobSpecFile::from_toml(local)
            .unwrap()
            .validate(t0())
            .unwrap_err();
        assert_eq!(err.field, "not-before");
        assert!(err.problem.contains("no time zone"), "{err}");
        assert_eq!(parse_time("not-after", "now", t0()).unwrap(), t0());
        assert_eq!(
            parse_time("not-after", "in 30 minutes", t0()).unwrap(),
            t0() + chrono::Duration::minutes(30)
        );
    }

    #[test]
    fn cpus_parse_and_print() {
        for (text, millis, shown) in [
            ("4", 4000, "4"),
            ("0.5", 500, "0.5"),
            ("1.25", 1250, "1.25"),
        ] {
            let cpus = Cpus::parse(text).unwrap();
            assert_eq!((cpus.millis(), cpus.to_string().as_str()), (millis, shown));
            assert_eq!(serde_json::from_str::<Cpus>(text).unwrap(), cpus);
        }
        assert_eq!(Cpus::parse("2").unwrap().nano_cpus(), 2_000_000_000);
        for bad in ["", "0", "1.", ".5", "1.2345", "-1", "1e3", "2000"] {
            assert!(Cpus::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn env_pairs() {
        let env = JobEnv::from_pairs(["A=1", "B=x=y", "EMPTY="]).unwrap();
        let pairs: Vec<_> = env.iter().collect();
        assert_eq!(pairs, [("A", "1"), ("B", "x=y"), ("EMPTY", "")]);
        assert!(JobEnv::from_pairs(["A=1", "A=2"])
            .unwrap_err()
            .to_string()
            .contains("A is given twice"));
        assert!(JobEnv::from_pairs(["NOVALUE"]).is_err());
        assert!(JobEnv::from_pairs(["ongrid_x=1"]).is_err());
        // Deserialising checks too.
        assert!(serde_json::from_str::<JobEnv>(r#"{"ONGRID_RESTART_COUNT":"9"}"#).is_err());
    }

    #[test]
    fn a_deserialised_spec_is_checked() {
        let spec = minimal().validate(t0()).unwrap();
        let mut json = serde_json::to_value(&spec).unwrap();
        json["min_duration"] = serde_json::json!(7200);
        json["max_duration"] = serde_json::json!(3600);
        assert!(serde_json::from_value::<JobSpec>(json.clone()).is_err());
        json["min_duration"] = serde_json::json!(null);
        assert!(serde_json::from_value::<JobSpec>(json.clone()).is_ok());
        json["surprise"] = serde_json::json!(1);
        assert!(serde_json::from_value::<JobSpec>(json).is_err());
    }

    #[test]
    fn needs_in_words() {
        let request = GpuRequest {
            count: 2,
            min_capability: Some(ComputeCapability::new(8, 0)),
            min_memory: Some(MemorySize::parse("40G").unwrap()),
            sharing: Sharing::Exclusive,
        };
        assert_eq!(
            describe_need(&request),
            "2 GPUs with compute capability 8.0 or more and 40 GB of memory or more"
        );
        assert_eq!(describe_need(&GpuRequest::default()), "1 GPU");
        let shared = GpuRequest {
            sharing: Sharing::Shared,
            ..GpuRequest::default()
        };
        assert_eq!(describe_need(&shared), "1 GPU, shared");
    }

    #[test]
    fn the_gpulab_paths() {
        let mut l = JobLifecycle::new(t0(), JobReason::Submitted);
        let node = NodeName::parse("node1").unwrap();
        l.transition(
            Running,
            t0(),
            JobReason::Started {
                node: node.clone(),
                gpus: vec![],
            },
        )
        .unwrap();
        l.transition(
            MustHalt,
            t0(),
            JobReason::ForInteractiveSession {
                need: GpuRequest::default(),
            },
        )
        .unwrap();
        l.transition(Halting, t0(), JobReason::HaltSignalSent)
            .unwrap();
        l.transition(Halted, t0(), JobReason::IgnoredHaltSignal)
            .unwrap();
        assert_eq!(l.started_at(), Some(t0()));
        assert_eq!(
            l.history()[2].reason.to_string(),
            "halted for an interactive session needing 1 GPU"
        );
        assert_eq!(
            l.last().reason.to_string(),
            "ignored SIGUSR1: killed when the node's halt grace ended (15 seconds unless the site \
             set another)"
        );
        assert_eq!(JobLifecycle::from_history(l.history().to_vec()).unwrap(), l);
        let err = l
            .transition(Running, t0(), JobReason::Submitted)
            .unwrap_err();
        assert_eq!(err.to_string(), "a job cannot go from HALTED to RUNNING");
        assert_eq!(l.history().len(), 5);

        let mut queued = JobLifecycle::new(t0(), JobReason::Submitted);
        assert!(queued
            .transition(MustHalt, t0(), JobReason::HaltedByUser)
            .is_err());
        queued
            .transition(
                Cancelled,
                t0(),
                JobReason::NotStartedByNotAfter { not_after: t0() },
            )
            .unwrap();
        assert_eq!(
            queued.last().reason.to_string(),
            "cancelled: not started by its notAfter 2027-01-15T08:00:00Z"
        );
    }

    #[test]
    fn final_states_end_everything() {
        for from in JobState::ALL {
            for to in JobState::ALL {
                if from.is_final() {
                    assert!(!from.can_become(to), "{from} -> {to}");
                }
            }
            assert!(
                !from.can_become(Queued),
                "{from} -> QUEUED: re-queue is a new job"
            );
        }
        assert!(!Halting.can_become(Cancelled));
        assert!(!Queued.can_become(Halted));
    }

    #[test]
    fn exits_map_to_states() {
        let exit = |state: JobState, code| state.after_exit(code).map(|(s, _)| s);
        assert_eq!(exit(Running, 0), Some(Finished));
        assert_eq!(exit(Running, 1), Some(Failed));
        assert_eq!(exit(Running, 85), Some(Halted));
        assert_eq!(exit(Running, 123), Some(Halted));
        assert_eq!(exit(Halting, 123), Some(Halted));
        assert_eq!(exit(MustHalt, 0), Some(Finished));
        assert_eq!(exit(Halting, 137), Some(Failed));
        assert_eq!(exit(Queued, 0), None);
        assert_eq!(exit(Finished, 0), None);
        assert_eq!(Halting.after_exit(123).unwrap().1, JobReason::HaltedCleanly);
        // Every mapped exit is a legal move.
        for state in JobState::ALL {
            for code in [0, 1, 85, 123, 137] {
                if let Some((to, _)) = state.after_exit(code) {
                    assert!(state.can_become(to), "{state} -> {to} on {code}");
                }
            }
        }
    }

    #[test]
    fn restart_chains() {
        let first = RestartChain::first(job(1));
        let third = first.next().next();
        assert_eq!(third.restart_count, 2);
        assert_eq!(third.initial_job, job(1));
        let env = third.env(job(3));
        assert_eq!(env[0], (ENV_JOB_ID, job(3).to_string()));
        assert_eq!(env[1], ("ONGRID_RESTART_COUNT", "2".to_owned()));
        assert_eq!(
            env[2],
            ("ONGRID_RESTART_INITIAL_JOB_ID", job(1).to_string())
        );
        let eight_hours = HumanDuration::from_secs(8 * 3600);
        assert_eq!(
            remaining_max_duration(eight_hours, Duration::from_secs(3 * 3600)),
            Some(HumanDuration::from_secs(5 * 3600))
        );
        assert_eq!(
            remaining_max_duration(eight_hours, Duration::from_secs(9 * 3600)),
            None
        );
        assert!(continues_chain(Halted, &JobReason::CheckpointExit, false));
        assert!(continues_chain(Halted, &JobReason::HaltedCleanly, true));
        assert!(!continues_chain(Halted, &JobReason::HaltedCleanly, false));
        assert!(!continues_chain(
            Failed,
            &JobReason::Exited { code: 1 },
            true
        ));
        assert_eq!(job(1).container_name(), format!("ongrid-job-{:032x}", 1));
    }

    #[test]
    fn reasons_are_data() {
        let reason = JobReason::NodeLost {
            node: NodeName::parse("n1").unwrap(),
            requeued: false,
        };
        let json = serde_json::to_string(&reason).unwrap();
        assert_eq!(
            json,
            r#"{"reason":"node_lost","node":"n1","requeued":false}"#
        );
        assert_eq!(serde_json::from_str::<JobReason>(&json).unwrap(), reason);
        assert_eq!(
            reason.to_string(),
            "node n1 was lost (submit it with --restartable to have it re-queued)"
        );
        for state in JobState::ALL {
            assert_eq!(state.as_str().parse::<JobState>().unwrap(), state);
            assert_eq!(
                serde_json::to_string(&state).unwrap(),
                format!("\"{state}\"")
            );
        }
    }

    proptest! {
        #[test]
        fn bucket_parse_never_panics_and_round_trips(s in "\\PC{0,30}") {
            if let Ok(bucket) = Bucket::parse(&s) {
                prop_assert_eq!(Bucket::parse(&bucket.to_string()).unwrap(), bucket);
            }
        }

        #[test]
        fn buckets_round_trip(name in "[a-z0-9_-]{1,40}", max in 1u32..=10_000) {
            let bucket = Bucket::parse(&format!("{name}:{max}")).unwrap();
            prop_assert_eq!(bucket.max, max);
            prop_assert_eq!(bucket.name.as_str(), name.as_str());
        }

        #[test]
        fn cpus_parse_never_panics_and_round_trips(s in "\\PC{0,12}") {
            if let Ok(cpus) = Cpus::parse(&s) {
                prop_assert_eq!(Cpus::parse(&cpus.to_string()).unwrap(), cpus);
            }
        }

        #[test]
        fn cpus_from_millis_round_trip(millis in 1u32..=1_024_000) {
            let cpus = Cpus::from_millis(millis).unwrap();
            prop_assert_eq!(Cpus::parse(&cpus.to_string()).unwrap(), cpus);
            let json = serde_json::to_string(&cpus).unwrap();
            prop_assert_eq!(serde_json::from_str::<Cpus>(&json).unwrap(), cpus);
        }

        #[test]
        fn env_pairs_never_panic(pairs in proptest::collection::vec("\\PC{0,20}", 0..5)) {
            if let Ok(env) = JobEnv::from_pairs(pairs.iter().map(String::as_str)) {
                for (name, _) in env.iter() {
                    prop_assert!(!name.to_ascii_uppercase().starts_with("ONGRID_"));
                }
            }
        }

        #[test]
        fn times_never_panic(s in "\\PC{0,40}") {
            let _ = parse_time("not-before", &s, t0());
        }

        #[test]
        fn job_files_never_panic(s in "\\PC{0,200}") {
            if let Ok(file) = JobSpecFile::from_toml(&s) {
                let _ = file.validate(t0());
            }
        }

        #[test]
        fn any_sequence_keeps_history_consistent(moves in proptest::collection::vec(0usize..8, 0..30)) {
            let mut l = JobLifecycle::new(t0(), JobReason::Submitted);
            for m in moves {
                let to = JobState::ALL[m];
                let before = l.state();
                match l.transition(to, t0(), JobReason::CancelledByUser) {
                    Ok(_) => prop_assert!(before.can_become(to)),
                    Err(_) => prop_assert_eq!(l.state(), before),
                }
            }
            let rebuilt = JobLifecycle::from_history(l.history().to_vec()).unwrap();
            prop_assert_eq!(rebuilt.state(), l.state());
        }
    }
}
