//! The manager's configuration: one TOML file, read once at start-up, validated into domain types.
//!
//! [`RawConfig`] mirrors the file (`deny_unknown_fields`, so a misspelt key is an error rather than
//! a silently ignored line); [`Config::load`] applies the environment overrides
//! (`ONGRID_MANAGER_LISTEN`, `ONGRID_MANAGER_DATABASE`) and validates every value, naming the key
//! and the file when one is wrong. Files the config points to (certificates, the CA directory,
//! the agent tokens) are read by the modules that use them, see [`crate::Manager::open`].

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use ongrid_core::api::ContainerLimits;
use ongrid_core::{HumanDuration, MemorySize};
use ongrid_service::config_file::{self, FileError};
use ongrid_service::metrics::MetricsConfig;
use ongrid_x509::CrlPolicy;
use serde::Deserialize;

use crate::auth::Admins;
use crate::domain::policy::Admission;

pub mod policy;
pub mod targets;
pub mod tokens;
use crate::domain::sessions::holds::{ActivityThresholds, LifecycleConfig, LONGEST};

/// Environment variable overriding `listen`.
pub const ENV_LISTEN: &str = "ONGRID_MANAGER_LISTEN";
/// Environment variable overriding `database`.
pub const ENV_DATABASE: &str = "ONGRID_MANAGER_DATABASE";

/// How long a create or release waits for the round that places its session when the config
/// does not say (`placement_wait_ms`): a quiet site's round takes a few milliseconds, so its
/// answers say STARTING; under load the answer comes at this bound, PENDING with its place.
pub const DEFAULT_PLACEMENT_WAIT: Duration = Duration::from_millis(50);
/// The longest `placement_wait_ms`: a request answers well within its client's timeout
/// (devctl's is 30 s) and its proxy's.
const LONGEST_PLACEMENT_WAIT: Duration = Duration::from_secs(10);

/// Why the configuration was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file cannot be read or is not TOML of the manager's keys; the same messages as the
    /// other binaries'.
    #[error(transparent)]
    File(#[from] FileError),
    #[error("config file {}: key `{key}`: {message}", path.display())]
    Invalid {
        path: PathBuf,
        key: String,
        message: String,
    },
}

/// The file as written. Every key is listed in deploy/examples and in the brief.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    pub listen: String,
    /// A SQLite file (a path, or `sqlite:PATH`) or a PostgreSQL URL (`postgres://USER@HOST/DB`).
    pub database: PathBuf,
    pub tls_cert: PathBuf,
    pub tls_key: PathBuf,
    pub ca_dir: PathBuf,
    /// VOMS trust (`<vo>/<host>.lsc` files); without it VOMS attributes are ignored.
    #[serde(default)]
    pub vomsdir: Option<PathBuf>,
    /// What to do when a CA's CRL is past its nextUpdate: `refuse` (default) or `warn`.
    #[serde(default = "default_crl_policy")]
    pub crl_policy: String,
    /// Whether a limited proxy may `POST /v1/keys` (default: no, it may only read).
    #[serde(default)]
    pub limited_proxies_may_register_keys: bool,
    /// DNs (`/DC=org/CN=Site Admin`) or VOMS FQANs (`/myvo/Role=admin`) of the admins.
    #[serde(default)]
    pub admins: Vec<String>,
    pub agent_tokens_file: PathBuf,
    /// The gateway's bearer token for `/v1/gateway/*`, one line; those routes are off without it.
    #[serde(default)]
    pub gateway_token_file: Option<PathBuf>,
    #[serde(default = "default_image")]
    pub default_image: String,
    /// Docker images sessions may use besides `default_image` (exact names, as Docker names
    /// them). Anything else is refused unless it names the caller's own frozen image.
    #[serde(default)]
    pub allowed_images: Vec<String>,
    #[serde(default = "default_first_uid")]
    pub first_uid: u32,
    #[serde(default = "default_node_timeout")]
    pub node_timeout: String,
    /// Put a GPU the health check drained back in service once its node reports it healthy
    /// again. Off by default: an admin undrains it (`devctl admin gpu undrain`).
    #[serde(default)]
    pub auto_undrain: bool,
    #[serde(default = "default_sync_interval")]
    pub sync_interval: String,
    #[serde(default = "default_schedule_interval")]
    pub schedule_interval: String,
    /// How long a request that queues a session (create, release) waits, in milliseconds, for
    /// the scheduling round that places it before it answers PENDING (the round goes on).
    #[serde(default = "default_placement_wait_ms")]
    pub placement_wait_ms: u64,
    #[serde(default)]
    pub session_limits: RawSessionLimits,
    /// `[lifecycle]`: when sessions are held (see `crate::lifecycle`).
    #[serde(default)]
    pub lifecycle: RawLifecycle,
    /// The image store the agents freeze into (the same directory, shared on real sites);
    /// `image rm` deletes SIF files there. Optional: without it files are never deleted.
    #[serde(default)]
    pub image_store: Option<PathBuf>,
    /// A freeze whose progress has not moved for this long is failed (see `crate::freezes`).
    #[serde(default = "default_freeze_stall_timeout")]
    pub freeze_stall_timeout: String,
    /// `[jobs]`: batch jobs' durations and where their output is kept.
    #[serde(default)]
    pub jobs: RawJobs,
    /// `[retention]`: how long ended jobs and closed connections of the audit log are kept.
    #[serde(default)]
    pub retention: RawRetention,
    /// `[policy]`: who may use the site, in which accounting group. Absent: every user of the
    /// CAs in `ca_dir`, in group `default`.
    #[serde(default)]
    pub policy: Option<policy::RawPolicy>,
    /// `[fairshare]`: who goes first among waiting requests. Absent: first come, first served.
    #[serde(default)]
    pub fairshare: Option<policy::RawFairShare>,
    /// `[limits]`: the most GPUs and sessions each user and group may hold at once.
    #[serde(default)]
    pub limits: Option<policy::RawLimits>,
    /// `[metrics]`: where `/metrics`, `/healthz` and `/readyz` are served; off without it.
    #[serde(default)]
    pub metrics: Option<MetricsConfig>,
    /// `[targets]`: grid batch engines (Slurm, HTCondor) jobs may go to; local only without it.
    #[serde(default)]
    pub targets: targets::RawTargets,
    /// `[dashboard]`: what the web dashboard shows that the manager cannot know (the gateway's
    /// address for the `ssh` command). The dashboard is served without it.
    #[serde(default)]
    pub dashboard: DashboardConfig,
    /// `[[token_issuers]]`: the OAuth2 issuers whose bearer tokens are accepted beside grid
    /// certificates. None: certificates and proxies only.
    #[serde(default)]
    pub token_issuers: Vec<tokens::RawTokenIssuer>,
}

