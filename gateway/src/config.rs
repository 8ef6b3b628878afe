//! The gateway's configuration: one TOML file, read once at start-up and validated into domain
//! types ([`Config`]), so the rest of the gateway never sees a raw string or a missing file.
//!
//! ```toml
//! listen = "0.0.0.0:2222"                    # tests use "127.0.0.1:0"
//! host_key_dir = "/var/lib/ongrid-gateway"    # ssh_host_ed25519_key, ssh_host_rsa_key (created)
//! manager_url = "https://ongrid.example.org:8443"
//! ca_dir = "/etc/grid-security/certificates"  # trusted for the manager's and agents' certificates
//! token_file = "/etc/ongrid/gateway-token"    # Bearer token towards the manager and the agents
//! allowlist_refresh = "5 seconds"
//! activity_report = "60 seconds"              # byte totals of open connections to the manager
//! warn_before = "10 minutes"                  # warn interactive shells this long before a hold
//! max_startups = "100:30:1000"                # connections not logged in yet, in total: start:rate:full
//! per_source_max_startups = 50                # connections not logged in yet, from one address
//! [proxy_protocol]                            # optional; off when absent
//! trusted = ["192.0.2.10/32"]                 # load balancers allowed to send PROXY v2 headers
//! [metrics]                                   # optional; off when absent
//! listen = "127.0.0.1:9471"                    # /metrics, /healthz, /readyz over plain HTTP
//! ```

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use ongrid_core::{Cidr, HumanDuration};
use ongrid_service::config_file::{self, FileError};
use ongrid_service::manager_http::{parse_manager_urls, ManagerUrlError, ManagerUrlsFile};
use ongrid_service::metrics::MetricsConfig;
use ongrid_service::TokenError;
use reqwest::Url;
use serde::Deserialize;

use crate::startups::StartupLimits;

/// The gateway's bearer token. `Debug` and `Display` print `<secret>` so it never reaches a log.
pub use ongrid_service::Token;

/// The refresh interval when `allowlist_refresh` is not given.
pub const DEFAULT_ALLOWLIST_REFRESH: Duration = Duration::from_secs(5);
const MIN_ALLOWLIST_REFRESH: Duration = Duration::from_secs(1);
const MAX_ALLOWLIST_REFRESH: Duration = Duration::from_secs(3600);
/// How often open connections report their traffic when `activity_report` is not given. The
/// manager counts a connection as live for a few minutes after its last report.
pub const DEFAULT_ACTIVITY_REPORT: Duration = Duration::from_secs(60);
const MIN_ACTIVITY_REPORT: Duration = Duration::from_secs(1);
const MAX_ACTIVITY_REPORT: Duration = Duration::from_secs(3600);
/// How long before a planned hold interactive shells are warned, when `warn_before` is not given.
pub const DEFAULT_WARN_BEFORE: Duration = Duration::from_secs(600);
const MAX_WARN_BEFORE: Duration = Duration::from_secs(86_400);

