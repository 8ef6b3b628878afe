//! The gateway's side of the manager's API (`core/src/api.rs`, gateway routes): the allowlist,
//! whose key a public key is, which session an SSH user name reaches, connection events for
//! the audit log (answered with the session's deadlines), and which keys of open connections
//! were revoked. HTTPS only, trusting exactly the CAs
//! of `ca_dir`, with the gateway's token as
//! `Authorization: Bearer`. A refusal carries the manager's message, which is written for the
//! user and shown to them as it is.

use std::time::Duration;

use ongrid_core::api::{
    Allowlist, ConnectionEvent, HeldKeys, KeyCheck, KeyOwner, RevokedKeys, Route, RouteRequest,
};
use ongrid_core::holds::SessionDeadlines;
use ongrid_service::manager_http::{self, ClientSettings, HttpError, ManagerHttp};
use reqwest::{StatusCode, Url};

use crate::config::Token;
use ongrid_service::ca_roots::CaCertificate;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// Why a call to the manager failed.
#[derive(Debug, thiserror::Error)]
pub enum ManagerError {
    #[error(transparent)]
    Http(#[from] HttpError),
    /// A 401 or 403 on a route that only the gateway's token opens.
    #[error(
        "the manager refused the gateway's token: check that token_file holds the token of the manager's gateway_token_file"
    )]
    TokenRefused(#[source] HttpError),
}

impl ManagerError {
    /// The manager's own message when it refused the request (4xx): meant for the user.
    pub fn refusal(&self) -> Option<&str> {
        let (Self::Http(error) | Self::TokenRefused(error)) = self;
        match error {
            HttpError::Refused {
                status, message, ..
            } if status.is_client_error() => Some(message),
            _ => None,
        }
    }
}

/// An HTTPS client of the manager's gateway routes.
#[derive(Debug, Clone)]
pub struct GatewayRoutes {
    http: ManagerHttp,
    allowlist_url: Url,
    authorize_url: Url,
    route_url: Url,
    connections_url: Url,
    keys_check_url: Url,
}

impl GatewayRoutes {
    /// A client of the manager at `manager_urls` (or of each of its replicas there) that trusts
    /// only `roots`.
    pub fn new(
        manager_urls: &[Url],
        roots: &[CaCertificate],
        token: Token,
    ) -> Result<Self, ManagerError> {
        let settings = ClientSettings {
            user_agent: concat!("ongrid-gateway/", env!("CARGO_PKG_VERSION")),
            connect_timeout: CONNECT_TIMEOUT,
            request_timeout: REQUEST_TIMEOUT,
        };
        let http = ManagerHttp::new(manager_urls, roots, token, settings)?;
        let url = |route| http.url(route);
        Ok(Self {
            allowlist_url: url("v1/gateway/allowlist")?,
            authorize_url: url("v1/gateway/authorize")?,
            route_url: url("v1/gateway/route")?,
            connections_url: url("v1/gateway/connections")?,
            keys_check_url: url("v1/gateway/keys/check")?,
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

    /// Which of `held` (the keys of open connections) were removed or expired since.
    pub async fn check_keys(&self, held: &HeldKeys) -> Result<RevokedKeys, ManagerError> {
        self.http
            .post(&self.keys_check_url, held)
            .await
            .map_err(|e| self.error(e, &self.keys_check_url))
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
                tracing::warn!(
                    error = format!("{:#}", anyhow::Error::from(error)),
                    "The manager's answer to a connection event has no deadlines this gateway understands; no banner or warning."
                );
                Ok(None)
            }
        }
    }

    /// A failed call to `url` as this gateway reports it. A refused authorization is the
    /// user's business; any other 401/403 means the gateway's own token is wrong.
    fn error(&self, error: HttpError, url: &Url) -> ManagerError {
        if url != &self.authorize_url && error.is_token_refused() {
            ManagerError::TokenRefused(error)
        } else {
            ManagerError::Http(error)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(status: StatusCode) -> HttpError {
        HttpError::Refused {
            url: "https://m/v1/gateway/x".to_owned(),
            status,
            code: Some("unauthenticated".to_owned()),
            message: "key SHA256:x is not registered: add it with `devctl key add`".to_owned(),
        }
    }

    fn client() -> GatewayRoutes {
        let url = Url::parse("https://m.example.org:8443").unwrap();
        GatewayRoutes::new(&[url], &[], Token::new("t")).unwrap()
    }

    #[test]
    fn a_refused_token_names_token_file_except_on_authorize() {
        let client = client();
        let error = client.error(refused(StatusCode::UNAUTHORIZED), &client.allowlist_url);
        assert!(matches!(error, ManagerError::TokenRefused(_)), "{error:?}");
        let text = format!("{:#}", anyhow::Error::from(error));
        assert!(text.contains("token_file"), "{text}");
        assert!(text.contains("401 Unauthorized"), "{text}");

        let error = client.error(refused(StatusCode::UNAUTHORIZED), &client.authorize_url);
        assert!(matches!(error, ManagerError::Http(_)), "{error:?}");
        assert!(!error.to_string().contains("token_file"), "{error}");
    }

    #[test]
    fn only_a_4xx_is_a_refusal_for_the_user() {
        let client = client();
        let error = client.error(refused(StatusCode::UNAUTHORIZED), &client.authorize_url);
        assert_eq!(
            error.refusal(),
            Some("key SHA256:x is not registered: add it with `devctl key add`")
        );
        let error = client.error(refused(StatusCode::FORBIDDEN), &client.route_url);
        assert!(error.refusal().is_some());
        let error = client.error(refused(StatusCode::BAD_GATEWAY), &client.route_url);
        assert_eq!(error.refusal(), None);
    }
}