/// `[jobs]` as written in the manager's config file.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawJobs {
    /// For a job that names no max duration, like `"8 hours"`. Absent: no default.
    pub default_max_duration: Option<String>,
    /// No job runs longer than this, like `"7 days"`, and a job asking for more is refused.
    /// Absent: two weeks ([`crate::domain::jobs::DEFAULT_MAX_DURATION`]).
    pub max_duration: Option<String>,
    /// Where each job's output is kept (`<dir>/<job id>.log`, at most 16 MiB each). Absent:
    /// `jobs/` beside the database.
    pub log_dir: Option<PathBuf>,
    /// How long a job that ended stays listed to its node while its output is not all in,
    /// like `"10 minutes"` (the default). Output that comes later is lost.
    pub output_grace: Option<String>,
    /// The agents' jobs directory is the same shared storage on every node: a re-queued job
    /// may then start on any node. Default false: it is pinned to the node that holds its
    /// chain's working directory.
    #[serde(default)]
    pub shared_work_dir: bool,
}

/// `[retention]` as written in the manager's config file: durations like `"30 days"`, or
/// `"forever"` (or `"0"`) to keep everything.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRetention {
    /// How long a job's record and output are kept after it ended. Absent: 30 days.
    pub jobs: Option<String>,
    /// How long a connection of the audit log is kept after it closed. Absent: 180 days.
    pub connections: Option<String>,
}

/// The shortest retention: a prune runs every hour.
const SHORTEST_RETENTION: Duration = Duration::from_secs(3600);

/// `[session_limits]`: what every dev container may use.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawSessionLimits {
    /// Cores as a string, may be fractional: `"1.5"`.
    #[serde(default = "default_cpus")]
    pub cpus: String,
    #[serde(default = "default_memory")]
    pub memory: String,
    #[serde(default = "default_pids")]
    pub pids: u32,
}

impl Default for RawSessionLimits {
    fn default() -> Self {
        Self {
            cpus: default_cpus(),
            memory: default_memory(),
            pids: default_pids(),
        }
    }
}

fn default_crl_policy() -> String {
    "refuse".to_owned()
}
fn default_image() -> String {
    "ongrid/dev:latest".to_owned()
}
fn default_first_uid() -> u32 {
    20_000
}
fn default_freeze_stall_timeout() -> String {
    "1 hour".to_owned()
}
fn default_node_timeout() -> String {
    "30 seconds".to_owned()
}
fn default_sync_interval() -> String {
    "5 seconds".to_owned()
}
fn default_schedule_interval() -> String {
    "1 second".to_owned()
}
fn default_placement_wait_ms() -> u64 {
    DEFAULT_PLACEMENT_WAIT.as_millis() as u64
}
fn default_cpus() -> String {
    "4".to_owned()
}
fn default_memory() -> String {
    "16GiB".to_owned()
}
fn default_pids() -> u32 {
    4096
}

/// The validated configuration, passed by value to [`crate::run`].
#[derive(Debug, Clone)]
pub struct Config {
    /// The file it was read from (for messages).
    pub path: PathBuf,
    pub listen: SocketAddr,
    pub database: PathBuf,
    /// What `database` names: a SQLite file or a PostgreSQL server.
    pub store: crate::store::Database,
    pub tls_cert: PathBuf,
    pub tls_key: PathBuf,
    pub ca_dir: PathBuf,
    pub vomsdir: Option<PathBuf>,
    pub crl_policy: CrlPolicy,
    pub limited_proxies_may_register_keys: bool,
    pub admins: Admins,
    pub agent_tokens_file: PathBuf,
    /// `None`: no gateway may use the manager (`/v1/gateway/*` answer 401 saying so).
    pub gateway_token_file: Option<PathBuf>,
    pub default_image: String,
    /// The site's other images (see [`Config::site_images`]).
    pub allowed_images: Vec<String>,
    pub first_uid: u32,
    pub node_timeout: Duration,
    /// See the file's `auto_undrain`.
    pub auto_undrain: bool,
    pub sync_interval: Duration,
    pub schedule_interval: Duration,
    /// `placement_wait_ms`: how long a create or release waits for the round that places its
    /// session ([`crate::app::AppState::schedule_now`]).
    pub placement_wait: Duration,
    pub session_limits: ContainerLimits,
    /// Connect deadline, idle timeout, maximum lifetime, keep-alive and activity thresholds.
    pub lifecycle: LifecycleConfig,
    /// Where frozen images' SIF files are (`<dir>/sha256/<hex>.sif`); `None`: never deleted.
    pub image_store: Option<PathBuf>,
    /// A BUILDING image whose progress has not moved for this long is failed.
    pub freeze_stall_timeout: Duration,
    /// The site's limits on batch jobs' max durations.
    pub job_limits: crate::domain::jobs::JobLimits,
    /// Where jobs' output files are.
    pub job_log_dir: PathBuf,
    /// `[retention]`: how long ended jobs and closed connections are kept.
    pub retention: crate::retention::RetentionConfig,
    /// `[policy]`: who may use the site, and their accounting groups.
    pub admission: Admission,
    /// `[fairshare]`; `None`: first come, first served.
    pub fair_share: Option<crate::domain::policy::fairshare::FairShareConfig>,
    /// `[limits]`; `None`: none.
    pub limits: Option<crate::domain::policy::limits::LimitsConfig>,
    /// `[policy] sessions_on_owned_gpus`: others' sessions may take owned GPUs.
    pub sessions_on_owned_gpus: bool,
    /// The metrics and health listener; `None`: none.
    pub metrics: Option<MetricsConfig>,
    /// `[targets]`: where batch jobs may run.
    pub targets: crate::targets::TargetsConfig,
    /// `[dashboard]`.
    pub dashboard: DashboardConfig,
    /// `[[token_issuers]]`; empty: no bearer token is accepted.
    pub token_issuers: Vec<tokens::TokenIssuer>,
}

impl Config {
    /// The Docker images any session may run: `default_image` and `allowed_images`.
    pub fn site_images(&self) -> crate::domain::image_access::SiteImages<'_> {
        crate::domain::image_access::SiteImages {
            default: &self.default_image,
            allowed: &self.allowed_images,
        }
    }

    /// Reads, overrides from the process environment, and validates.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = config_file::read(path)?;
        Self::from_toml(&text, path, |name| std::env::var(name).ok())
    }

    /// Parses `text` (read from `path`), applies overrides found by `env`, and validates.
    pub fn from_toml(
        text: &str,
        path: &Path,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, ConfigError> {
        let mut raw: RawConfig = config_file::parse(text, path)?;
        let mut listen_key = "listen".to_owned();
        if let Some(listen) = env(ENV_LISTEN) {
            raw.listen = listen;
            listen_key = format!("listen (from {ENV_LISTEN})");
        }
        if let Some(database) = env(ENV_DATABASE) {
            raw.database = PathBuf::from(database);
        }
        Validator { path }.validate(raw, &listen_key)
    }
}

