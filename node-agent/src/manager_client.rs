//! The agent's side of the manager's API (`core/src/api.rs`): `POST /v1/agent/register` once
//! (and whenever the GPU inventory changes), then `POST /v1/agent/sync` every sync interval,
//! and between syncs the long-poll `GET /v1/agent/desired?after=<version>` that answers when the
//! node's desired state changes. HTTPS only, trusting exactly the CAs of `ca_dir` (no built-in
//! roots), with the node's token as `Authorization: Bearer`.

use std::path::Path;
use std::time::Duration;

use ongrid_core::api::{DesiredState, NodeReport, RegisterNode};
use ongrid_service::manager_http::{decode, ClientSettings, ManagerHttp};
use ongrid_service::pem::{self, CaDirError};
use reqwest::{StatusCode, Url};

pub use ongrid_service::manager_http::HttpError;

use crate::config::Token;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// Why talking to the manager failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("ca_dir must hold the CA that signed the manager's certificate")]
    CaDir(#[from] CaDirError),
    #[error(transparent)]
    Http(HttpError),
    /// A 401 or 403: the manager does not take this node's token.
    #[error("the manager refused this node's token: check that token_file holds this node's token from the manager's agent_tokens_file, under this node_name")]
    TokenRefused(#[source] HttpError),
}

impl From<HttpError> for ClientError {
    fn from(error: HttpError) -> Self {
        if error.is_token_refused() {
            Self::TokenRefused(error)
        } else {
            Self::Http(error)
        }
    }
}

impl ClientError {
    /// The status of the manager's non-2xx answer.
    pub fn status(&self) -> Option<StatusCode> {
        match self {
            Self::Http(error) | Self::TokenRefused(error) => error.status(),
            Self::CaDir(_) => None,
        }
    }
}

/// How much longer than the wait it asked for the agent gives a long-poll to answer.
const LONG_POLL_GRACE: Duration = Duration::from_secs(10);

/// A desired state with its version (the manager's `ETag`), which the long-poll compares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Versioned {
    pub desired: DesiredState,
    /// `None` from a manager that does not send one.
    pub version: Option<String>,
}

/// An HTTPS client of the manager (or its replicas), for one node.
#[derive(Debug, Clone)]
pub struct AgentRoutes {
    http: ManagerHttp,
    register_url: Url,
    sync_url: Url,
    desired_url: Url,
}

impl AgentRoutes {
    /// A client of the manager at `manager_urls` (or of each of its replicas there) that trusts
    /// only the CAs in `ca_dir` (read strictly: a CA file that cannot be used is an error).
    pub fn new(manager_urls: &[Url], ca_dir: &Path, token: Token) -> Result<Self, ClientError> {
        let settings = ClientSettings {
            user_agent: concat!("ongrid-agent/", env!("CARGO_PKG_VERSION")),
            connect_timeout: CONNECT_TIMEOUT,
            request_timeout: REQUEST_TIMEOUT,
        };
        let roots = pem::load_ca_dir(ca_dir)?;
        let http = ManagerHttp::new(manager_urls, &roots, token, settings)?;
        Ok(Self {
            register_url: http.url("v1/agent/register")?,
            sync_url: http.url("v1/agent/sync")?,
            desired_url: http.url("v1/agent/desired")?,
            http,
        })
    }

    pub async fn register(&self, body: &RegisterNode) -> Result<DesiredState, ClientError> {
        Ok(self.http.post(&self.register_url, body).await?)
    }

    pub async fn sync(&self, body: &NodeReport) -> Result<Versioned, ClientError> {
        let response = self.http.post_for_response(&self.sync_url, body).await?;
        let version = version(&response);
        let desired = decode(&self.sync_url, response).await?;
        Ok(Versioned { desired, version })
    }

    /// The long-poll: the node's desired state as soon as its version differs from `after`
    /// (at once when `after` is `None`), or `None` when it did not change within `wait`.
    pub async fn desired(
        &self,
        after: Option<&str>,
        wait: Duration,
    ) -> Result<Option<Versioned>, ClientError> {
        let mut url = self.desired_url.clone();
        {
            let mut query = url.query_pairs_mut();
            if let Some(after) = after {
                query.append_pair("after", after);
            }
            query.append_pair("timeout", &wait.as_secs().to_string());
        }
        let response = self
            .http
            .get_for_response(&url, wait + LONG_POLL_GRACE)
            .await?;
        if response.status() == StatusCode::NO_CONTENT {
            return Ok(None);
        }
        let version = version(&response);
        let desired = decode(&self.desired_url, response).await?;
        Ok(Some(Versioned { desired, version }))
    }
}

/// The version in an answer's `ETag` (`"abc"` or `W/"abc"` → `abc`).
fn version(response: &reqwest::Response) -> Option<String> {
    let tag = response
        .headers()
        .get(reqwest::header::ETAG)?
        .to_str()
        .ok()?;
    let tag = tag.trim().trim_start_matches("W/").trim_matches('"');
    (!tag.is_empty()).then(|| tag.to_owned())
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
    fn a_ca_dir_without_a_ca_names_what_belongs_there() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("README"), "nothing here").unwrap();
        let url = Url::parse("https://manager.example.org:8443").unwrap();
        let err = AgentRoutes::new(&[url], dir.path(), Token::new("t")).unwrap_err();
        assert!(matches!(err, ClientError::CaDir(_)), "{err:?}");
        let text = format!("{:#}", anyhow::Error::from(err));
        assert!(text.contains("signed the manager's certificate"), "{text}");
        assert!(text.contains(&dir.path().display().to_string()), "{text}");
    }

    #[test]
    fn a_refused_token_names_token_file() {
        let refused = |status| HttpError::Refused {
            url: "https://m/v1/agent/sync".to_owned(),
            status,
            code: Some("unauthenticated".to_owned()),
            message: "unknown node token".to_owned(),
        };
        let err = ClientError::from(refused(StatusCode::UNAUTHORIZED));
        assert!(matches!(err, ClientError::TokenRefused(_)), "{err:?}");
        assert_eq!(err.status(), Some(StatusCode::UNAUTHORIZED));
        let text = format!("{:#}", anyhow::Error::from(err));
        assert!(text.contains("token_file"), "{text}");
        assert!(
            text.contains("unauthenticated: unknown node token"),
            "{text}"
        );
        let err = ClientError::from(refused(StatusCode::NOT_FOUND));
        assert!(matches!(err, ClientError::Http(_)), "{err:?}");
        assert_eq!(err.status(), Some(StatusCode::NOT_FOUND));
    }

    #[test]
    fn urls_are_joined_under_the_base_path() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("ca.pem"), ca_pem()).unwrap();
        let token = Token::new("t");
        let plain = Url::parse("https://manager.example.org:8443").unwrap();
        let client = AgentRoutes::new(&[plain], dir.path(), token.clone()).unwrap();
        assert_eq!(
            client.sync_url.as_str(),
            "https://manager.example.org:8443/v1/agent/sync"
        );
        let prefixed = Url::parse("https://example.org/ongrid").unwrap();
        let client = AgentRoutes::new(&[prefixed], dir.path(), token).unwrap();
        assert_eq!(
            client.register_url.as_str(),
            "https://example.org/ongrid/v1/agent/register"
        );
    }
}
