//! The agent's configuration: one TOML file, read once at start-up and validated into domain
//! types ([`Config`]), so the rest of the agent never sees a raw string or a missing file.
//!
//! ```toml
//! node_name = "node1"
//! manager_url = "https://127.0.0.1:8443"
//! ca_dir = "/etc/grid-security/certificates"      # CAs trusted for the manager's certificate
//! token_file = "/etc/ongrid/node-token"           # the node's bearer token, one line
//! [gpu]
//! backend = "simulated"                           # or "nvidia-smi" (optional `path`)
//! file = "/etc/ongrid/simulated-gpus.toml"
//! [streams]                                       # optional: the SSH gateway's stream endpoint
//! listen = "0.0.0.0:8444"
//! url = "wss://node1.example.org:8444"            # optional; default wss://<bound address>
//! tls_cert = "/etc/ongrid/agent.crt"              # PEM chain of the agent's server certificate
//! tls_key = "/etc/ongrid/agent.key"               # PEM private key
//! gateway_token_file = "/etc/ongrid/gateway-token" # the gateway's bearer token, one line
//! [images]                                        # optional: where freezes write SIF images
//! store = "/var/lib/ongrid/images"                # the manager's image_store (shared)
//! max_concurrent = 2                              # freezes at once on this node
//! jobs_dir = "/var/lib/ongrid/jobs"               # optional; default: beside store
//! [network]                                       # optional; the defaults:
//! subnet_pool = "10.213.0.0/16"                   # each session's network takes a /29 of it
//! allow = ["0.0.0.0/0"]                           # where dev containers may connect to ...
//! deny = ["10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "224.0.0.0/3"]
//! iptables = "/usr/sbin/iptables"                 # the program for the rules; <program>-restore beside it
//! [reserved]                                      # optional: kept for the node itself
//! cpus = "0.5"
//! memory = "1GiB"
//! [metrics]                                       # optional; off when absent
//! listen = "127.0.0.1:9472"                        # /metrics, /healthz, /readyz (plain HTTP)
//! [storage]                                       # optional: site storage, see crate::storage
//! home = "/site/home/{login}"                     # default: the node-local volume ongrid-home-<login>
//! [[storage.read_only]]
//! source = "/cvmfs"
//! [exec]                                          # optional; the defaults:
//! mode = "direct"                                 # runc beside dockerd; "docker": docker exec
//! runc = "runc"                                   # the OCI runtime of Docker's containers
//! runc_root = "/run/docker/runtime-runc/moby"     # its state directory (runc --root)
//! ```
//!
//! `[network]`: the most specific `allow` or `deny` entry containing a destination decides, a
//! destination in none is refused; link-local addresses (169.254.0.0/16) and the node's own
//! addresses are always refused (see [`crate::network`]). `[reserved]`: a session's CPU and
//! memory limits are lowered to what the node has minus this, never below half the node
//! ([`crate::runtime::LimitCeiling`]).

use std::fmt;
use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ongrid_core::{MemorySize, NodeName};
use ongrid_service::config_file::{self, FileError};
use ongrid_service::manager_http::{parse_manager_urls, ManagerUrlError, ManagerUrlsFile};
use ongrid_service::metrics::MetricsConfig;
use ongrid_service::TokenError;
use reqwest::Url;
use serde::Deserialize;

/// A bearer token (the node's, the gateway's). `Debug` and `Display` print `<secret>` so it
/// never reaches a log.
pub use ongrid_service::Token;

