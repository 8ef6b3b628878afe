//! The agent's side of the manager's API (`core/src/api.rs`): `POST /v1/agent/register` once
//! (and whenever the GPU inventory changes), then `POST /v1/agent/sync` every sync interval.
//! HTTPS only, trusting exactly the CAs of `ca_dir` (no built-in roots), with the node's token
//! as `Authorization: Bearer`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use ongrid_core::api::{DesiredState, NodeReport, RegisterNode};
use ongrid_service::manager_http::{ClientSettings, HttpError, ManagerHttp};
use ongrid_service::pem;
use reqwest::{Certificate, StatusCode, Url};

use crate::config::Token;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// Why talking to the manager failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cannot read CA directory {dir}")]
    CaDir {
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot read CA file {path}")]
    CaFile {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("CA file {path} does not hold PEM certificates")]
    BadCa {
        path: PathBuf,
        #[source]
        source: reqwest::Error,
    },
    #[error("CA directory {0} holds no certificate (*.0 or *.pem): put the CA that signed the manager's certificate there")]
    NoCa(PathBuf),
    #[error("manager_url {0} cannot be a base URL")]
    BaseUrl(String),
    #[error("building the HTTPS client")]
    Build(#[source] reqwest::Error),
    #[error("cannot reach the manager at {url}")]
    Unreachable {
        url: String,
        #[source]
        source: reqwest::Error,
    },
    #[error("the manager answered {status} to {url}: {message}{hint}")]
    Refused {
        url: String,
        status: StatusCode,
        message: String,
        /// What to do about it, when the status says.
        hint: &'static str,
    },
    #[error("the manager's answer to {url} is not what this agent understands: are both the same version?")]
    BadAnswer {
        url: String,
        #[source]
        source: reqwest::Error,
    },
}

/// An HTTPS client of one manager, for one node.
#[derive(Debug, Clone)]
pub struct ManagerClient {
    http: ManagerHttp,
    register_url: Url,
    sync_url: Url,
}

impl ManagerClient {
    /// A client of the manager at `manager_url` that trusts only the CAs in `ca_dir`.
    pub fn new(manager_url: &Url, ca_dir: &Path, token: Token) -> Result<Self, ClientError> {
        let settings = ClientSettings {
            user_agent: concat!("ongrid-agent/", env!("CARGO_PKG_VERSION")),
            connect_timeout: CONNECT_TIMEOUT,
            request_timeout: REQUEST_TIMEOUT,
        };
        let http = ManagerHttp::new(manager_url, load_ca_dir(ca_dir)?, token, settings)?;
        Ok(Self {
            register_url: http.url("v1/agent/register")?,
            sync_url: http.url("v1/agent/sync")?,
            http,
        })
    }

    pub async fn register(&self, body: &RegisterNode) -> Result<DesiredState, ClientError> {
        Ok(self.http.post(&self.register_url, body).await?)
    }

    pub async fn sync(&self, body: &NodeReport) -> Result<DesiredState, ClientError> {
        Ok(self.http.post(&self.sync_url, body).await?)
    }
}

impl From<HttpError> for ClientError {
    fn from(error: HttpError) -> Self {
        match error {
            HttpError::BaseUrl(url) => Self::BaseUrl(url),
            HttpError::Build(source) => Self::Build(source),
            HttpError::Unreachable { url, source } => Self::Unreachable { url, source },
            HttpError::Refused {
                url,
                status,
                code,
                message,
            } => {
                let hint = match status {
                    StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN => {
                        " (check that token_file holds this node's token from the manager's agent_tokens_file, under this node_name)"
                    }
                    _ => "",
                };
                Self::Refused {
                    url,
                    status,
                    message: match code {
                        Some(code) => format!("{code}: {message}"),
                        None => message,
                    },
                    hint,
                }
            }
            HttpError::BadAnswer { url, source } => Self::BadAnswer { url, source },
        }
    }
}

/// The certificates of every `*.0` and `*.pem` file in `dir` (IGTF layout: `<hash>.0`; other
/// files such as CRLs `*.r0` and `*.signing_policy` are skipped).
pub fn load_ca_dir(dir: &Path) -> Result<Vec<Certificate>, ClientError> {
    let paths = pem::ca_dir_files(dir).map_err(|source| ClientError::CaDir {
        dir: dir.to_owned(),
        source,
    })?;
    let mut certificates = Vec::new();
    for path in paths {
        let pem = std::fs::read(&path).map_err(|source| ClientError::CaFile {
            path: path.clone(),
            source,
        })?;
        let bundle = Certificate::from_pem_bundle(&pem).map_err(|source| ClientError::BadCa {
            path: path.clone(),
            source,
        })?;
        certificates.extend(bundle);
    }
    if certificates.is_empty() {
        return Err(ClientError::NoCa(dir.to_owned()));
    }
    Ok(certificates)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ca_pem() -> String {
        let key = rcgen::KeyPair::generate().unwrap();
        let params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.self_signed(&key).unwrap().pem()
    }

    #[test]
    fn ca_dir_loads_only_certificate_files() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("1a2b3c4d.0"), ca_pem()).unwrap();
        std::fs::write(
            dir.path().join("site.pem"),
            format!("{}{}", ca_pem(), ca_pem()),
        )
        .unwrap();
        std::fs::write(dir.path().join("1a2b3c4d.r0"), "not a certificate").unwrap();
        std::fs::write(
            dir.path().join("1a2b3c4d.signing_policy"),
            "access_id_CA X509",
        )
        .unwrap();
        assert_eq!(load_ca_dir(dir.path()).unwrap().len(), 3);
    }

    #[test]
    fn empty_or_missing_ca_dir_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("README"), "nothing here").unwrap();
        let err = load_ca_dir(dir.path()).unwrap_err();
        assert!(matches!(err, ClientError::NoCa(_)), "{err:?}");
        assert!(err.to_string().contains(&dir.path().display().to_string()));

        let err = load_ca_dir(&dir.path().join("absent")).unwrap_err();
        assert!(matches!(err, ClientError::CaDir { .. }), "{err:?}");
    }

    #[test]
    fn urls_are_joined_under_the_base_path() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("ca.pem"), ca_pem()).unwrap();
        let token = Token::new("t");
        let plain = Url::parse("https://manager.example.org:8443").unwrap();
        let client = ManagerClient::new(&plain, dir.path(), token.clone()).unwrap();
        assert_eq!(
            client.sync_url.as_str(),
            "https://manager.example.org:8443/v1/agent/sync"
        );
        let prefixed = Url::parse("https://example.org/ongrid").unwrap();
        let client = ManagerClient::new(&prefixed, dir.path(), token).unwrap();
        assert_eq!(
            client.register_url.as_str(),
            "https://example.org/ongrid/v1/agent/register"
        );
    }
}