struct Validator<'a> {
    path: &'a Path,
}

impl Validator<'_> {
    fn invalid(&self, key: &str, message: impl Into<String>) -> ConfigError {
        ConfigError::Invalid {
            path: self.path.to_owned(),
            key: key.to_owned(),
            message: message.into(),
        }
    }

    fn duration(&self, key: &str, value: &str) -> Result<Duration, ConfigError> {
        let duration = HumanDuration::parse(value)
            .map_err(|e| self.invalid(key, e.to_string()))?
            .as_duration();
        if duration.is_zero() {
            return Err(self.invalid(key, "must be longer than 0 seconds"));
        }
        Ok(duration)
    }

    /// A `[retention]` key: `default` when absent, `None` for ever.
    fn retention(
        &self,
        key: &str,
        value: Option<&str>,
        default: Duration,
    ) -> Result<Option<Duration>, ConfigError> {
        let Some(value) = value else {
            return Ok(Some(default));
        };
        if matches!(value.trim(), "forever" | "0") {
            return Ok(None);
        }
        let duration = HumanDuration::parse(value)
            .map_err(|e| {
                self.invalid(
                    key,
                    format!(
                        "{e}: give a duration like \"30 days\", or \"forever\" to keep everything"
                    ),
                )
            })?
            .as_duration();
        if duration < SHORTEST_RETENTION {
            return Err(self.invalid(
                key,
                format!(
                    "{} is shorter than 1 hour, how often the manager prunes: give 1 hour or \
                     more, or \"forever\" to keep everything",
                    HumanDuration(duration)
                ),
            ));
        }
        Ok(Some(duration))
    }

    fn non_empty_path(&self, key: &str, value: &Path) -> Result<(), ConfigError> {
        if value.as_os_str().is_empty() {
            return Err(self.invalid(key, "must name a file"));
        }
        Ok(())
    }

    /// Checks every setting of `raw` in turn, each step one part of the file; the first
    /// mistake found is the error, naming its key.
    fn validate(&self, raw: RawConfig, listen_key: &str) -> Result<Config, ConfigError> {
        let listen = self.listen(&raw.listen, listen_key)?;
        self.check_paths(&raw)?;
        let admins = Admins::parse(&raw.admins).map_err(|e| self.invalid("admins", e))?;
        let admission = policy::admission(raw.policy.as_ref())
            .map_err(|(key, message)| self.invalid(&key, message))?;
        let fair_share = raw
            .fairshare
            .as_ref()
            .map(policy::fair_share)
            .transpose()
            .map_err(|(key, message)| self.invalid(&key, message))?;
        let limits = raw
            .limits
            .as_ref()
            .map(policy::limits)
            .transpose()
            .map_err(|(key, message)| self.invalid(&key, message))?;
        let targets = targets::targets(
            &raw.targets,
            raw.policy.as_ref().and_then(|p| p.contact.as_deref()),
        )
        .map_err(|(key, message)| self.invalid(&key, message))?;
        let token_issuers = tokens::token_issuers(&raw.token_issuers)
            .map_err(|(key, message)| self.invalid(&key, message))?;
        let crl_policy = self.crl_policy(&raw.crl_policy)?;
        let (default_image, allowed_images) = self.images(&raw)?;
        if raw.first_uid < 1000 {
            return Err(self.invalid(
                "first_uid",
                format!(
                    "{} is a system UID: use 1000 or more (20000 keeps clear of local users)",
                    raw.first_uid
                ),
            ));
        }
        let intervals = self.intervals(&raw)?;
        let session_limits = self.session_limits(&raw.session_limits)?;
        let lifecycle = self.lifecycle(&raw.lifecycle)?;
        let job_limits = self.job_limits(&raw.jobs)?;
        self.check_length_classes(limits.as_ref(), &lifecycle)?;
        let store = crate::store::Database::parse(&raw.database.to_string_lossy())
            .map_err(|e| self.invalid("database", e))?;
        let job_log_dir = self.job_log_dir(&raw.jobs, &store)?;
        let retention = self.retention_config(&raw.retention)?;
        Ok(Config {
            path: self.path.to_owned(),
            listen,
            database: raw.database,
            store,
            tls_cert: raw.tls_cert,
            tls_key: raw.tls_key,
            ca_dir: raw.ca_dir,
            vomsdir: raw.vomsdir,
            crl_policy,
            limited_proxies_may_register_keys: raw.limited_proxies_may_register_keys,
            admins,
            agent_tokens_file: raw.agent_tokens_file,
            gateway_token_file: raw.gateway_token_file,
            default_image,
            allowed_images,
            first_uid: raw.first_uid,
            node_timeout: intervals.node_timeout,
            auto_undrain: raw.auto_undrain,
            metrics: raw.metrics,
            dashboard: raw.dashboard,
            sync_interval: intervals.sync_interval,
            schedule_interval: intervals.schedule_interval,
            placement_wait: self.placement_wait(raw.placement_wait_ms)?,
            session_limits,
            lifecycle,
            image_store: raw.image_store,
            freeze_stall_timeout: intervals.freeze_stall_timeout,
            job_limits,
            job_log_dir,
            retention,
            admission,
            fair_share,
            limits,
            targets,
            token_issuers,
            sessions_on_owned_gpus: raw
                .policy
                .as_ref()
                .is_some_and(|policy| policy.sessions_on_owned_gpus),
        })
    }

    fn listen(&self, text: &str, key: &str) -> Result<SocketAddr, ConfigError> {
        text.parse().map_err(|_| {
            self.invalid(
                key,
                format!("{text:?} must be an address and port, like 127.0.0.1:8443 or [::]:8443"),
            )
        })
    }

    /// The files and directories the manager reads or writes: each must be named when set.
    fn check_paths(&self, raw: &RawConfig) -> Result<(), ConfigError> {
        for (key, path) in [
            ("database", &raw.database),
            ("tls_cert", &raw.tls_cert),
            ("tls_key", &raw.tls_key),
            ("ca_dir", &raw.ca_dir),
            ("agent_tokens_file", &raw.agent_tokens_file),
        ] {
            self.non_empty_path(key, path)?;
        }
        for (key, path) in [
            ("gateway_token_file", &raw.gateway_token_file),
            ("image_store", &raw.image_store),
            ("vomsdir", &raw.vomsdir),
        ] {
            if let Some(path) = path {
                self.non_empty_path(key, path)?;
            }
        }
        Ok(())
    }

    fn crl_policy(&self, text: &str) -> Result<CrlPolicy, ConfigError> {
        match text.trim() {
            "refuse" => Ok(CrlPolicy::Refuse),
            "warn" => Ok(CrlPolicy::Warn),
            other => Err(self.invalid(
                "crl_policy",
                format!("{other:?} must be \"refuse\" (default) or \"warn\""),
            )),
        }
    }

    /// `default_image` and `allowed_images`: Docker image names (a frozen image's digest is
    /// not one: sessions name frozen images themselves).
    fn images(&self, raw: &RawConfig) -> Result<(String, Vec<String>), ConfigError> {
        let default_image = raw.default_image.trim().to_owned();
        if let Err(message) = check_image(&default_image) {
            return Err(self.invalid("default_image", message));
        }
        let mut allowed_images = Vec::with_capacity(raw.allowed_images.len());
        for image in &raw.allowed_images {
            let image = image.trim().to_owned();
            check_image(&image).map_err(|message| self.invalid("allowed_images", message))?;
            if ongrid_core::image::ImageLookup::parse(&image)
                .is_ok_and(|lookup| matches!(lookup, ongrid_core::image::ImageLookup::Digest(_)))
            {
                return Err(self.invalid(
                    "allowed_images",
                    format!(
                        "{image:?} is a frozen image's digest: sessions name frozen images \
                         themselves; list Docker image names here, like python:3.12"
                    ),
                ));
            }
            allowed_images.push(image);
        }
        Ok((default_image, allowed_images))
    }

    /// `placement_wait_ms`: 0 answers at once, without waiting for a round.
    fn placement_wait(&self, millis: u64) -> Result<Duration, ConfigError> {
        let wait = Duration::from_millis(millis);
        if wait > LONGEST_PLACEMENT_WAIT {
            return Err(self.invalid(
                "placement_wait_ms",
                format!(
                    "{millis} is longer than {} ms: clients time out before such an answer; \
                     `devctl session new --wait` waits for the placement instead",
                    LONGEST_PLACEMENT_WAIT.as_millis()
                ),
            ));
        }
        Ok(wait)
    }

    /// The node timeout, the agents' sync and the loops' intervals; a node must be given more
    /// than one sync before it counts as offline.
    fn intervals(&self, raw: &RawConfig) -> Result<Intervals, ConfigError> {
        let intervals = Intervals {
            node_timeout: self.duration("node_timeout", &raw.node_timeout)?,
            sync_interval: self.duration("sync_interval", &raw.sync_interval)?,
            schedule_interval: self.duration("schedule_interval", &raw.schedule_interval)?,
            freeze_stall_timeout: self
                .duration("freeze_stall_timeout", &raw.freeze_stall_timeout)?,
        };
        if intervals.node_timeout <= intervals.sync_interval {
            return Err(self.invalid(
                "node_timeout",
                format!(
                    "{} must be longer than sync_interval ({}), or every node looks offline between syncs",
                    HumanDuration(intervals.node_timeout),
                    HumanDuration(intervals.sync_interval)
                ),
            ));
        }
        Ok(intervals)
    }

    /// `[session_limits]`: what each dev container may use.
    fn session_limits(&self, raw: &RawSessionLimits) -> Result<ContainerLimits, ConfigError> {
        let millicpus = parse_millicpus(&raw.cpus)
            .map_err(|message| self.invalid("session_limits.cpus", message))?;
        let memory = MemorySize::parse(&raw.memory)
            .map_err(|e| self.invalid("session_limits.memory", e.to_string()))?;
        if memory.bytes() < 64 << 20 {
            return Err(self.invalid(
                "session_limits.memory",
                format!("{memory} is too little for a dev container: give at least 64MiB"),
            ));
        }
        if raw.pids < 16 {
            return Err(self.invalid(
                "session_limits.pids",
                "must be at least 16, or a shell cannot start",
            ));
        }
        Ok(ContainerLimits {
            millicpus,
            memory,
            pids: raw.pids,
        })
    }

    fn lifecycle(&self, raw: &RawLifecycle) -> Result<LifecycleConfig, ConfigError> {
        raw.validate(|key, value| {
            self.duration(&format!("lifecycle.{key}"), value)
                .map_err(|e| LifecycleConfigError {
                    key,
                    message: match e {
                        ConfigError::Invalid { message, .. } => message,
                        other => other.to_string(),
                    },
                })
        })
        .map_err(|e| self.invalid(&format!("lifecycle.{}", e.key), e.message))
    }

    /// `[jobs]`: the jobs' durations (a default no longer than the maximum) and output grace.
    fn job_limits(&self, raw: &RawJobs) -> Result<crate::domain::jobs::JobLimits, ConfigError> {
        let job_duration = |key: &str, value: &Option<String>| {
            value
                .as_deref()
                .map(|v| {
                    self.duration(&format!("jobs.{key}"), v)
                        .map(|d| HumanDuration::from_secs(d.as_secs().max(1)))
                })
                .transpose()
        };
        let job_limits = crate::domain::jobs::JobLimits {
            default_max_duration: job_duration("default_max_duration", &raw.default_max_duration)?,
            max_duration: job_duration("max_duration", &raw.max_duration)?
                .unwrap_or(crate::domain::jobs::DEFAULT_MAX_DURATION),
            output_grace: match &raw.output_grace {
                Some(text) => self.duration("jobs.output_grace", text)?,
                None => crate::domain::jobs::DEFAULT_OUTPUT_GRACE,
            },
            shared_work_dir: raw.shared_work_dir,
        };
        if let Some(default) = job_limits.default_max_duration {
            let max = job_limits.max_duration;
            if default > max {
                return Err(self.invalid(
                    "jobs.default_max_duration",
                    if raw.max_duration.is_some() {
                        format!("{default} is longer than jobs.max_duration {max}")
                    } else {
                        format!(
                            "{default} is longer than jobs.max_duration, {max} when not set: set \
                             jobs.max_duration to {default} or more"
                        )
                    },
                ));
            }
        }
        Ok(job_limits)
    }

    /// Sessions that ask for nothing run the default lifetime: it must fit the longest length
    /// class of `[limits]`.
    fn check_length_classes(
        &self,
        limits: Option<&crate::domain::policy::limits::LimitsConfig>,
        lifecycle: &LifecycleConfig,
    ) -> Result<(), ConfigError> {
        let Some(classes) = limits.and_then(|l| l.length_classes) else {
            return Ok(());
        };
        if lifecycle.max_duration > classes.long {
            return Err(self.invalid(
                "limits.length_classes.long",
                format!(
                    "{} is shorter than [lifecycle] max_duration ({}), so every session that \
                     does not ask for less would be refused: raise long or lower max_duration",
                    HumanDuration(classes.long),
                    HumanDuration(lifecycle.max_duration)
                ),
            ));
        }
        Ok(())
    }

    /// Where the jobs' output is kept: `[jobs] log_dir`, else `jobs/` beside the SQLite file;
    /// a PostgreSQL store has no file to keep it beside.
    fn job_log_dir(
        &self,
        raw: &RawJobs,
        store: &crate::store::Database,
    ) -> Result<PathBuf, ConfigError> {
        match (&raw.log_dir, store.sqlite_file()) {
            (Some(dir), _) => {
                self.non_empty_path("jobs.log_dir", dir)?;
                Ok(dir.clone())
            }
            (None, Some(file)) => Ok(file
                .parent()
                .map_or_else(|| PathBuf::from("jobs"), |dir| dir.join("jobs"))),
            (None, None) => Err(self.invalid(
                "jobs.log_dir",
                "must be set when `database` is a PostgreSQL server: there is no database \
                 file to keep the jobs' output beside (e.g. log_dir = \"/var/lib/ongrid/jobs\")",
            )),
        }
    }

    fn retention_config(
        &self,
        raw: &RawRetention,
    ) -> Result<crate::retention::RetentionConfig, ConfigError> {
        Ok(crate::retention::RetentionConfig {
            jobs: self.retention(
                "retention.jobs",
                raw.jobs.as_deref(),
                crate::retention::DEFAULT_JOBS,
            )?,
            connections: self.retention(
                "retention.connections",
                raw.connections.as_deref(),
                crate::retention::DEFAULT_CONNECTIONS,
            )?,
        })
    }
}