use crate::gpu::GpuBackendConfig;
use crate::network::NetworkPolicy;
use crate::runtime::Reserved;
use crate::stream_identity::{self, StreamsIdentityError};

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
    #[error("node_name is not valid")]
    NodeName(#[source] ongrid_core::NameError),
    #[error(transparent)]
    ManagerUrl(#[from] ManagerUrlError),
    #[error(
        "ca_dir {0} is not a directory: point it at the CAs that signed the manager's certificate"
    )]
    CaDir(PathBuf),
    #[error("cannot read token_file {path}")]
    TokenFile {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("token_file {0} is empty: put this node's token (from the manager's agent_tokens_file) in it")]
    EmptyToken(PathBuf),
    #[error("gpu file {0} does not exist: create it or fix [gpu] file")]
    GpuFile(PathBuf),
    #[error("gpu path {0} does not exist: install nvidia-smi or fix [gpu] path")]
    NvidiaSmiPath(PathBuf),
    #[error("[streams] listen {0:?} is not an address and port, like 0.0.0.0:8444")]
    StreamsListen(String),
    #[error("[streams] url {0:?} is not a wss:// URL, like wss://node1.example.org:8444")]
    StreamsUrl(String),
    #[error("cannot read [streams] gateway_token_file {path}")]
    GatewayTokenFile {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("[streams] gateway_token_file {0} is empty: put the gateway's token in it (the same as the gateway's token_file)")]
    EmptyGatewayToken(PathBuf),
    #[error(
        "[images] store {0:?} must be an absolute directory path, like /var/lib/ongrid/images"
    )]
    ImageStore(PathBuf),
    #[error("[images] max_concurrent must be at least 1")]
    MaxConcurrentFreezes,
    #[error("[containers] parallel_operations must be at least 1 (1: one container operation at a time)")]
    ParallelOperations,
    #[error(
        "[images] jobs_dir {0:?} must be an absolute directory path, like /var/lib/ongrid/jobs"
    )]
    JobsDir(PathBuf),
    #[error("[images] job_halt_grace {0:?} is not a duration of at least 1 second, like \"15s\"")]
    JobHaltGrace(String),
    #[error(transparent)]
    Network(#[from] crate::network::PolicyError),
    #[error("[network] iptables {0:?} is not an absolute path, like /usr/sbin/iptables-legacy")]
    IptablesPath(PathBuf),
    #[error("[network] iptables: {0} does not exist: install iptables or point the key at the iptables Docker uses")]
    IptablesMissing(PathBuf),
    #[error("[reserved] cpus {0:?} is not a number of CPUs like 0.5 or 2")]
    ReservedCpus(String),
    #[error("[reserved] memory")]
    ReservedMemory(#[source] ongrid_core::quantity::MemorySizeError),
    #[error("[streams] TLS identity")]
    StreamsTls(#[source] StreamsIdentityError),
    #[error(transparent)]
    Storage(#[from] crate::storage::StorageError),
}

impl From<FileError> for ConfigError {
    fn from(error: FileError) -> Self {
        match error {
            FileError::Read { path, source } => Self::Read { path, source },
            FileError::Parse { path, source } => Self::Parse { path, source },
        }
    }
}

/// The file as written; [`Config::load`] validates it.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ConfigFile {
    node_name: String,
    manager_url: ManagerUrlsFile,
    ca_dir: PathBuf,
    token_file: PathBuf,
    gpu: GpuBackendConfig,
    streams: Option<StreamsFile>,
    images: Option<ImagesFile>,
    #[serde(default)]
    network: NetworkFile,
    #[serde(default)]
    reserved: ReservedFile,
    metrics: Option<MetricsConfig>,
    #[serde(default)]
    storage: crate::storage::StorageFile,
    #[serde(default)]
    exec: crate::runtime::direct::ExecConfig,
    #[serde(default)]
    containers: ContainersFile,
}

/// The `[containers]` table as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ContainersFile {
    #[serde(default = "default_parallel_operations")]
    parallel_operations: usize,
}

impl Default for ContainersFile {
    fn default() -> Self {
        Self {
            parallel_operations: default_parallel_operations(),
        }
    }
}

fn default_parallel_operations() -> usize {
    crate::reconcile::DEFAULT_PARALLEL_OPERATIONS.get()
}

/// The `[network]` table as written; absent keys take the defaults of [`NetworkPolicy`].
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct NetworkFile {
    #[serde(default = "default_subnet_pool")]
    subnet_pool: String,
    #[serde(default = "default_allow")]
    allow: Vec<String>,
    #[serde(default = "default_deny")]
    deny: Vec<String>,
    /// The iptables program of the rules (`iptables-restore` is `<program>-restore`); default
    /// [`crate::network::iptables::IPTABLES`], whose absence the firewall check reports.
    iptables: Option<PathBuf>,
}

impl Default for NetworkFile {
    fn default() -> Self {
        Self {
            subnet_pool: default_subnet_pool(),
            allow: default_allow(),
            deny: default_deny(),
            iptables: None,
        }
    }
}

fn default_subnet_pool() -> String {
    NetworkPolicy::DEFAULT_SUBNET_POOL.to_owned()
}

fn default_allow() -> Vec<String> {
    NetworkPolicy::DEFAULT_ALLOW.map(str::to_owned).to_vec()
}

fn default_deny() -> Vec<String> {
    NetworkPolicy::DEFAULT_DENY.map(str::to_owned).to_vec()
}

/// The `[reserved]` table as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ReservedFile {
    #[serde(default = "default_reserved_cpus")]
    cpus: String,
    #[serde(default = "default_reserved_memory")]
    memory: String,
}