/// Why the configuration was refused. Each message names the file or key to fix.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("config file {path} is not valid")]
    Parse {
        path: PathBuf,
        #[source]
        source: toml::de::Error,
    },
    #[error("listen {0:?} is not an address and port, like \"0.0.0.0:2222\"")]
    Listen(String),
    #[error("host_key_dir {0} exists but is not a directory")]
    HostKeyDir(PathBuf),
    #[error(transparent)]
    ManagerUrl(#[from] ManagerUrlError),
    #[error("ca_dir {0} is not a directory: point it at the CAs that signed the manager's and the agents' certificates")]
    CaDir(PathBuf),
    #[error("cannot read token_file {path}")]
    TokenFile {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "token_file {0} is empty: put the gateway's token (the manager's gateway_token_file) in it"
    )]
    EmptyToken(PathBuf),
    #[error("allowlist_refresh is not a duration")]
    AllowlistRefresh(#[source] ongrid_core::quantity::DurationError),
    #[error("allowlist_refresh {0} is out of range: use between 1 second and 1 hour")]
    AllowlistRefreshRange(HumanDuration),
    #[error("{key} is not a duration like \"60 seconds\"")]
    Duration {
        key: &'static str,
        #[source]
        source: ongrid_core::quantity::DurationError,
    },
    #[error("activity_report {0} is out of range: use between 1 second and 1 hour (the manager counts a connection as gone a few minutes after its last report)")]
    ActivityReportRange(HumanDuration),
    #[error("warn_before {0} is out of range: use at most 1 day")]
    WarnBeforeRange(HumanDuration),
    #[error("max_startups {0}")]
    MaxStartups(String),
    #[error("per_source_max_startups must be at least 1")]
    PerSourceMaxStartups,
    #[error("[proxy_protocol] trusted has no entry: list the load balancers' addresses, or remove the table to turn PROXY protocol off")]
    NoTrustedProxies,
    #[error("[proxy_protocol] trusted entry is not a network")]
    TrustedProxy(#[source] ongrid_core::network::CidrError),
}

impl From<FileError> for ConfigError {
    fn from(error: FileError) -> Self {
        match error {
            FileError::Read { path, source } => Self::Read { path, source },
            FileError::Parse { path, source } => Self::Parse { path, source },
        }
    }
}

impl From<TokenError> for ConfigError {
    fn from(error: TokenError) -> Self {
        match error {
            TokenError::Read { path, source } => Self::TokenFile { path, source },
            TokenError::Empty(path) => Self::EmptyToken(path),
        }
    }
}

/// The file as written; [`Config::parse`] validates it.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ConfigFile {
    listen: String,
    host_key_dir: PathBuf,
    manager_url: ManagerUrlsFile,
    ca_dir: PathBuf,
    token_file: PathBuf,
    allowlist_refresh: Option<String>,
    activity_report: Option<String>,
    warn_before: Option<String>,
    max_startups: Option<String>,
    per_source_max_startups: Option<u32>,
    proxy_protocol: Option<ProxyProtocolFile>,
    metrics: Option<MetricsConfig>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ProxyProtocolFile {
    trusted: Vec<String>,
}

/// The validated configuration of the gateway.
#[derive(Debug, Clone)]
pub struct Config {
    pub listen: SocketAddr,
    /// Where the host keys live; created (0700) with the keys on first start.
    pub host_key_dir: PathBuf,
    /// The manager's base URL (https), or each of its replicas' (`manager_url`: one URL or a
    /// list, tried in turn); API paths are joined to it.
    pub manager_urls: Vec<Url>,
    /// CAs trusted for the manager's and the agents' server certificates (`*.0`, `*.pem`).
    pub ca_dir: PathBuf,
    /// The gateway's bearer token, read from `token_file`.
    pub token: Token,
    /// How often the institutes' allowlist is fetched from the manager.
    pub allowlist_refresh: Duration,
    /// How often each open connection reports its byte totals to the manager.
    pub activity_report: Duration,
    /// How long before a planned hold interactive shells are warned.
    pub warn_before: Duration,
    /// The cap on connections that have not authenticated yet (`max_startups`,
    /// `per_source_max_startups`).
    pub startups: StartupLimits,
    /// PROXY protocol v2 from trusted load balancers; `None` means off.
    pub proxy_protocol: Option<ProxyProtocol>,
    /// The metrics and health listener; `None` means none.
    pub metrics: Option<MetricsConfig>,
}

/// Which peers may (and then must) send a PROXY protocol v2 header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProxyProtocol {
    pub trusted: Vec<Cidr>,
}

impl ProxyProtocol {
    /// Whether `peer` (normalised) is one of the trusted load balancers.
    pub fn trusts(&self, peer: IpAddr) -> bool {
        self.trusted.iter().any(|cidr| cidr.contains(peer))
    }
}