/// The intervals of `[manager]` once checked ([`Validator::intervals`]).
struct Intervals {
    node_timeout: Duration,
    sync_interval: Duration,
    schedule_interval: Duration,
    freeze_stall_timeout: Duration,
}

/// Checks a Docker image reference well enough to refuse obvious mistakes (spaces, control
/// characters, empty); Docker itself judges the rest when the agent pulls or runs it.
pub fn check_image(image: &str) -> Result<(), String> {
    if image.is_empty() {
        return Err("an image name must not be empty, e.g. ongrid/dev:latest".to_owned());
    }
    if image.len() > 255 {
        return Err(format!(
            "image name {image:?} is longer than 255 characters"
        ));
    }
    if image
        .chars()
        .any(|c| c.is_whitespace() || c.is_control() || c.is_ascii_uppercase())
    {
        return Err(format!(
            "image name {image:?} may not contain spaces, control characters or upper-case letters"
        ));
    }
    Ok(())
}

/// Parses a CPU count such as `"4"`, `"1.5"` or `"0.25"` into thousandths of a core.
pub fn parse_millicpus(value: &str) -> Result<u32, String> {
    let malformed = || {
        format!("{value:?} must be a number of cores, like \"4\" or \"1.5\" (at most 3 decimals)")
    };
    let trimmed = value.trim();
    let (whole, fraction) = trimmed.split_once('.').unwrap_or((trimmed, ""));
    let digits = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
    if whole.is_empty() || !digits(whole) || !digits(fraction) || fraction.len() > 3 {
        return Err(malformed());
    }
    if trimmed.ends_with('.') {
        return Err(malformed());
    }
    let whole: u32 = whole.parse().map_err(|_| malformed())?;
    let fraction: u32 = if fraction.is_empty() {
        0
    } else {
        format!("{fraction:0<3}").parse().map_err(|_| malformed())?
    };
    let millicpus = whole
        .checked_mul(1000)
        .and_then(|m| m.checked_add(fraction))
        .ok_or_else(|| format!("{value:?} is more cores than any machine has"))?;
    if millicpus < 10 {
        return Err(format!(
            "{value:?} is too little CPU for a dev container: give at least 0.01"
        ));
    }
    Ok(millicpus)
}