impl Default for ReservedFile {
    fn default() -> Self {
        Self {
            cpus: default_reserved_cpus(),
            memory: default_reserved_memory(),
        }
    }
}

fn default_reserved_cpus() -> String {
    "0.5".to_owned()
}

fn default_reserved_memory() -> String {
    "1GiB".to_owned()
}

impl ReservedFile {
    fn validate(self) -> Result<Reserved, ConfigError> {
        let cpus: f64 = self
            .cpus
            .trim()
            .parse()
            .ok()
            .filter(|c: &f64| c.is_finite() && *c >= 0.0 && *c <= 100_000.0)
            .ok_or_else(|| ConfigError::ReservedCpus(self.cpus.clone()))?;
        let memory = MemorySize::parse(&self.memory).map_err(ConfigError::ReservedMemory)?;
        Ok(Reserved {
            // Bounded above, so the conversion is exact enough and cannot overflow.
            #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
            millicpus: (cpus * 1000.0).round() as u64,
            memory_bytes: memory.bytes(),
        })
    }
}

/// The `[images]` table as written: the image store freezes write to.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ImagesFile {
    store: PathBuf,
    #[serde(default = "default_max_concurrent_freezes")]
    max_concurrent: usize,
    /// Batch jobs' working directories (and this node's job logs under `.agent/<node>`);
    /// default: `jobs` beside `store`.
    jobs_dir: Option<PathBuf>,
    /// How long a halted job has between SIGUSR1 and SIGKILL, like `"15s"` (the default).
    job_halt_grace: Option<String>,
}

fn default_max_concurrent_freezes() -> usize {
    2
}

/// The `[streams]` table as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct StreamsFile {
    listen: String,
    url: Option<String>,
    tls_cert: PathBuf,
    tls_key: PathBuf,
    gateway_token_file: PathBuf,
}

/// The validated configuration of one agent.
#[derive(Debug, Clone)]
pub struct Config {
    pub node_name: NodeName,
    /// The manager's base URL (https); API paths are joined to it.
    /// The manager, or each of its replicas (`manager_url`: one URL or a list).
    pub manager_urls: Vec<Url>,
    /// CAs trusted for the manager's server certificate (`*.0` and `*.pem` files).
    pub ca_dir: PathBuf,
    /// The node's bearer token, read from `token_file`.
    pub token: Token,
    pub gpu: GpuBackendConfig,
    /// The SSH gateway's stream endpoint; `None` when the table is absent (no SSH to this node).
    pub streams: Option<StreamsConfig>,
    /// The image store for freezes; `None` when `[images]` is absent (freezes are refused).
    pub images: Option<crate::freeze::ImagesConfig>,
    /// Where batch jobs find their SIF images and keep their files; `None` when `[images]`
    /// is absent (jobs fail, saying so).
    pub jobs: Option<crate::jobs::JobsConfig>,
    /// Where dev containers may connect to, and their networks' address pool.
    pub network: NetworkPolicy,
    /// The iptables program that installs the rules of the session networks (`[network]
    /// iptables`), in the network namespace of the node's Docker; its `-restore` is beside it.
    pub iptables: PathBuf,
    /// CPU and memory kept for the node itself.
    pub reserved: Reserved,
    /// The metrics and health listener; `None` when `[metrics]` is absent.
    pub metrics: Option<MetricsConfig>,
    /// Homes and site mounts of every container (`[storage]`).
    pub storage: crate::storage::SiteStorage,
    /// How stream processes start in dev containers (`[exec]`).
    pub exec: crate::runtime::direct::ExecConfig,
    /// How many creations, starts, stops and removals of dev containers run at once
    /// (`[containers] parallel_operations`).
    pub parallel_operations: NonZeroUsize,
}