impl Config {
    /// Reads and validates the file at `path`.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        Self::parse(&config_file::read(path)?, path)
    }

    /// Validates the TOML text of a config file; `path` is only used in messages.
    pub fn parse(text: &str, path: &Path) -> Result<Self, ConfigError> {
        let file: ConfigFile = config_file::parse(text, path)?;
        let listen = file
            .listen
            .parse()
            .map_err(|_| ConfigError::Listen(file.listen.clone()))?;
        if file.host_key_dir.exists() && !file.host_key_dir.is_dir() {
            return Err(ConfigError::HostKeyDir(file.host_key_dir));
        }
        let manager_urls = parse_manager_urls(&file.manager_url)?;
        if !file.ca_dir.is_dir() {
            return Err(ConfigError::CaDir(file.ca_dir));
        }
        let token = Token::read_first_line(&file.token_file)?;
        let allowlist_refresh = match &file.allowlist_refresh {
            None => DEFAULT_ALLOWLIST_REFRESH,
            Some(text) => {
                let refresh = HumanDuration::parse(text).map_err(ConfigError::AllowlistRefresh)?;
                let duration = refresh.as_duration();
                if !(MIN_ALLOWLIST_REFRESH..=MAX_ALLOWLIST_REFRESH).contains(&duration) {
                    return Err(ConfigError::AllowlistRefreshRange(refresh));
                }
                duration
            }
        };
        let duration = |key: &'static str, text: &Option<String>| {
            text.as_deref()
                .map(|text| {
                    HumanDuration::parse(text)
                        .map_err(|source| ConfigError::Duration { key, source })
                })
                .transpose()
        };
        let activity_report = match duration("activity_report", &file.activity_report)? {
            None => DEFAULT_ACTIVITY_REPORT,
            Some(every)
                if (MIN_ACTIVITY_REPORT..=MAX_ACTIVITY_REPORT).contains(&every.as_duration()) =>
            {
                every.as_duration()
            }
            Some(every) => return Err(ConfigError::ActivityReportRange(every)),
        };
        let warn_before = match duration("warn_before", &file.warn_before)? {
            None => DEFAULT_WARN_BEFORE,
            Some(before) if before.as_duration() <= MAX_WARN_BEFORE => before.as_duration(),
            Some(before) => return Err(ConfigError::WarnBeforeRange(before)),
        };
        let defaults = StartupLimits::default();
        let (start, rate, full) = match &file.max_startups {
            None => (defaults.start, defaults.rate, defaults.full),
            Some(text) => {
                StartupLimits::parse_max_startups(text).map_err(ConfigError::MaxStartups)?
            }
        };
        let per_source = file.per_source_max_startups.unwrap_or(defaults.per_source);
        if per_source == 0 {
            return Err(ConfigError::PerSourceMaxStartups);
        }
        let startups = StartupLimits {
            start,
            rate,
            full,
            per_source,
        };
        let proxy_protocol = match file.proxy_protocol {
            None => None,
            Some(table) => {
                if table.trusted.is_empty() {
                    return Err(ConfigError::NoTrustedProxies);
                }
                let trusted = table
                    .trusted
                    .iter()
                    .map(|entry| Cidr::parse(entry))
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(ConfigError::TrustedProxy)?;
                Some(ProxyProtocol { trusted })
            }
        };
        Ok(Self {
            listen,
            host_key_dir: file.host_key_dir,
            manager_urls,
            ca_dir: file.ca_dir,
            token,
            allowlist_refresh,
            activity_report,
            warn_before,
            startups,
            proxy_protocol,
            metrics: file.metrics,
        })
    }
}

#[cfg(test)]
mod reference;

#[cfg(test)]
mod tests {
    use super::*;

    struct Files {
        dir: tempfile::TempDir,
    }

    impl Files {
        fn new() -> Self {
            let dir = tempfile::tempdir().unwrap();
            std::fs::create_dir(dir.path().join("certs")).unwrap();
            std::fs::write(dir.path().join("token"), "gw-s3cret\n# comment\n").unwrap();
            Self { dir }
        }

        fn toml(&self, extra: &str) -> String {
            format!(
                r#"listen = "127.0.0.1:0"
host_key_dir = "{dir}/keys"
manager_url = "https://127.0.0.1:8443"
ca_dir = "{dir}/certs"
token_file = "{dir}/token"
{extra}"#,
                dir = self.dir.path().display()
            )
        }

        fn parse(&self, extra: &str) -> Result<Config, ConfigError> {
            Config::parse(&self.toml(extra), Path::new("gateway.toml"))
        }
    }

    #[test]
    fn a_minimal_file_gets_the_defaults() {
        let files = Files::new();
        let config = files.parse("").unwrap();
        assert_eq!(config.listen, "127.0.0.1:0".parse().unwrap());
        assert_eq!(config.token.expose(), "gw-s3cret");
        assert_eq!(config.allowlist_refresh, DEFAULT_ALLOWLIST_REFRESH);
        assert_eq!(config.activity_report, Duration::from_secs(60));
        assert_eq!(config.warn_before, Duration::from_secs(600));
        assert!(config.proxy_protocol.is_none());
        assert_eq!(config.startups, StartupLimits::default());
        assert_eq!(format!("{:?}", config.token), "<secret>");
        assert!(!format!("{config:?}").contains("gw-s3cret"));
    }