// The `[lifecycle]` section.

/// `[lifecycle]` as written in the manager's config file; durations like "20 minutes" or "30s".
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawLifecycle {
    #[serde(default = "default_connect_deadline")]
    pub connect_deadline: String,
    #[serde(default = "default_idle_timeout")]
    pub idle_timeout: String,
    #[serde(default = "default_max_idle_timeout")]
    pub max_idle_timeout: String,
    #[serde(default = "default_max_duration")]
    pub max_duration: String,
    #[serde(default = "default_max_max_duration")]
    pub max_max_duration: String,
    #[serde(default = "default_startup_grace")]
    pub startup_grace: String,
    #[serde(default = "default_keep_max")]
    pub keep_max: String,
    #[serde(default = "default_warn_before")]
    pub warn_before: String,
    #[serde(default = "default_threshold")]
    pub cpu_threshold_percent: f64,
    #[serde(default = "default_threshold")]
    pub gpu_threshold_percent: f64,
    #[serde(default = "default_connection_stale_after")]
    pub connection_stale_after: String,
    /// An open SSH connection alone keeps a session alive (default false: only activity does).
    #[serde(default)]
    pub open_connection_keeps_alive: bool,
}

impl Default for RawLifecycle {
    fn default() -> Self {
        Self {
            connect_deadline: default_connect_deadline(),
            idle_timeout: default_idle_timeout(),
            max_idle_timeout: default_max_idle_timeout(),
            max_duration: default_max_duration(),
            max_max_duration: default_max_max_duration(),
            startup_grace: default_startup_grace(),
            keep_max: default_keep_max(),
            warn_before: default_warn_before(),
            cpu_threshold_percent: default_threshold(),
            gpu_threshold_percent: default_threshold(),
            connection_stale_after: default_connection_stale_after(),
            open_connection_keeps_alive: false,
        }
    }
}

fn default_connect_deadline() -> String {
    "20 minutes".to_owned()
}
fn default_idle_timeout() -> String {
    "2 hours".to_owned()
}
fn default_max_idle_timeout() -> String {
    "8 hours".to_owned()
}
fn default_max_duration() -> String {
    "7 days".to_owned()
}
fn default_max_max_duration() -> String {
    "14 days".to_owned()
}
fn default_startup_grace() -> String {
    "5 minutes".to_owned()
}
fn default_keep_max() -> String {
    "12 hours".to_owned()
}
fn default_warn_before() -> String {
    "10 minutes".to_owned()
}
fn default_threshold() -> f64 {
    5.0
}
fn default_connection_stale_after() -> String {
    "3 minutes".to_owned()
}

/// A refused `[lifecycle]` value: the key (without `lifecycle.`) and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LifecycleConfigError {
    pub key: &'static str,
    pub message: String,
}