/// The validated `[streams]` table: where to listen, what to tell the manager, the TLS identity
/// (already loaded, so a bad certificate fails at start-up) and the gateway's token.
#[derive(Clone)]
pub struct StreamsConfig {
    pub listen: SocketAddr,
    /// What the manager hands to the gateway; `None`: `wss://<bound address>`.
    pub url: Option<Url>,
    pub tls_cert: PathBuf,
    pub tls: Arc<rustls::ServerConfig>,
    /// The bearer token the gateway presents.
    pub gateway_token: Token,
}

impl fmt::Debug for StreamsConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StreamsConfig")
            .field("listen", &self.listen)
            .field("url", &self.url)
            .field("tls_cert", &self.tls_cert)
            .field("gateway_token", &self.gateway_token)
            .finish_non_exhaustive()
    }
}

impl StreamsFile {
    fn validate(self) -> Result<StreamsConfig, ConfigError> {
        let listen = self
            .listen
            .parse()
            .map_err(|_| ConfigError::StreamsListen(self.listen.clone()))?;
        let url = match self.url {
            None => None,
            Some(text) => match Url::parse(&text) {
                Ok(url) if url.scheme() == "wss" && url.host().is_some() => Some(url),
                _ => return Err(ConfigError::StreamsUrl(text)),
            },
        };
        let gateway_token =
            Token::read_first_line(&self.gateway_token_file).map_err(|error| match error {
                TokenError::Read { path, source } => ConfigError::GatewayTokenFile { path, source },
                TokenError::Empty(path) => ConfigError::EmptyGatewayToken(path),
            })?;
        let tls = stream_identity::server_config(&self.tls_cert, &self.tls_key)
            .map_err(ConfigError::StreamsTls)?;
        Ok(StreamsConfig {
            listen,
            url,
            tls_cert: self.tls_cert,
            tls: Arc::new(tls),
            gateway_token,
        })
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
        let node_name = NodeName::parse(&file.node_name).map_err(ConfigError::NodeName)?;
        let manager_urls = parse_manager_urls(&file.manager_url)?;
        if !file.ca_dir.is_dir() {
            return Err(ConfigError::CaDir(file.ca_dir));
        }
        let token = Token::read_first_line(&file.token_file).map_err(|error| match error {
            TokenError::Read { path, source } => ConfigError::TokenFile { path, source },
            TokenError::Empty(path) => ConfigError::EmptyToken(path),
        })?;
        match &file.gpu {
            GpuBackendConfig::Simulated { file } if !file.exists() => {
                return Err(ConfigError::GpuFile(file.clone()));
            }
            GpuBackendConfig::NvidiaSmi {
                path: Some(path), ..
            } if !path.exists() => {
                return Err(ConfigError::NvidiaSmiPath(path.clone()));
            }
            _ => {}
        }
        let streams = file.streams.map(StreamsFile::validate).transpose()?;
        let mut jobs = None;
        let images = match file.images {
            None => None,
            Some(images) => {
                if images.store.as_os_str().is_empty() || !images.store.is_absolute() {
                    return Err(ConfigError::ImageStore(images.store));
                }
                if images.max_concurrent == 0 {
                    return Err(ConfigError::MaxConcurrentFreezes);
                }
                let dir = match images.jobs_dir {
                    Some(dir) if dir.is_absolute() => dir,
                    Some(dir) => return Err(ConfigError::JobsDir(dir)),
                    None => images.store.parent().unwrap_or(&images.store).join("jobs"),
                };
                let halt_grace = match images.job_halt_grace {
                    None => ongrid_core::job::HALT_GRACE,
                    Some(text) => ongrid_core::HumanDuration::parse(&text)
                        .ok()
                        .map(|d| d.as_duration())
                        .filter(|d| d.as_secs() >= 1)
                        .ok_or(ConfigError::JobHaltGrace(text))?,
                };
                jobs = Some(crate::jobs::JobsConfig {
                    image_store: images.store.clone(),
                    dir,
                    halt_grace,
                });
                Some(crate::freeze::ImagesConfig {
                    store: images.store,
                    max_concurrent: images.max_concurrent,
                })
            }
        };
        let network = NetworkPolicy::parse(
            &file.network.subnet_pool,
            &file.network.allow,
            &file.network.deny,
        )?;
        let iptables = match file.network.iptables {
            None => PathBuf::from(crate::network::iptables::IPTABLES),
            Some(program) => {
                if !program.is_absolute() {
                    return Err(ConfigError::IptablesPath(program));
                }
                let restore = crate::network::iptables::restore_program(&program);
                if let Some(missing) = [&program, &restore].into_iter().find(|p| !p.exists()) {
                    return Err(ConfigError::IptablesMissing(missing.clone()));
                }
                program
            }
        };
        let reserved = file.reserved.validate()?;
        let storage = file.storage.validate()?;
        let parallel_operations = NonZeroUsize::new(file.containers.parallel_operations)
            .ok_or(ConfigError::ParallelOperations)?;
        Ok(Self {
            node_name,
            manager_urls,
            ca_dir: file.ca_dir,
            token,
            gpu: file.gpu,
            streams,
            images,
            jobs,
            network,
            iptables,
            reserved,
            metrics: file.metrics,
            storage,
            exec: file.exec,
            parallel_operations,
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
            std::fs::write(dir.path().join("token"), "s3cret-token\n").unwrap();
            std::fs::write(dir.path().join("gpus.toml"), "").unwrap();
            Self { dir }
        }

        fn path(&self, name: &str) -> String {
            self.dir.path().join(name).display().to_string()
        }

        fn config(&self, extra: &str) -> String {
            format!(
                "node_name = \"node1\"\nmanager_url = \"https://127.0.0.1:8443\"\n\
                 ca_dir = \"{}\"\ntoken_file = \"{}\"\n{extra}\n\
                 [gpu]\nbackend = \"simulated\"\nfile = \"{}\"\n",
                self.path("certs"),
                self.path("token"),
                self.path("gpus.toml"),
            )
        }

        fn parse(&self, text: &str) -> Result<Config, ConfigError> {
            Config::parse(text, Path::new("agent.toml"))
        }
    }

    #[test]
    fn images_store_is_optional_and_checked() {
        let files = Files::new();
        assert_eq!(files.parse(&files.config("")).unwrap().images, None);
        let config = files
            .parse(&files.config("[images]\nstore = \"/var/lib/ongrid/images\"\n"))
            .unwrap();
        let images = config.images.unwrap();
        assert_eq!(images.store, PathBuf::from("/var/lib/ongrid/images"));
        assert_eq!(images.max_concurrent, 2);
        assert_eq!(
            config.jobs.unwrap().dir,
            PathBuf::from("/var/lib/ongrid/jobs"),
            "jobs_dir defaults to beside the store"
        );
        let config = files
            .parse(&files.config(
                "[images]\nstore = \"/var/lib/ongrid/images\"\njobs_dir = \"/scratch/jobs\"\n",
            ))
            .unwrap();
        assert_eq!(config.jobs.unwrap().dir, PathBuf::from("/scratch/jobs"));
        let grace =
            |text: &str| files.parse(&files.config(&format!("[images]\nstore = \"/x\"\n{text}")));
        assert_eq!(
            grace("").unwrap().jobs.unwrap().halt_grace,
            ongrid_core::job::HALT_GRACE
        );
        assert_eq!(
            grace("job_halt_grace = \"3s\"\n")
                .unwrap()
                .jobs
                .unwrap()
                .halt_grace,
            std::time::Duration::from_secs(3)
        );
        for bad in ["\"soon\"", "\"0s\""] {
            assert!(matches!(
                grace(&format!("job_halt_grace = {bad}\n")),
                Err(ConfigError::JobHaltGrace(_))
            ));
        }
        assert!(matches!(
            files.parse(&files.config("[images]\nstore = \"/x\"\njobs_dir = \"jobs\"\n")),
            Err(ConfigError::JobsDir(_))
        ));
        let relative = files
            .parse(&files.config("[images]\nstore = \"images\"\n"))
            .unwrap_err();
        assert!(relative.to_string().contains("absolute"), "{relative}");
        let zero = files
            .parse(&files.config("[images]\nstore = \"/x\"\nmax_concurrent = 0\n"))
            .unwrap_err();
        assert!(zero.to_string().contains("at least 1"), "{zero}");
    }

    #[test]
    fn network_and_reserve_have_defaults_and_are_checked() {
        let files = Files::new();
        let config = files.parse(&files.config("")).unwrap();
        assert_eq!(config.network, NetworkPolicy::default_policy());
        assert_eq!(config.reserved, Reserved::DEFAULT);

        let text = files.config(
            "[network]\nallow = [\"10.1.2.0/24\"]\ndeny = []\n\
             [reserved]\ncpus = \"2\"\nmemory = \"4GiB\"\n",
        );
        let config = files.parse(&text).unwrap();
        assert!(config.network.allows("10.1.2.3".parse().unwrap()));
        assert!(!config.network.allows("1.1.1.1".parse().unwrap()));
        assert_eq!(config.network.subnet_pool.to_string(), "10.213.0.0/16");
        assert_eq!(config.reserved.millicpus, 2000);
        assert_eq!(config.reserved.memory_bytes, 4 << 30);

        let bad = files
            .parse(&files.config("[network]\ndeny = [\"10.0.0.1/8\"]\n"))
            .unwrap_err();
        assert!(bad.to_string().contains("10.0.0.0/8"), "{bad}");
        let bad = files
            .parse(&files.config("[reserved]\ncpus = \"lots\"\n"))
            .unwrap_err();
        assert!(matches!(bad, ConfigError::ReservedCpus(_)), "{bad:?}");
        let bad = files
            .parse(&files.config("[network]\nports = []\n"))
            .unwrap_err();
        assert!(matches!(bad, ConfigError::Parse { .. }), "{bad:?}");
    }

    #[test]
    fn the_iptables_program_defaults_to_debians_and_another_needs_its_restore_beside_it() {
        let files = Files::new();
        let config = files.parse(&files.config("")).unwrap();
        assert_eq!(config.iptables, PathBuf::from("/usr/sbin/iptables"));

        let program = files.dir.path().join("iptables-legacy");
        std::fs::write(&program, "").unwrap();
        let text = files.config(&format!(
            "[network]\niptables = \"{}\"\n",
            program.display()
        ));
        let missing = files.parse(&text).unwrap_err();
        assert!(
            matches!(&missing, ConfigError::IptablesMissing(p) if p.ends_with("iptables-legacy-restore")),
            "{missing:?}"
        );
        assert!(
            missing
                .to_string()
                .contains("iptables-legacy-restore does not exist"),
            "{missing}"
        );
        std::fs::write(files.dir.path().join("iptables-legacy-restore"), "").unwrap();
        assert_eq!(files.parse(&text).unwrap().iptables, program);

        let relative = files
            .parse(&files.config("[network]\niptables = \"iptables\"\n"))
            .unwrap_err();
        assert!(
            matches!(relative, ConfigError::IptablesPath(_)),
            "{relative:?}"
        );
    }

    #[test]
    fn valid_config_is_validated_into_domain_types() {
        let files = Files::new();
        let config = files.parse(&files.config("")).unwrap();
        assert_eq!(config.node_name.as_str(), "node1");
        assert_eq!(config.manager_urls[0].as_str(), "https://127.0.0.1:8443/");
        assert_eq!(config.token.expose(), "s3cret-token");
        assert_eq!(
            config.gpu,
            GpuBackendConfig::Simulated {
                file: files.dir.path().join("gpus.toml")
            }
        );
    }

    #[test]
    fn token_never_prints() {
        let files = Files::new();
        let config = files.parse(&files.config("")).unwrap();
        let debug = format!("{config:?}");
        assert!(!debug.contains("s3cret"), "{debug}");
        assert!(debug.contains("<secret>"), "{debug}");
        assert_eq!(config.token.to_string(), "<secret>");
    }

    #[test]
    fn parallel_operations_default_to_8_and_are_at_least_1() {
        let files = Files::new();
        let parallel = |extra: &str| {
            files
                .parse(&files.config(extra))
                .map(|config| config.parallel_operations.get())
        };
        assert_eq!(parallel("").unwrap(), 8);
        assert_eq!(
            parallel("[containers]\nparallel_operations = 1\n").unwrap(),
            1
        );
        assert!(matches!(
            parallel("[containers]\nparallel_operations = 0\n"),
            Err(ConfigError::ParallelOperations)
        ));
    }

    #[test]
    fn unknown_keys_are_refused() {
        let files = Files::new();
        let err = files.parse(&files.config("sync_every = 3")).unwrap_err();
        assert!(matches!(err, ConfigError::Parse { .. }), "{err:?}");
        let chain = format!("{:#}", anyhow::Error::from(err));
        assert!(chain.contains("sync_every"), "{chain}");
    }

    #[test]
    fn bad_values_name_the_fix() {
        let files = Files::new();
        let text = files.config("").replace("node1", "Node 1");
        assert!(matches!(
            files.parse(&text).unwrap_err(),
            ConfigError::NodeName(_)
        ));

        let text = files.config("").replace("https://", "http://");
        let err = files.parse(&text).unwrap_err();
        assert!(
            matches!(err, ConfigError::ManagerUrl(ManagerUrlError::NotHttps(_))),
            "{err:?}"
        );

        let text = files
            .config("")
            .replace("https://127.0.0.1:8443", "not a url");
        let err = files.parse(&text).unwrap_err();
        assert!(
            matches!(
                err,
                ConfigError::ManagerUrl(ManagerUrlError::NotAUrl { .. })
            ),
            "{err:?}"
        );

        let text = files
            .config("")
            .replace(&files.path("certs"), "/nonexistent/certs");
        let err = files.parse(&text).unwrap_err();
        assert!(err.to_string().contains("/nonexistent/certs"), "{err}");

        let text = files
            .config("")
            .replace(&files.path("gpus.toml"), "/nonexistent/gpus.toml");
        let err = files.parse(&text).unwrap_err();
        assert!(matches!(err, ConfigError::GpuFile(_)), "{err:?}");
    }

    #[test]
    fn token_file_must_exist_and_hold_a_token() {
        let files = Files::new();
        let text = files
            .config("")
            .replace(&files.path("token"), "/nonexistent/token");
        let err = files.parse(&text).unwrap_err();
        assert!(matches!(err, ConfigError::TokenFile { .. }), "{err:?}");

        std::fs::write(files.dir.path().join("token"), "  \n").unwrap();
        let err = files.parse(&files.config("")).unwrap_err();
        assert!(matches!(err, ConfigError::EmptyToken(_)), "{err:?}");
        assert!(err.to_string().contains("agent_tokens_file"), "{err}");
    }

    impl Files {
        /// Writes a TLS identity and a gateway token; the `[streams]` table using them.
        fn streams(&self, listen: &str, url: Option<&str>) -> String {
            let key = rcgen::KeyPair::generate().unwrap();
            let cert = rcgen::CertificateParams::new(vec!["node1.example.org".to_owned()])
                .unwrap()
                .self_signed(&key)
                .unwrap();
            std::fs::write(self.dir.path().join("agent.crt"), cert.pem()).unwrap();
            std::fs::write(self.dir.path().join("agent.key"), key.serialize_pem()).unwrap();
            std::fs::write(self.dir.path().join("gateway-token"), "gw-secret\n").unwrap();
            let url = url.map(|u| format!("url = \"{u}\"\n")).unwrap_or_default();
            format!(
                "[streams]\nlisten = \"{listen}\"\n{url}tls_cert = \"{}\"\n\
                 tls_key = \"{}\"\ngateway_token_file = \"{}\"\n",
                self.path("agent.crt"),
                self.path("agent.key"),
                self.path("gateway-token"),
            )
        }
    }

    #[test]
    fn streams_are_off_without_the_table_and_validated_with_it() {
        let files = Files::new();
        assert!(files.parse(&files.config("")).unwrap().streams.is_none());

        let text = files.config("") + &files.streams("127.0.0.1:0", None);
        let streams = files.parse(&text).unwrap().streams.unwrap();
        assert_eq!(streams.listen, "127.0.0.1:0".parse().unwrap());
        assert_eq!(streams.url, None);
        assert_eq!(streams.gateway_token.expose(), "gw-secret");
        assert!(!format!("{streams:?}").contains("gw-secret"));

        let text =
            files.config("") + &files.streams("0.0.0.0:8444", Some("wss://node1.example.org:8444"));
        let streams = files.parse(&text).unwrap().streams.unwrap();
        assert_eq!(
            streams.url.map(|u| u.to_string()),
            Some("wss://node1.example.org:8444/".to_owned())
        );
    }

    #[test]
    fn bad_streams_tables_name_the_fix() {
        let files = Files::new();
        let text = files.config("") + &files.streams("node1:8444", None);
        let err = files.parse(&text).unwrap_err();
        assert!(matches!(err, ConfigError::StreamsListen(_)), "{err:?}");

        let text = files.config("") + &files.streams("0.0.0.0:8444", Some("https://node1:8444"));
        let err = files.parse(&text).unwrap_err();
        assert!(matches!(err, ConfigError::StreamsUrl(_)), "{err:?}");

        let text = files.config("") + &files.streams("0.0.0.0:8444", None) + "port = 1\n";
        let err = files.parse(&text).unwrap_err();
        assert!(matches!(err, ConfigError::Parse { .. }), "{err:?}");

        let text = files.config("") + &files.streams("0.0.0.0:8444", None);
        std::fs::write(files.dir.path().join("gateway-token"), "\n").unwrap();
        let err = files.parse(&text).unwrap_err();
        assert!(matches!(err, ConfigError::EmptyGatewayToken(_)), "{err:?}");

        let text = files.config("") + &files.streams("0.0.0.0:8444", None);
        std::fs::write(files.dir.path().join("agent.key"), "not a key").unwrap();
        let chain = format!("{:#}", anyhow::Error::from(files.parse(&text).unwrap_err()));
        assert!(chain.contains("tls_key"), "{chain}");
    }

    #[test]
    fn storage_is_off_without_the_table_and_checked_with_it() {
        let files = Files::new();
        let config = files.parse(&files.config("")).unwrap();
        assert_eq!(config.storage, crate::storage::SiteStorage::default());
        std::fs::create_dir(files.dir.path().join("homes")).unwrap();
        let text = files.config("")
            + &format!(
                "[storage]\nhome = \"{}/{{login}}\"\n[[storage.read_only]]\nsource = \"{}\"\n",
                files.path("homes"),
                files.path("certs")
            );
        let config = files.parse(&text).unwrap();
        assert!(matches!(
            config.storage.home,
            crate::storage::HomeStorage::Directory { .. }
        ));
        assert_eq!(config.storage.mounts.len(), 1);
        let text = files.config("") + "[[storage.read_only]]\nsource = \"/nonexistent/cvmfs\"\n";
        let err = files.parse(&text).unwrap_err();
        assert!(matches!(err, ConfigError::Storage(_)), "{err:?}");
        assert!(
            err.to_string().contains("[[storage.read_only]] source"),
            "{err}"
        );
    }

    #[test]
    fn nvidia_smi_backend_parses() {
        let files = Files::new();
        let text = files.config("").replace(
            &format!(
                "backend = \"simulated\"\nfile = \"{}\"",
                files.path("gpus.toml")
            ),
            "backend = \"nvidia-smi\"",
        );
        let config = files.parse(&text).unwrap();
        assert_eq!(
            config.gpu,
            GpuBackendConfig::NvidiaSmi {
                path: None,
                timeout: None,
                kernel_log: None,
            }
        );
    }
}