    #[test]
    fn refresh_and_proxy_protocol() {
        let files = Files::new();
        let config = files
            .parse(
                "allowlist_refresh = \"2 seconds\"\n[proxy_protocol]\ntrusted = [\"192.0.2.10/32\", \"2001:db8::/64\"]\n",
            )
            .unwrap();
        assert_eq!(config.allowlist_refresh, Duration::from_secs(2));
        let proxy = config.proxy_protocol.unwrap();
        assert!(proxy.trusts("192.0.2.10".parse().unwrap()));
        assert!(proxy.trusts("::ffff:192.0.2.10".parse().unwrap()));
        assert!(proxy.trusts("2001:db8::7".parse().unwrap()));
        assert!(!proxy.trusts("192.0.2.11".parse().unwrap()));
    }

    #[test]
    fn lifecycle_settings() {
        let files = Files::new();
        let config = files
            .parse("activity_report = \"1 second\"\nwarn_before = \"5 minutes\"\n")
            .unwrap();
        assert_eq!(config.activity_report, Duration::from_secs(1));
        assert_eq!(config.warn_before, Duration::from_secs(300));
        let message = |extra: &str| {
            let error = files.parse(extra).unwrap_err();
            format!("{:#}", anyhow::Error::from(error))
        };
        assert!(message("activity_report = \"often\"").contains("activity_report"));
        assert!(message("activity_report = \"0 seconds\"").contains("out of range"));
        assert!(message("activity_report = \"2 hours\"").contains("out of range"));
        assert!(message("warn_before = \"2 days\"").contains("warn_before"));
    }

    #[test]
    fn startup_limits() {
        let files = Files::new();
        let config = files
            .parse("max_startups = \"10:30:100\"\nper_source_max_startups = 3\n")
            .unwrap();
        assert_eq!(
            config.startups,
            StartupLimits {
                start: 10,
                rate: 30,
                full: 100,
                per_source: 3
            }
        );
        let config = files.parse("max_startups = \"20\"\n").unwrap();
        assert_eq!((config.startups.start, config.startups.full), (20, 20));
        assert_eq!(config.startups.rate, 100);
        let message = |extra: &str| {
            let error = files.parse(extra).unwrap_err();
            format!("{:#}", anyhow::Error::from(error))
        };
        assert!(message("max_startups = \"10:30\"").contains("max_startups"));
        assert!(message("max_startups = \"100:30:10\"").contains("full must be at least start"));
        assert!(message("per_source_max_startups = 0").contains("per_source_max_startups"));
        assert!(message("per_source_max_startups = -1").contains("not valid"));
    }

    #[test]
    fn refusals_name_the_key_to_fix() {
        let files = Files::new();
        let message = |extra: &str| {
            let error = files.parse(extra).unwrap_err();
            format!("{:#}", anyhow::Error::from(error))
        };
        assert!(message("allowlist_refresh = \"soon\"").contains("allowlist_refresh"));
        assert!(message("allowlist_refresh = \"0 seconds\"").contains("out of range"));
        assert!(message("allowlist_refresh = \"2 days\"").contains("out of range"));
        assert!(message("[proxy_protocol]\ntrusted = []").contains("trusted has no entry"));
        assert!(message("[proxy_protocol]\ntrusted = [\"10.0.0.1/8\"]").contains("host bits"));
        assert!(message("colour = \"blue\"").contains("not valid"));

        let dir = files.dir.path().display().to_string();
        let http = files
            .toml("")
            .replace("https://127.0.0.1:8443", "http://127.0.0.1:8443");
        let error = Config::parse(&http, Path::new("g.toml")).unwrap_err();
        assert!(matches!(
            error,
            ConfigError::ManagerUrl(ManagerUrlError::NotHttps(_))
        ));
        let no_ca = files
            .toml("")
            .replace(&format!("{dir}/certs"), &format!("{dir}/missing"));
        let error = Config::parse(&no_ca, Path::new("g.toml")).unwrap_err();
        assert!(matches!(error, ConfigError::CaDir(_)));
        let bad_listen = files.toml("").replace("127.0.0.1:0", "localhost");
        let error = Config::parse(&bad_listen, Path::new("g.toml")).unwrap_err();
        assert!(matches!(error, ConfigError::Listen(_)));
        std::fs::write(files.dir.path().join("token"), "\n").unwrap();
        assert!(matches!(
            files.parse("").unwrap_err(),
            ConfigError::EmptyToken(_)
        ));
        std::fs::write(files.dir.path().join("keys"), "a file").unwrap();
        std::fs::write(files.dir.path().join("token"), "t\n").unwrap();
        assert!(matches!(
            files.parse("").unwrap_err(),
            ConfigError::HostKeyDir(_)
        ));
    }
}