impl RawLifecycle {
    /// Validates every value; `duration` parses one (non-zero) duration for a key.
    pub fn validate(
        &self,
        duration: impl Fn(&'static str, &str) -> Result<Duration, LifecycleConfigError>,
    ) -> Result<LifecycleConfig, LifecycleConfigError> {
        let error = |key: &'static str, message: String| LifecycleConfigError { key, message };
        // Deadlines are instants: a duration past any calendar would overflow them.
        let duration = |key: &'static str, value: &str| {
            let parsed = duration(key, value)?;
            if parsed > LONGEST {
                return Err(error(
                    key,
                    format!(
                        "{value} is longer than this allows ({}): write a shorter duration",
                        HumanDuration(LONGEST)
                    ),
                ));
            }
            Ok(parsed)
        };
        let config = LifecycleConfig {
            connect_deadline: duration("connect_deadline", &self.connect_deadline)?,
            idle_timeout: duration("idle_timeout", &self.idle_timeout)?,
            max_idle_timeout: duration("max_idle_timeout", &self.max_idle_timeout)?,
            max_duration: duration("max_duration", &self.max_duration)?,
            max_max_duration: duration("max_max_duration", &self.max_max_duration)?,
            startup_grace: duration("startup_grace", &self.startup_grace)?,
            keep_max: duration("keep_max", &self.keep_max)?,
            warn_before: duration("warn_before", &self.warn_before)?,
            thresholds: ActivityThresholds {
                cpu_percent: self.cpu_threshold_percent,
                gpu_percent: self.gpu_threshold_percent,
            },
            connection_stale_after: duration(
                "connection_stale_after",
                &self.connection_stale_after,
            )?,
            open_connection_keeps_alive: self.open_connection_keeps_alive,
        };
        if config.idle_timeout > config.max_idle_timeout {
            return Err(error(
                "idle_timeout",
                format!(
                    "the default {} is longer than max_idle_timeout ({})",
                    HumanDuration(config.idle_timeout),
                    HumanDuration(config.max_idle_timeout)
                ),
            ));
        }
        if config.max_duration > config.max_max_duration {
            return Err(error(
                "max_duration",
                format!(
                    "the default {} is longer than max_max_duration ({})",
                    HumanDuration(config.max_duration),
                    HumanDuration(config.max_max_duration)
                ),
            ));
        }
        for (key, value) in [
            ("cpu_threshold_percent", self.cpu_threshold_percent),
            ("gpu_threshold_percent", self.gpu_threshold_percent),
        ] {
            if !value.is_finite() || value <= 0.0 {
                return Err(error(
                    key,
                    format!("{value} must be a percentage above 0, like 5.0"),
                ));
            }
        }
        Ok(config)
    }
}

#[cfg(test)]
mod reference;

/// `[dashboard]` in the manager's config.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DashboardConfig {
    /// The SSH gateway's host name as users reach it, for the `ssh` command the dashboard shows
    /// (`<gateway>` when absent).
    pub ssh_host: Option<String>,
    /// The gateway's port, when not 22.
    pub ssh_port: Option<u16>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use ongrid_core::Dn;

    const EXAMPLE: &str = r#"
