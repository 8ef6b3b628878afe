//! The gateway's side of the manager's API (`core/src/api.rs`, gateway routes): the allowlist,
//! whose key a public key is, which session an SSH user name reaches, and connection events for
//! the audit log (answered with the session's deadlines). HTTPS only, trusting exactly the CAs of `ca_dir`, with the gateway's token as
//! `Authorization: Bearer`. A refusal carries the manager's message, which is written for the
//! user and shown to them as it is.

use std::time::Duration;

use ongrid_core::api::{
    Allowlist, ConnectionEvent, ErrorBody, KeyCheck, KeyOwner, Route, RouteRequest,
};
use ongrid_core::lifecycle::SessionDeadlines;
use reqwest::{StatusCode, Url};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::config::Token;
use crate::tls::CaCertificate;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// Why a call to the manager failed.
#[derive(Debug, thiserror::Error)]
pub enum ManagerError {
    #[error("CA certificate from {path} is not usable by the HTTPS client")]
    BadCa {
        path: std::path::PathBuf,
        #[source]
        source: reqwest::Error,
    },
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
    #[error("the manager answered {status} to {url}: {code}: {message}{hint}")]
    Refused {
        url: String,
        status: StatusCode,
        code: String,
        /// The manager's words, for the user.
        message: String,
        /// What the operator should do, when the status says.
        hint: &'static str,
    },
    #[error("the manager's answer to {url} is not what this gateway understands: are both the same version?")]
    BadAnswer {
        url: String,
        #[source]
        source: reqwest::Error,
    },
}

impl ManagerError {
    /// The manager's own message when it refused the request (4xx): meant for the user.
    pub fn refusal(&self) -> Option<&str> {
        match self {
            ManagerError::Refused {
                status, message, ..
            } if status.is_client_error() => Some(message),
            _ => None,
        }
    }
}

/// An HTTPS client of the manager's gateway routes.
#[derive(Debug, Clone)]
pub struct ManagerClient {
    http: reqwest::Client,
    allowlist_url: Url,
    authorize_url: Url,
    route_url: Url,
    connections_url: Url,
    token: Token,
}

impl ManagerClient {
    /// A client of the manager at `manager_url` that trusts only `roots`.
    pub fn new(
        manager_url: &Url,
        roots: &[CaCertificate],
        token: Token,
    ) -> Result<Self, ManagerError> {
        let mut builder = reqwest::Client::builder()
            .use_rustls_tls()
            .tls_built_in_root_certs(false)
            .https_only(true)
            .connect_timeout(CONNECT_TIMEOUT)
            .timeout(REQUEST_TIMEOUT)
            .user_agent(concat!("ongrid-gateway/", env!("CARGO_PKG_VERSION")));
        for root in roots {
            let certificate = reqwest::Certificate::from_der(&root.der).map_err(|source| {
                ManagerError::BadCa {
                    path: root.path.clone(),
                    source,
                }
            })?;
            builder = builder.add_root_certificate(certificate);
        }
        let http = builder.build().map_err(ManagerError::Build)?;
        let mut base = manager_url.clone();
        if !base.path().ends_with('/') {
            let path = format!("{}/", base.path());
            base.set_path(&path);
        }
        let join = |path| {
            base.join(path)
                .map_err(|_| ManagerError::BaseUrl(manager_url.to_string()))
        };
        Ok(Self {
            http,
            allowlist_url: join("v1/gateway/allowlist")?,
            authorize_url: join("v1/gateway/authorize")?,
            route_url: join("v1/gateway/route")?,
            connections_url: join("v1/gateway/connections")?,
            token,
        })
    }

    pub async fn allowlist(&self) -> Result<Allowlist, ManagerError> {
        let request = self.http.get(self.allowlist_url.clone());
        let response = self.send(&self.allowlist_url, request).await?;
        decode(&self.allowlist_url, response).await
    }

    pub async fn authorize(&self, check: &KeyCheck) -> Result<KeyOwner, ManagerError> {
        self.post(&self.authorize_url, check).await
    }

    pub async fn route(&self, request: &RouteRequest) -> Result<Route, ManagerError> {
        self.post(&self.route_url, request).await
    }

    /// Reports a connection event; the answer is the session's deadlines, or `None` when the
    /// manager gives none: an older manager (204), a session that is gone (404), or an answer
    /// this gateway cannot read (logged).
    pub async fn connection_event(
        &self,
        event: &ConnectionEvent,
    ) -> Result<Option<SessionDeadlines>, ManagerError> {
        let request = self.http.post(self.connections_url.clone()).json(event);
        let response = match self.send(&self.connections_url, request).await {
            Ok(response) => response,
            Err(ManagerError::Refused { status, .. }) if status == StatusCode::NOT_FOUND => {
                tracing::debug!(connection = %event.connection_id, session = %event.session_id, "The manager knows the session no more; no deadlines.");
                return Ok(None);
            }
            Err(error) => return Err(error),
        };
        if response.status() != StatusCode::OK {
            return Ok(None);
        }
        match decode::<SessionDeadlines>(&self.connections_url, response).await {
            Ok(deadlines) => Ok(Some(deadlines)),
            Err(error) => {
                tracing::warn!(error = format!("{:#}", anyhow::Error::from(error)), "The manager's answer to a connection event has no deadlines this gateway understands; no banner or warning.");
                Ok(None)
            }
        }
    }

    async fn post<T: Serialize, R: DeserializeOwned>(
        &self,
        url: &Url,
        body: &T,
    ) -> Result<R, ManagerError> {
        let request = self.http.post(url.clone()).json(body);
        let response = self.send(url, request).await?;
        decode(url, response).await
    }

    /// Sends with the token; a non-2xx answer becomes [`ManagerError::Refused`].
    async fn send(
        &self,
        url: &Url,
        request: reqwest::RequestBuilder,
    ) -> Result<reqwest::Response, ManagerError> {
        let response = request
            .bearer_auth(self.token.expose())
            .send()
            .await
            .map_err(|source| ManagerError::Unreachable {
                url: url.to_string(),
                // The URL is in our message already.
                source: source.without_url(),
            })?;
        let status = response.status();
        if status.is_success() {
            return Ok(response);
        }
        let text = response.text().await.unwrap_or_default();
        let (code, message) = match serde_json::from_str::<ErrorBody>(&text) {
            Ok(body) => (body.error.code, body.error.message),
            Err(_) => (status.as_str().to_owned(), text.chars().take(200).collect()),
        };
        let hint = match status {
            StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN if url != &self.authorize_url => {
                " (check that token_file holds the token of the manager's gateway_token_file)"
            }
            _ => "",
        };
        Err(ManagerError::Refused {
            url: url.to_string(),
            status,
            code,
            message,
            hint,
        })
    }
}

async fn decode<R: DeserializeOwned>(
    url: &Url,
    response: reqwest::Response,
) -> Result<R, ManagerError> {
    response
        .json()
        .await
        .map_err(|source| ManagerError::BadAnswer {
            url: url.to_string(),
            source: source.without_url(),
        })
}
