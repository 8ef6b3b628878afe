//! The HTTPS client side of the manager's bearer-token routes, shared by the gateway and the
//! node agents: a `reqwest` client that trusts exactly the given CAs (no built-in roots, HTTPS
//! only), route URLs joined under the manager's base path, and answers sorted into
//! [`HttpError`]. Each binary turns an [`HttpError`] into its own error, adding what its
//! operator should do.

use std::time::Duration;

use ongrid_core::api::ErrorBody;
use reqwest::{Certificate, StatusCode, Url};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::Token;

/// How much of a body that is not an ongrid error is kept for the message.
const MAX_FOREIGN_BODY: usize = 200;

/// Why a call to the manager failed.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
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
    /// A non-2xx answer. `code` and `message` are the manager's [`ErrorBody`]; when the body is
    /// not one (a proxy in between, another service), `code` is `None` and `message` the start
    /// of the body.
    #[error("the manager answered {status} to {url}")]
    Refused {
        url: String,
        status: StatusCode,
        code: Option<String>,
        message: String,
    },
    #[error("the manager's answer to {url} cannot be read")]
    BadAnswer {
        url: String,
        #[source]
        source: reqwest::Error,
    },
}

/// The client's identity and patience.
#[derive(Debug, Clone, Copy)]
pub struct ClientSettings {
    /// `ongrid-gateway/0.1.0`, ...
    pub user_agent: &'static str,
    pub connect_timeout: Duration,
    pub request_timeout: Duration,
}

/// A client of one manager's bearer-token routes.
#[derive(Debug, Clone)]
pub struct ManagerHttp {
    http: reqwest::Client,
    base: Url,
    manager_url: String,
    token: Token,
}

impl ManagerHttp {
    /// A client of the manager at `manager_url` that trusts only `roots`.
    pub fn new(
        manager_url: &Url,
        roots: Vec<Certificate>,
        token: Token,
        settings: ClientSettings,
    ) -> Result<Self, HttpError> {
        let mut builder = reqwest::Client::builder()
            .use_rustls_tls()
            .tls_built_in_root_certs(false)
            .https_only(true)
            .connect_timeout(settings.connect_timeout)
            .timeout(settings.request_timeout)
            .user_agent(settings.user_agent);
        for root in roots {
            builder = builder.add_root_certificate(root);
        }
        let http = builder.build().map_err(HttpError::Build)?;
        let mut base = manager_url.clone();
        if !base.path().ends_with('/') {
            let path = format!("{}/", base.path());
            base.set_path(&path);
        }
        Ok(Self {
            http,
            base,
            manager_url: manager_url.to_string(),
            token,
        })
    }

    /// The URL of a route (`v1/agent/sync`) under the manager's base path.
    pub fn url(&self, route: &str) -> Result<Url, HttpError> {
        self.base
            .join(route)
            .map_err(|_| HttpError::BaseUrl(self.manager_url.clone()))
    }

    /// `GET url`, the answer decoded.
    pub async fn get<R: DeserializeOwned>(&self, url: &Url) -> Result<R, HttpError> {
        let response = self.send(url, self.http.get(url.clone())).await?;
        decode(url, response).await
    }

    /// `POST url` with `body` as JSON, the answer decoded.
    pub async fn post<T: Serialize, R: DeserializeOwned>(
        &self,
        url: &Url,
        body: &T,
    ) -> Result<R, HttpError> {
        let response = self.post_for_response(url, body).await?;
        decode(url, response).await
    }

    /// `POST url` with `body` as JSON; a 2xx answer is returned as it is, for callers that
    /// tell its statuses apart.
    pub async fn post_for_response<T: Serialize>(
        &self,
        url: &Url,
        body: &T,
    ) -> Result<reqwest::Response, HttpError> {
        self.send(url, self.http.post(url.clone()).json(body)).await
    }

    /// Sends with the token; a non-2xx answer becomes [`HttpError::Refused`].
    async fn send(
        &self,
        url: &Url,
        request: reqwest::RequestBuilder,
    ) -> Result<reqwest::Response, HttpError> {
        let response = request
            .bearer_auth(self.token.expose())
            .send()
            .await
            .map_err(|source| HttpError::Unreachable {
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
            Ok(body) => (Some(body.error.code), body.error.message),
            Err(_) => (None, text.chars().take(MAX_FOREIGN_BODY).collect()),
        };
        Err(HttpError::Refused {
            url: url.to_string(),
            status,
            code,
            message,
        })
    }
}

/// A 2xx answer's body as `R`.
pub async fn decode<R: DeserializeOwned>(
    url: &Url,
    response: reqwest::Response,
) -> Result<R, HttpError> {
    response
        .json()
        .await
        .map_err(|source| HttpError::BadAnswer {
            url: url.to_string(),
            source: source.without_url(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn client(url: &str) -> ManagerHttp {
        let settings = ClientSettings {
            user_agent: "ongrid-test/0",
            connect_timeout: Duration::from_secs(1),
            request_timeout: Duration::from_secs(1),
        };
        ManagerHttp::new(
            &Url::parse(url).unwrap(),
            Vec::new(),
            Token::new("t"),
            settings,
        )
        .unwrap()
    }

    #[test]
    fn routes_are_joined_under_the_base_path() {
        assert_eq!(
            client("https://m.example.org:8443")
                .url("v1/x")
                .unwrap()
                .as_str(),
            "https://m.example.org:8443/v1/x"
        );
        assert_eq!(
            client("https://example.org/ongrid")
                .url("v1/x")
                .unwrap()
                .as_str(),
            "https://example.org/ongrid/v1/x"
        );
    }

    #[tokio::test]
    async fn plain_http_is_never_sent() {
        let http = client("http://127.0.0.1:1");
        let url = http.url("v1/x").unwrap();
        let err = http.get::<serde_json::Value>(&url).await.unwrap_err();
        assert!(matches!(err, HttpError::Unreachable { .. }), "{err:?}");
    }
}