listen = "127.0.0.1:8443"
database = "/var/lib/ongrid/manager.db"
tls_cert = "/etc/ongrid/manager.crt"
tls_key = "/etc/ongrid/manager.key"
ca_dir = "/etc/grid-security/certificates"
admins = ["/DC=org/DC=example/CN=Site Admin"]
agent_tokens_file = "/etc/ongrid/agent-tokens"
gateway_token_file = "/etc/ongrid/gateway-token"
default_image = "ongrid/dev:latest"
first_uid = 20000
node_timeout = "30 seconds"
sync_interval = "5 seconds"
schedule_interval = "1 second"
[session_limits]
cpus = "4"
memory = "16GiB"
pids = 4096
"#;

    fn no_env(_: &str) -> Option<String> {
        None
    }

    fn load(text: &str) -> Result<Config, ConfigError> {
        Config::from_toml(text, Path::new("/etc/ongrid/manager.toml"), no_env)
    }

    /// Why the example with `extra` appended is refused.
    fn refused_with(extra: &str) -> String {
        load(&format!("{EXAMPLE}{extra}")).unwrap_err().to_string()
    }

    /// The same with its causes, as the binary prints it.
    fn refused_chain(extra: &str) -> String {
        let err = load(&format!("{EXAMPLE}{extra}")).unwrap_err();
        format!("{:#}", anyhow::Error::from(err))
    }

    #[test]
    fn jobs_limits_and_log_dir() {
        let config = load(EXAMPLE).unwrap();
        assert_eq!(config.job_limits, crate::domain::jobs::JobLimits::default());
        assert_eq!(config.job_log_dir, Path::new("/var/lib/ongrid/jobs"));
        let text = format!(
            "{EXAMPLE}[jobs]\ndefault_max_duration = \"8h\"\nmax_duration = \"7 days\"\n\
             log_dir = \"/srv/job-logs\"\n"
        );
        let config = load(&text).unwrap();
        assert_eq!(
            config.job_limits.default_max_duration,
            Some(HumanDuration::from_secs(8 * 3600))
        );
        assert_eq!(
            config.job_limits.max_duration,
            HumanDuration::from_secs(7 * 86_400)
        );
        assert_eq!(config.job_log_dir, Path::new("/srv/job-logs"));
        assert_eq!(config.job_limits.output_grace, Duration::from_secs(600));
        assert!(!config.job_limits.shared_work_dir);
        let text = format!("{EXAMPLE}[jobs]\noutput_grace = \"90s\"\nshared_work_dir = true\n");
        let config = load(&text).unwrap();
        assert_eq!(config.job_limits.output_grace, Duration::from_secs(90));
        assert!(config.job_limits.shared_work_dir);
        let err = refused_with("[jobs]\noutput_grace = \"soon\"\n");
        assert!(err.contains("jobs.output_grace"), "{err}");
        let err =
            refused_with("[jobs]\ndefault_max_duration = \"2 days\"\nmax_duration = \"1 day\"\n");
        assert!(err.contains("jobs.default_max_duration"), "{err}");
        // Without a cap of its own, the site's is two weeks.
        let err = refused_with("[jobs]\ndefault_max_duration = \"3 weeks\"\n");
        assert!(
            err.contains("3 weeks is longer than jobs.max_duration, 2 weeks when not set: set jobs.max_duration to 3 weeks or more"),
            "{err}"
        );
        let err = refused_chain("[jobs]\nmax = \"1 day\"\n");
        assert!(err.contains("unknown field `max`"), "{err}");
    }

    #[test]
    fn retention_defaults_durations_and_forever() {
        use crate::retention::{RetentionConfig, DEFAULT_CONNECTIONS, DEFAULT_JOBS};
        let config = load(EXAMPLE).unwrap();
        assert_eq!(config.retention, RetentionConfig::default());
        assert_eq!(
            (config.retention.jobs, config.retention.connections),
            (Some(DEFAULT_JOBS), Some(DEFAULT_CONNECTIONS))
        );
        assert_eq!(DEFAULT_JOBS, Duration::from_secs(30 * 86_400));
        assert_eq!(DEFAULT_CONNECTIONS, Duration::from_secs(180 * 86_400));
        let text = format!("{EXAMPLE}[retention]\njobs = \"2 weeks\"\nconnections = \"forever\"\n");
        let config = load(&text).unwrap();
        assert_eq!(
            config.retention,
            RetentionConfig {
                jobs: Some(Duration::from_secs(14 * 86_400)),
                connections: None,
            }
        );
        let config = load(&format!("{EXAMPLE}[retention]\njobs = \"0\"\n")).unwrap();
        assert_eq!(config.retention.jobs, None);
        assert_eq!(config.retention.connections, Some(DEFAULT_CONNECTIONS));
        let err = refused_with("[retention]\njobs = \"a month\"\n");
        assert!(
            err.contains("key `retention.jobs`")
                && err.contains("or \"forever\" to keep everything"),
            "{err}"
        );
        let err = refused_with("[retention]\nconnections = \"10 minutes\"\n");
        assert!(
            err.contains("key `retention.connections`: 10 minutes is shorter than 1 hour"),
            "{err}"
        );
        let err = refused_chain("[retention]\nhistory = \"1 day\"\n");
        assert!(err.contains("unknown field `history`"), "{err}");
    }

    #[test]
    fn the_documented_example_loads() {
        let config = load(EXAMPLE).unwrap();
        assert_eq!(config.listen, "127.0.0.1:8443".parse().unwrap());
        assert_eq!(config.node_timeout, Duration::from_secs(30));
        assert_eq!(config.schedule_interval, Duration::from_secs(1));
        assert_eq!(config.session_limits.millicpus, 4000);
        assert_eq!(config.session_limits.memory.bytes(), 16 << 30);
        assert_eq!(config.session_limits.pids, 4096);
        assert_eq!(
            config.gateway_token_file,
            Some(PathBuf::from("/etc/ongrid/gateway-token"))
        );
        assert!(config
            .admins
            .contains(&Dn::parse("/DC=org/DC=example/CN=Site Admin").unwrap()));
    }

    #[test]
    fn the_deployed_example_loads() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/examples/manager.toml");
        let text = std::fs::read_to_string(&path).unwrap();
        let config = Config::from_toml(&text, &path, no_env).unwrap();
        assert_eq!(config.listen.port(), 8443);
    }

    #[test]
    fn the_lifecycle_section_is_validated_naming_its_keys() {
        let config = load(EXAMPLE).unwrap();
        assert_eq!(config.lifecycle, LifecycleConfig::default());
        let text = format!(
            "{EXAMPLE}[lifecycle]\nconnect_deadline = \"30s\"\nidle_timeout = \"1 minute\"\n"
        );
        let config = load(&text).unwrap();
        assert_eq!(config.lifecycle.connect_deadline, Duration::from_secs(30));
        assert_eq!(config.lifecycle.idle_timeout, Duration::from_secs(60));
        let err = refused_with("[lifecycle]\nidle_timeout = \"soon\"\n");
        assert!(err.contains("key `lifecycle.idle_timeout`"), "{err}");
        let err = refused_with("[lifecycle]\nidle_timeout = \"9 hours\"\n");
        assert!(err.contains("longer than max_idle_timeout"), "{err}");
        let err = refused_chain("[lifecycle]\nidle = \"1h\"\n");
        assert!(err.contains("unknown field `idle`"), "{err}");
    }

    #[test]
    fn placement_wait_is_milliseconds_zero_answering_at_once() {
        assert_eq!(
            load(EXAMPLE).unwrap().placement_wait,
            DEFAULT_PLACEMENT_WAIT
        );
        let wait = |ms: &str| load(&format!("placement_wait_ms = {ms}\n{EXAMPLE}"));
        assert_eq!(
            wait("250").unwrap().placement_wait,
            Duration::from_millis(250)
        );
        assert_eq!(wait("0").unwrap().placement_wait, Duration::ZERO);
        let err = wait("60000").unwrap_err().to_string();
        assert!(
            err.contains("key `placement_wait_ms`: 60000 is longer than 10000 ms"),
            "{err}"
        );
        let err = format!("{:#}", anyhow::Error::from(wait("\"1s\"").unwrap_err()));
        assert!(err.contains("placement_wait_ms"), "{err}");
    }

    #[test]
    fn allowed_images_are_docker_names_never_digests() {
        let config = load(&format!(
            "allowed_images = [\" python:3.12 \", \"ghcr.io/site/cuda:12\"]\n{EXAMPLE}"
        ))
        .unwrap();
        assert_eq!(
            config.allowed_images,
            ["python:3.12", "ghcr.io/site/cuda:12"]
        );
        let site = config.site_images();
        assert_eq!((site.default, site.allowed.len()), ("ongrid/dev:latest", 2));
        let digest = format!("sha256:{}", "ab".repeat(32));
        let err = load(&format!("allowed_images = [\"{digest}\"]\n{EXAMPLE}"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("key `allowed_images`") && err.contains("digest"),
            "{err}"
        );
        let err = load(&format!("allowed_images = [\"Bad Name\"]\n{EXAMPLE}"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("key `allowed_images`"), "{err}");
    }

    #[test]
    fn unknown_keys_are_refused() {
        let err = load(&format!("{EXAMPLE}\nlisten_port = 1\n")).unwrap_err();
        // The whole chain, as the binary prints it.
        let err = format!("{:#}", anyhow::Error::from(err));
        assert!(err.contains("manager.toml"), "{err}");
        assert!(err.contains("listen_port"), "{err}");
    }

    #[test]
    fn errors_name_the_key_and_file() {
        let bad = EXAMPLE.replace("\"30 seconds\"", "\"30 fortnights\"");
        let err = load(&bad).unwrap_err().to_string();
        assert!(
            err.starts_with("config file /etc/ongrid/manager.toml: key `node_timeout`:"),
            "{err}"
        );
        let bad = EXAMPLE.replace("cpus = \"4\"", "cpus = \"four\"");
        let err = load(&bad).unwrap_err().to_string();
        assert!(err.contains("key `session_limits.cpus`"), "{err}");
        let bad = EXAMPLE.replace("CN=Site Admin\"", "CN=Site Admin\", \"CN=Bob,O=x\"");
        let err = load(&bad).unwrap_err().to_string();
        assert!(err.contains("key `admins`"), "{err}");
        let bad = EXAMPLE.replace("\"5 seconds\"", "\"1 minute\"");
        let err = load(&bad).unwrap_err().to_string();
        assert!(err.contains("key `node_timeout`"), "{err}");
        let bad = EXAMPLE.replace("first_uid = 20000", "first_uid = 0");
        assert!(load(&bad).unwrap_err().to_string().contains("first_uid"));
    }

    #[test]
    fn environment_overrides() {
        let env = |name: &str| match name {
            ENV_LISTEN => Some("127.0.0.1:0".to_owned()),
            ENV_DATABASE => Some("/tmp/x.db".to_owned()),
            _ => None,
        };
        let config = Config::from_toml(EXAMPLE, Path::new("m.toml"), env).unwrap();
        assert_eq!(config.listen.port(), 0);
        assert_eq!(config.database, PathBuf::from("/tmp/x.db"));
        let bad = |name: &str| (name == ENV_LISTEN).then(|| "localhost".to_owned());
        let err = Config::from_toml(EXAMPLE, Path::new("m.toml"), bad)
            .unwrap_err()
            .to_string();
        assert!(err.contains(ENV_LISTEN), "{err}");
    }

    #[test]
    fn defaults_fill_optional_keys() {
        let minimal = r#"
listen = "[::]:8443"
database = "m.db"
tls_cert = "c"
tls_key = "k"
ca_dir = "d"
agent_tokens_file = "t"
"#;
        let config = load(minimal).unwrap();
        assert_eq!(config.first_uid, 20_000);
        assert_eq!(config.default_image, "ongrid/dev:latest");
        assert!(config.admins.is_empty());
        assert_eq!(config.sync_interval, Duration::from_secs(5));
        assert_eq!(config.gateway_token_file, None);
        let err = load(&format!("{minimal}gateway_token_file = \"\"\n"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("key `gateway_token_file`"), "{err}");
    }

    #[test]
    fn database_is_a_sqlite_file_or_a_postgres_url() {
        use crate::store::Database;
        let config = load(EXAMPLE).unwrap();
        assert_eq!(
            config.store,
            Database::Sqlite(PathBuf::from("/var/lib/ongrid/manager.db"))
        );
        assert_eq!(config.job_log_dir, PathBuf::from("/var/lib/ongrid/jobs"));
        let sqlite_url = EXAMPLE.replace(
            "database = \"/var/lib/ongrid/manager.db\"",
            "database = \"sqlite:/srv/m.db\"",
        );
        let config = load(&sqlite_url).unwrap();
        assert_eq!(config.store, Database::Sqlite(PathBuf::from("/srv/m.db")));
        assert_eq!(config.job_log_dir, PathBuf::from("/srv/jobs"));

        let postgres = EXAMPLE.replace(
            "database = \"/var/lib/ongrid/manager.db\"",
            "database = \"postgres://ongrid@db.example.org/ongrid\"",
        );
        let err = load(&postgres).unwrap_err().to_string();
        assert!(err.contains("key `jobs.log_dir`"), "{err}");
        let with_logs = format!("{postgres}\n[jobs]\nlog_dir = \"/srv/jobs\"\n");
        let loaded = load(&with_logs);
        #[cfg(feature = "postgres")]
        assert_eq!(
            loaded.unwrap().store,
            Database::Postgres("postgres://ongrid@db.example.org/ongrid".to_owned())
        );
        #[cfg(not(feature = "postgres"))]
        assert!(loaded
            .unwrap_err()
            .to_string()
            .contains("built without PostgreSQL"));
        let err = load(&EXAMPLE.replace(
            "database = \"/var/lib/ongrid/manager.db\"",
            "database = \"mysql://db/ongrid\"",
        ))
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("key `database`") && err.contains("postgres://"),
            "{err}"
        );
    }

    #[test]
    fn identity_keys() {
        let config = load(EXAMPLE).unwrap();
        assert_eq!(config.vomsdir, None);
        assert_eq!(config.crl_policy, CrlPolicy::Refuse);
        assert!(!config.limited_proxies_may_register_keys);
        let text = EXAMPLE.replace(
            "admins = [\"/DC=org/DC=example/CN=Site Admin\"]",
            "admins = [\"/DC=org/DC=example/CN=Site Admin\", \"/myvo/Role=admin\"]\n\
             vomsdir = \"/etc/grid-security/vomsdir\"\ncrl_policy = \"warn\"\n\
             limited_proxies_may_register_keys = true",
        );
        let config = load(&text).unwrap();
        assert_eq!(
            config.vomsdir,
            Some(PathBuf::from("/etc/grid-security/vomsdir"))
        );
        assert_eq!(config.crl_policy, CrlPolicy::Warn);
        assert!(config.limited_proxies_may_register_keys);
        assert!(config.admins.admits(
            &Dn::parse("/DC=org/CN=Someone").unwrap(),
            &[ongrid_x509::voms::Fqan::parse("/myvo/Role=admin/Capability=NULL").unwrap()]
        ));
        let err = load(&text.replace("\"warn\"", "\"ignore\""))
            .unwrap_err()
            .to_string();
        assert!(err.contains("key `crl_policy`"), "{err}");
        assert!(err.contains("\"refuse\""), "{err}");
    }

    #[test]
    fn millicpus() {
        assert_eq!(parse_millicpus("4"), Ok(4000));
        assert_eq!(parse_millicpus("1.5"), Ok(1500));
        assert_eq!(parse_millicpus("0.25"), Ok(250));
        assert_eq!(parse_millicpus(" 2.125 "), Ok(2125));
        for bad in ["", "1.", ".5", "1.2345", "-1", "1,5", "four", "0", "0.001"] {
            assert!(parse_millicpus(bad).is_err(), "{bad}");
        }
        assert!(parse_millicpus("99999999").is_err());
    }

    #[test]
    fn lifecycle_defaults_agree_and_limits_are_checked() {
        let parse = |_: &'static str, v: &str| Ok(HumanDuration::parse(v).unwrap().as_duration());
        assert_eq!(
            RawLifecycle::default().validate(parse),
            Ok(LifecycleConfig::default())
        );
        let raw = RawLifecycle {
            idle_timeout: "9 hours".to_owned(),
            ..RawLifecycle::default()
        };
        assert_eq!(raw.validate(parse).unwrap_err().key, "idle_timeout");
        // Far beyond any calendar: refused, rather than overflowing the deadlines later.
        let raw = RawLifecycle {
            max_idle_timeout: "100000000000 weeks".to_owned(),
            ..RawLifecycle::default()
        };
        let err = raw.validate(parse).unwrap_err();
        assert_eq!(err.key, "max_idle_timeout");
        assert!(err.message.contains("write a shorter duration"), "{err:?}");
        let raw = RawLifecycle {
            max_idle_timeout: "5200 weeks".to_owned(),
            keep_max: "5200 weeks".to_owned(),
            ..RawLifecycle::default()
        };
        let longest = raw.validate(parse).unwrap();
        assert_eq!(longest.max_idle_timeout, LONGEST);
        let raw = RawLifecycle {
            cpu_threshold_percent: -1.0,
            ..RawLifecycle::default()
        };
        assert_eq!(
            raw.validate(parse).unwrap_err().key,
            "cpu_threshold_percent"
        );
    }
}
