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
//! ```

use std::fmt;
use std::path::{Path, PathBuf};

use ongrid_core::NodeName;
use reqwest::Url;
use serde::Deserialize;

use crate::gpu::GpuBackendConfig;

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
    #[error("manager_url {url:?} is not a URL, like https://manager.example.org:8443")]
    ManagerUrl {
        url: String,
        #[source]
        source: url_error::ParseError,
    },
    #[error("manager_url {0:?} must use https: the agent only talks to a manager it can verify")]
    ManagerUrlNotHttps(String),
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
}

/// `url`'s error type, reached through reqwest's re-export of [`Url`].
mod url_error {
    pub type ParseError = <reqwest::Url as std::str::FromStr>::Err;
}

/// The file as written; [`Config::load`] validates it.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ConfigFile {
    node_name: String,
    manager_url: String,
    ca_dir: PathBuf,
    token_file: PathBuf,
    gpu: GpuBackendConfig,
}

/// The validated configuration of one agent.
#[derive(Debug, Clone)]
pub struct Config {
    pub node_name: NodeName,
    /// The manager's base URL (https); API paths are joined to it.
    pub manager_url: Url,
    /// CAs trusted for the manager's server certificate (`*.0` and `*.pem` files).
    pub ca_dir: PathBuf,
    /// The node's bearer token, read from `token_file`.
    pub token: Token,
    pub gpu: GpuBackendConfig,
}

impl Config {
    /// Reads and validates the file at `path`.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::parse(&text, path)
    }

    /// Validates the TOML text of a config file; `path` is only used in messages.
    pub fn parse(text: &str, path: &Path) -> Result<Self, ConfigError> {
        let file: ConfigFile = toml::from_str(text).map_err(|source| ConfigError::Parse {
            path: path.to_owned(),
            source,
        })?;
        let node_name = NodeName::parse(&file.node_name).map_err(ConfigError::NodeName)?;
        let manager_url =
            Url::parse(&file.manager_url).map_err(|source| ConfigError::ManagerUrl {
                url: file.manager_url.clone(),
                source,
            })?;
        if manager_url.scheme() != "https" {
            return Err(ConfigError::ManagerUrlNotHttps(file.manager_url));
        }
        if !file.ca_dir.is_dir() {
            return Err(ConfigError::CaDir(file.ca_dir));
        }
        let token = Token::read(&file.token_file)?;
        match &file.gpu {
            GpuBackendConfig::Simulated { file } if !file.exists() => {
                return Err(ConfigError::GpuFile(file.clone()));
            }
            GpuBackendConfig::NvidiaSmi { path: Some(path) } if !path.exists() => {
                return Err(ConfigError::NvidiaSmiPath(path.clone()));
            }
            _ => {}
        }
        Ok(Self {
            node_name,
            manager_url,
            ca_dir: file.ca_dir,
            token,
            gpu: file.gpu,
        })
    }
}

/// The node's bearer token. `Debug` and `Display` print `<secret>` so it never reaches a log.
#[derive(Clone, PartialEq, Eq)]
pub struct Token(String);

impl Token {
    /// Wraps a token; surrounding whitespace is dropped.
    pub fn new(value: &str) -> Self {
        Self(value.trim().to_owned())
    }

    /// Reads the first line of `path`.
    pub fn read(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::TokenFile {
            path: path.to_owned(),
            source,
        })?;
        let token = Self::new(text.lines().next().unwrap_or(""));
        if token.0.is_empty() {
            return Err(ConfigError::EmptyToken(path.to_owned()));
        }
        Ok(token)
    }

    /// The token itself, for the `Authorization` header only.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<secret>")
    }
}

impl fmt::Display for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<secret>")
    }
}

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
    fn valid_config_is_validated_into_domain_types() {
        let files = Files::new();
        let config = files.parse(&files.config("")).unwrap();
        assert_eq!(config.node_name.as_str(), "node1");
        assert_eq!(config.manager_url.as_str(), "https://127.0.0.1:8443/");
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
        assert!(matches!(err, ConfigError::ManagerUrlNotHttps(_)), "{err:?}");

        let text = files
            .config("")
            .replace("https://127.0.0.1:8443", "not a url");
        let err = files.parse(&text).unwrap_err();
        assert!(matches!(err, ConfigError::ManagerUrl { .. }), "{err:?}");

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
        assert_eq!(config.gpu, GpuBackendConfig::NvidiaSmi { path: None });
    }
}
