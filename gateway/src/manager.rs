//! The gateway's side of the manager's API (`core/src/api.rs`, gateway routes): the allowlist,
//! whose key a public key is, which session an SSH user name reaches, and connection events for
//! the audit log (answered with the session's deadlines). HTTPS only, trusting exactly the CAs of `ca_dir`, with the gateway's token as
//! `Authorization: Bearer`. A refusal carries the manager's message, which is written for the
//! user and shown to them as it is.

use std::time::Duration;

use ongrid_core::api::{Allowlist, ConnectionEvent, KeyCheck, KeyOwner, Route, RouteRequest};
use ongrid_core::lifecycle::SessionDeadlines;
use ongrid_service::manager_http::{self, ClientSettings, HttpError, ManagerHttp};
use reqwest::{StatusCode, Url};

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
    http: ManagerHttp,
    allowlist_url: Url,
    authorize_url: Url,
    route_url: Url,
    connections_url: Url,
}

impl ManagerClient {
    /// A client of the manager at `manager_url` that trusts only `roots`.
    pub fn new(
        manager_url: &Url,
        roots: &[CaCertificate],
        token: Token,
    ) -> Result<Self, ManagerError> {
        let roots = roots
            .iter()
            .map(|root| {
                reqwest::Certificate::from_der(&root.der).map_err(|source| ManagerError::BadCa {
                    path: root.path.clone(),
                    source,
                })
            })
            .collect::<Result<_, _>>()?;
        let settings = ClientSettings {
            user_agent: concat!("ongrid-gateway/", env!("CARGO_PKG_VERSION")),
            connect_timeout: CONNECT_TIMEOUT,
            request_timeout: REQUEST_TIMEOUT,
        };
        let http = ManagerHttp::new(manager_url, roots, token, settings)
            .map_err(|e| ManagerError::from_http(e, false))?;
        let url = |route| {
            http.url(route)
                .map_err(|e| ManagerError::from_http(e, false))
        };
        Ok(Self {
            allowlist_url: url("v1/gateway/allowlist")?,
            authorize_url: url("v1/gateway/authorize")?,
            route_url: url("v1/gateway/route")?,
            connections_url: url("v1/gateway/connections")?,
            http,
        })
    }

    pub async fn allowlist(&self) -> Result<Allowlist, ManagerError> {
        self.http
            .get(&self.allowlist_url)
            .await
            .map_err(|e| self.error(e, &self.allowlist_url))
    }

    pub async fn authorize(&self, check: &KeyCheck) -> Result<KeyOwner, ManagerError> {
        self.http
            .post(&self.authorize_url, check)
            .await
            .map_err(|e| self.error(e, &self.authorize_url))
    }

    pub async fn route(&self, request: &RouteRequest) -> Result<Route, ManagerError> {
        self.http
            .post(&self.route_url, request)
            .await
            .map_err(|e| self.error(e, &self.route_url))
    }

    /// Reports a connection event; the answer is the session's deadlines, or `None` when the
    /// manager gives none: an older manager (204), a session that is gone (404), or an answer
    /// this gateway cannot read (logged).
    pub async fn connection_event(
        &self,
        event: &ConnectionEvent,
    ) -> Result<Option<SessionDeadlines>, ManagerError> {
        let url = &self.connections_url;
        let response = match self.http.post_for_response(url, event).await {
            Ok(response) => response,
            Err(HttpError::Refused { status, .. }) if status == StatusCode::NOT_FOUND => {
                tracing::debug!(connection = %event.connection_id, session = %event.session_id, "The manager knows the session no more; no deadlines.");
                return Ok(None);
            }
            Err(error) => return Err(self.error(error, url)),
        };
        if response.status() != StatusCode::OK {
            return Ok(None);
        }
        match manager_http::decode::<SessionDeadlines>(url, response).await {
            Ok(deadlines) => Ok(Some(deadlines)),
            Err(error) => {
                let error = self.error(error, url);
                tracing::warn!(error = format!("{:#}", anyhow::Error::from(error)), "The manager's answer to a connection event has no deadlines this gateway understands; no banner or warning.");
                Ok(None)
            }
        }
    }

    /// A failed call to `url` as this gateway reports it. A refused authorization is the
    /// user's business; any other 401/403 means the gateway's own token is wrong.
    fn error(&self, error: HttpError, url: &Url) -> ManagerError {
        ManagerError::from_http(error, url != &self.authorize_url)
    }
}

impl ManagerError {
    fn from_http(error: HttpError, token_hint: bool) -> Self {
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
                    StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN if token_hint => {
                        " (check that token_file holds the token of the manager's gateway_token_file)"
                    }
                    _ => "",
                };
                Self::Refused {
                    url,
                    code: code.unwrap_or_else(|| status.as_str().to_owned()),
                    status,
                    message,
                    hint,
                }
            }
            HttpError::BadAnswer { url, source } => Self::BadAnswer { url, source },
        }
    }
}
