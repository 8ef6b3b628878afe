//! The manager's HTTPS API as devctl calls it (routes and bodies are those of
//! `ongrid_core::api`), and the mapping of every failure to one line that says what to do:
//! manager unreachable, certificate refused, manager's certificate not trusted, or the API's own
//! error message.

use std::error::Error as StdError;
use std::path::PathBuf;
use std::time::Duration;

use chrono::{DateTime, SecondsFormat, Utc};
use ongrid_core::api::{
    AddKey, AuditRecord, CreateSession, ErrorBody, GpuView, Institute, KeyView, NodeView,
    SessionView, SetGpuMode, WhoAmI,
};
use ongrid_core::{Dn, GpuMode, GpuUuid, InstituteName, SessionName};
use reqwest::RequestBuilder;
use rustls::{AlertDescription, CertificateError};
use serde::de::DeserializeOwned;

use crate::config::Settings;
use crate::output::format_time;
use crate::tls::{self, TlsSetupError, UserCertificate};

/// How long to wait for the TCP connection and TLS handshake.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long to wait for a whole request.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

const CONFIG_HINT: &str = "set ONGRID_MANAGER_URL or manager_url in ~/.config/ongrid/devctl.toml";

/// A failed call, as one line for a person.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClientError {
    #[error(transparent)]
    Setup(#[from] TlsSetupError),
    #[error("cannot set up the HTTPS client: {0}")]
    Build(String),
    #[error("cannot reach the manager at {url} ({cause}): is it running? ({CONFIG_HINT})")]
    Unreachable { url: String, cause: String },
    #[error("the manager does not trust the CA of your certificate {identity} (issuer {issuer}): the manager reads its CAs from its ca_dir (IGTF layout, usually /etc/grid-security/certificates); use a certificate from a CA the site trusts, or ask the site admins to install yours")]
    UnknownCa { identity: String, issuer: String },
    #[error("the manager refused your certificate {identity}: its CA has revoked it: ask your CA for a new certificate")]
    Revoked { identity: String },
    #[error("the manager refused your certificate {identity}: {}", refusal_hint(*expired_at))]
    CertificateRefused {
        identity: String,
        /// When the certificate had already expired at the time of the call.
        expired_at: Option<DateTime<Utc>>,
    },
    #[error("cannot verify the manager's certificate against CA dir {} ({problem}): set X509_CERT_DIR", ca_dir.display())]
    ServerUntrusted { ca_dir: PathBuf, problem: String },
    #[error("the manager's certificate is not valid for the host in {url}: use the host name it was issued for ({CONFIG_HINT})")]
    WrongHost { url: String },
    #[error("TLS with {url} failed ({cause}): is that the ongrid manager's https address? ({CONFIG_HINT})")]
    Tls { url: String, cause: String },
    #[error("the manager at {url} did not answer within {} s: try again, or ask the site admins to check it", timeout.as_secs())]
    Timeout { url: String, timeout: Duration },
    /// The API's [`ErrorBody`]: its message names the fix.
    #[error("{message}")]
    Api {
        status: u16,
        code: String,
        message: String,
    },
    #[error("{url} answered HTTP {status} without an ongrid error body: is it the ongrid manager? ({CONFIG_HINT})")]
    UnexpectedStatus { url: String, status: u16 },
    #[error("cannot read the manager's answer ({cause}): are devctl and the manager of the same version?")]
    BadBody { cause: String },
    #[error("request to the manager at {url} failed: {cause}")]
    Other { url: String, cause: String },
}

fn refusal_hint(expired_at: Option<DateTime<Utc>>) -> String {
    match expired_at {
        Some(at) => format!(
            "it expired at {}: run voms-proxy-init (or grid-proxy-init) for a new proxy",
            format_time(at)
        ),
        None => "is it issued by a CA the site trusts, and still valid?".to_owned(),
    }
}

impl ClientError {
    /// The API error code (`not_found`, `unsatisfiable`, ...), for an API error.
    pub fn api_code(&self) -> Option<&str> {
        match self {
            Self::Api { code, .. } => Some(code),
            _ => None,
        }
    }
}

/// What an error message needs to know about this client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ErrorContext {
    /// The manager's URL as the user wrote it (no trailing `/`).
    pub manager_url: String,
    pub ca_dir: PathBuf,
    /// The DN of the user's certificate, or its path when it cannot be parsed.
    pub identity: String,
    /// The issuer of the end-entity certificate (the user's CA), when it can be read.
    pub issuer: Option<String>,
    pub not_after: Option<DateTime<Utc>>,
    pub request_timeout: Duration,
}

impl ErrorContext {
    fn classify_reqwest(&self, err: &reqwest::Error) -> ClientError {
        self.classify(err, err.is_connect(), err.is_timeout(), Utc::now())
    }

    /// Maps a failed request (`err` and its causes) to the error to show.
    pub fn classify(
        &self,
        err: &(dyn StdError + 'static),
        connect: bool,
        timeout: bool,
        now: DateTime<Utc>,
    ) -> ClientError {
        let url = self.manager_url.clone();
        let causes = causes(err);
        if let Some(tls) = causes
            .iter()
            .find_map(|e| e.downcast_ref::<rustls::Error>())
        {
            return self.classify_tls(tls, now);
        }
        let deepest = causes.last().map(|e| e.to_string()).unwrap_or_default();
        let refused = causes.iter().any(|e| {
            e.downcast_ref::<std::io::Error>()
                .is_some_and(|io| io.kind() == std::io::ErrorKind::ConnectionRefused)
        });
        if connect {
            let cause = if refused {
                "connection refused".to_owned()
            } else if timeout {
                format!("no answer within {} s", CONNECT_TIMEOUT.as_secs())
            } else {
                deepest
            };
            return ClientError::Unreachable { url, cause };
        }
        if timeout {
            return ClientError::Timeout {
                url,
                timeout: self.request_timeout,
            };
        }
        ClientError::Other {
            url,
            cause: deepest,
        }
    }

    fn classify_tls(&self, err: &rustls::Error, now: DateTime<Utc>) -> ClientError {
        use AlertDescription as A;
        match err {
            rustls::Error::AlertReceived(A::UnknownCA) if self.issuer.is_some() => {
                ClientError::UnknownCa {
                    identity: self.identity.clone(),
                    issuer: self.issuer.clone().unwrap_or_default(),
                }
            }
            rustls::Error::AlertReceived(A::CertificateRevoked) => ClientError::Revoked {
                identity: self.identity.clone(),
            },
            rustls::Error::AlertReceived(
                A::BadCertificate
                | A::UnsupportedCertificate
                | A::CertificateExpired
                | A::CertificateUnknown
                | A::UnknownCA
                | A::AccessDenied
                | A::CertificateRequired
                | A::HandshakeFailure
                | A::DecryptError,
            ) => ClientError::CertificateRefused {
                identity: self.identity.clone(),
                expired_at: self.not_after.filter(|at| *at <= now),
            },
            rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            ) => ClientError::WrongHost {
                url: self.manager_url.clone(),
            },
            rustls::Error::InvalidCertificate(problem) => ClientError::ServerUntrusted {
                ca_dir: self.ca_dir.clone(),
                problem: certificate_problem(problem),
            },
            other => ClientError::Tls {
                url: self.manager_url.clone(),
                cause: other.to_string(),
            },
        }
    }
}

fn certificate_problem(problem: &CertificateError) -> String {
    match problem {
        CertificateError::UnknownIssuer => "issued by a CA that is not in it".to_owned(),
        CertificateError::Expired | CertificateError::ExpiredContext { .. } => {
            "it has expired".to_owned()
        }
        CertificateError::NotValidYet | CertificateError::NotValidYetContext { .. } => {
            "it is not valid yet: check this machine's clock".to_owned()
        }
        CertificateError::Revoked => "it has been revoked".to_owned(),
        CertificateError::BadSignature => "its signature does not verify".to_owned(),
        other => format!("{other:?}"),
    }
}

/// `err` and all its causes, outermost first. An `io::Error` wrapping another error (as
/// tokio-rustls and hyper wrap `rustls::Error`) hides it from `source()`, so it is unwrapped
/// with `get_ref()`.
fn causes<'a>(err: &'a (dyn StdError + 'static)) -> Vec<&'a (dyn StdError + 'static)> {
    let mut out = Vec::new();
    let mut next = Some(err);
    while let Some(current) = next {
        out.push(current);
        let inner = current
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
            .map(|inner| inner as &(dyn StdError + 'static));
        next = inner.or_else(|| current.source());
        if out.len() > 32 {
            break;
        }
    }
    out
}

/// The body of a non-2xx answer as an error: the API's message, or a note that the answer is
/// not from an ongrid manager.
pub fn api_error(status: u16, body: &[u8], manager_url: &str) -> ClientError {
    match serde_json::from_slice::<ErrorBody>(body) {
        Ok(body) => ClientError::Api {
            status,
            code: body.error.code,
            message: body.error.message,
        },
        Err(_) => ClientError::UnexpectedStatus {
            url: manager_url.to_owned(),
            status,
        },
    }
}

/// A client of the manager's API, presenting the user's certificate.
#[derive(Debug, Clone)]
pub struct Client {
    http: reqwest::Client,
    /// Ends with `/`.
    base: String,
    context: ErrorContext,
}

impl Client {
    /// Reads the user's certificate and the CA directory and builds the HTTPS client.
    pub fn new(settings: &Settings) -> Result<Self, ClientError> {
        let cas = tls::load_grid_cas(&settings.ca_dir);
        let user = UserCertificate::load(&settings.credentials, cas.as_ref(), Utc::now())?;
        // Expired, legacy and other unusable credentials are refused here, in one line, rather
        // than by a TLS alert from the manager.
        user.check(&settings.credentials)?;
        let roots = tls::load_ca_dir(&settings.ca_dir)?;
        let tls = tls::client_config(roots, &user, &settings.credentials)?;
        let http = reqwest::Client::builder()
            .use_preconfigured_tls(tls)
            .https_only(true)
            .connect_timeout(CONNECT_TIMEOUT)
            .timeout(REQUEST_TIMEOUT)
            .user_agent(concat!("devctl/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|err| ClientError::Build(err.to_string()))?;
        let base = settings.manager_url.value.to_string();
        let context = ErrorContext {
            manager_url: base.trim_end_matches('/').to_owned(),
            ca_dir: settings.ca_dir.value.clone(),
            identity: user
                .identity
                .clone()
                .unwrap_or_else(|| settings.credentials.cert.display().to_string()),
            issuer: user.issuer.clone(),
            not_after: user.not_after,
            request_timeout: REQUEST_TIMEOUT,
        };
        Ok(Self {
            http,
            base,
            context,
        })
    }

    pub fn context(&self) -> &ErrorContext {
        &self.context
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    async fn send<T: DeserializeOwned>(&self, request: RequestBuilder) -> Result<T, ClientError> {
        self.send_with_status(request).await.map(|(_, body)| body)
    }

    /// Like `send`, with the HTTP status of a successful answer.
    async fn send_with_status<T: DeserializeOwned>(
        &self,
        request: RequestBuilder,
    ) -> Result<(u16, T), ClientError> {
        let response = request
            .send()
            .await
            .map_err(|e| self.context.classify_reqwest(&e))?;
        let status = response.status();
        let body = response
            .bytes()
            .await
            .map_err(|e| self.context.classify_reqwest(&e))?;
        if !status.is_success() {
            return Err(api_error(status.as_u16(), &body, &self.context.manager_url));
        }
        let body = serde_json::from_slice(&body).map_err(|err| ClientError::BadBody {
            cause: err.to_string(),
        })?;
        Ok((status.as_u16(), body))
    }

    /// `GET /v1/whoami`
    pub async fn whoami(&self) -> Result<WhoAmI, ClientError> {
        self.send(self.http.get(self.url("v1/whoami"))).await
    }

    /// `POST /v1/sessions`
    pub async fn create_session(&self, body: &CreateSession) -> Result<SessionView, ClientError> {
        self.send(self.http.post(self.url("v1/sessions")).json(body))
            .await
    }

    /// `GET /v1/sessions[?all=true]`
    pub async fn sessions(&self, all: bool) -> Result<Vec<SessionView>, ClientError> {
        let mut request = self.http.get(self.url("v1/sessions"));
        if all {
            request = request.query(&[("all", "true")]);
        }
        self.send(request).await
    }

    /// `GET /v1/sessions/{name}[?owner=DN]`
    pub async fn session(
        &self,
        name: &SessionName,
        owner: Option<&Dn>,
    ) -> Result<SessionView, ClientError> {
        let request = self.http.get(self.url(&format!("v1/sessions/{name}")));
        self.send(with_owner(request, owner)).await
    }

    /// `DELETE /v1/sessions/{name}[?owner=DN]`
    pub async fn remove_session(
        &self,
        name: &SessionName,
        owner: Option<&Dn>,
    ) -> Result<SessionView, ClientError> {
        let request = self.http.delete(self.url(&format!("v1/sessions/{name}")));
        self.send(with_owner(request, owner)).await
    }

    /// `POST /v1/sessions/{name}/hold[?owner=DN]`
    pub async fn hold_session(
        &self,
        name: &SessionName,
        owner: Option<&Dn>,
        body: &ongrid_core::lifecycle::HoldRequest,
    ) -> Result<SessionView, ClientError> {
        let request = self
            .http
            .post(self.url(&format!("v1/sessions/{name}/hold")));
        self.send(with_owner(request, owner).json(body)).await
    }

    /// `POST /v1/sessions/{name}/release[?owner=DN]`
    pub async fn release_session(
        &self,
        name: &SessionName,
        owner: Option<&Dn>,
    ) -> Result<SessionView, ClientError> {
        let request = self
            .http
            .post(self.url(&format!("v1/sessions/{name}/release")));
        self.send(with_owner(request, owner)).await
    }

    /// `POST /v1/sessions/{name}/keep[?owner=DN]`
    pub async fn keep_session(
        &self,
        name: &SessionName,
        owner: Option<&Dn>,
        body: &ongrid_core::lifecycle::KeepRequest,
    ) -> Result<SessionView, ClientError> {
        let request = self
            .http
            .post(self.url(&format!("v1/sessions/{name}/keep")));
        self.send(with_owner(request, owner).json(body)).await
    }

    /// `GET /v1/nodes`
    pub async fn nodes(&self) -> Result<Vec<NodeView>, ClientError> {
        self.send(self.http.get(self.url("v1/nodes"))).await
    }

    /// `PUT /v1/gpus/{uuid}/mode`
    pub async fn set_gpu_mode(&self, gpu: &GpuUuid, mode: GpuMode) -> Result<GpuView, ClientError> {
        let request = self
            .http
            .put(self.url(&format!("v1/gpus/{gpu}/mode")))
            .json(&SetGpuMode { mode });
        self.send(request).await
    }

    /// `POST /v1/keys`
    pub async fn add_key(&self, body: &AddKey) -> Result<(KeyAdded, KeyView), ClientError> {
        let (status, key) = self
            .send_with_status(self.http.post(self.url("v1/keys")).json(body))
            .await?;
        let added = if status == 201 {
            KeyAdded::New
        } else {
            KeyAdded::Renewed
        };
        Ok((added, key))
    }

    /// `GET /v1/keys[?all=true]`
    pub async fn keys(&self, all: bool) -> Result<Vec<KeyView>, ClientError> {
        let mut request = self.http.get(self.url("v1/keys"));
        if all {
            request = request.query(&[("all", "true")]);
        }
        self.send(request).await
    }

    /// `DELETE /v1/keys?fingerprint=SHA256:...` (the fingerprint URL-encoded: its base64 holds
    /// `+` and `/`)
    pub async fn remove_key(&self, fingerprint: &str) -> Result<KeyView, ClientError> {
        self.send(remove_key_request(&self.http, &self.base, fingerprint))
            .await
    }

    /// `GET /v1/institutes`
    pub async fn institutes(&self) -> Result<Vec<Institute>, ClientError> {
        self.send(self.http.get(self.url("v1/institutes"))).await
    }

    /// `GET /v1/institutes/{name}`
    pub async fn institute(&self, name: &InstituteName) -> Result<Institute, ClientError> {
        self.send(self.http.get(self.url(&format!("v1/institutes/{name}"))))
            .await
    }

    /// `POST /v1/institutes`
    pub async fn add_institute(&self, body: &Institute) -> Result<Institute, ClientError> {
        self.send(self.http.post(self.url("v1/institutes")).json(body))
            .await
    }

    /// `DELETE /v1/institutes/{name}`
    pub async fn remove_institute(&self, name: &InstituteName) -> Result<Institute, ClientError> {
        self.send(self.http.delete(self.url(&format!("v1/institutes/{name}"))))
            .await
    }

    /// `GET /v1/audit[?user=DN][&since=RFC3339]`
    pub async fn audit(
        &self,
        user: Option<&Dn>,
        since: Option<DateTime<Utc>>,
    ) -> Result<Vec<AuditRecord>, ClientError> {
        let request = self
            .http
            .get(self.url("v1/audit"))
            .query(&audit_query(user, since));
        self.send(request).await
    }
}

/// Frozen images (`devctl freeze`, `devctl image ...`).
impl Client {
    /// `POST /v1/images`
    pub async fn create_image(
        &self,
        body: &ongrid_core::image::CreateImage,
    ) -> Result<ongrid_core::image::ImageView, ClientError> {
        self.send(self.http.post(self.url("v1/images")).json(body))
            .await
    }

    /// `GET /v1/images[?all=true]`
    pub async fn images(
        &self,
        all: bool,
    ) -> Result<Vec<ongrid_core::image::ImageView>, ClientError> {
        let mut request = self.http.get(self.url("v1/images"));
        if all {
            request = request.query(&[("all", "true")]);
        }
        self.send(request).await
    }

    /// `GET /v1/images/{name:version | sha256:hex}[?owner=DN]`
    pub async fn image(
        &self,
        reference: &str,
        owner: Option<&Dn>,
    ) -> Result<ongrid_core::image::ImageView, ClientError> {
        let request = self.http.get(self.url(&format!("v1/images/{reference}")));
        self.send(with_owner(request, owner)).await
    }

    /// `DELETE /v1/images/{name:version | sha256:hex}[?owner=DN]`
    pub async fn remove_image(
        &self,
        reference: &str,
        owner: Option<&Dn>,
    ) -> Result<ongrid_core::image::ImageView, ClientError> {
        let request = self
            .http
            .delete(self.url(&format!("v1/images/{reference}")));
        self.send(with_owner(request, owner)).await
    }
}

fn remove_key_request(http: &reqwest::Client, base: &str, fingerprint: &str) -> RequestBuilder {
    http.delete(format!("{base}v1/keys"))
        .query(&[("fingerprint", fingerprint)])
}

/// What `POST /v1/keys` did with the key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyAdded {
    /// 201: the key is new.
    New,
    /// 200: the key was already the caller's; its expiry now follows the presented certificate.
    Renewed,
}

/// The query of `GET /v1/audit`: `user=DN`, `since=RFC 3339` (to the second, `Z`).
pub fn audit_query(user: Option<&Dn>, since: Option<DateTime<Utc>>) -> Vec<(&'static str, String)> {
    let mut query = Vec::new();
    if let Some(user) = user {
        query.push(("user", user.as_str().to_owned()));
    }
    if let Some(since) = since {
        query.push(("since", since.to_rfc3339_opts(SecondsFormat::Secs, true)));
    }
    query
}

fn with_owner(request: RequestBuilder, owner: Option<&Dn>) -> RequestBuilder {
    match owner {
        Some(owner) => request.query(&[("owner", owner.as_str())]),
        None => request,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn context() -> ErrorContext {
        ErrorContext {
            manager_url: "https://manager.example.org:8443".to_owned(),
            ca_dir: PathBuf::from("/etc/grid-security/certificates"),
            identity: "/DC=org/DC=example/CN=Alice Smith".to_owned(),
            issuer: None,
            not_after: DateTime::from_timestamp(1_800_000_000, 0),
            request_timeout: REQUEST_TIMEOUT,
        }
    }

    fn before_expiry() -> DateTime<Utc> {
        DateTime::from_timestamp(1_700_000_000, 0).unwrap()
    }

    /// How tokio-rustls hands a TLS failure up: an `io::Error` wrapping the `rustls::Error`.
    fn wrapped(err: rustls::Error) -> std::io::Error {
        std::io::Error::new(std::io::ErrorKind::InvalidData, err)
    }

    #[test]
    fn error_bodies_become_their_message() {
        let body = br#"{"error":{"code":"unsatisfiable","message":"no GPU in this site has compute capability 9.0 or more (the best is 8.0): ask for --min-capability 8.0 or less"}}"#;
        let err = api_error(422, body, "https://m");
        assert_eq!(err.api_code(), Some("unsatisfiable"));
        assert_eq!(
            err.to_string(),
            "no GPU in this site has compute capability 9.0 or more (the best is 8.0): ask for \
             --min-capability 8.0 or less"
        );
        let err = api_error(
            404,
            br#"{"error":{"code":"not_found","message":"no session train1"}}"#,
            "https://m",
        );
        assert_eq!(
            err,
            ClientError::Api {
                status: 404,
                code: "not_found".into(),
                message: "no session train1".into()
            }
        );
    }

    #[test]
    fn other_bodies_say_it_may_not_be_the_manager() {
        let err = api_error(502, b"<html>Bad Gateway</html>", "https://m:8443");
        assert_eq!(
            err.to_string(),
            "https://m:8443 answered HTTP 502 without an ongrid error body: is it the ongrid \
             manager? (set ONGRID_MANAGER_URL or manager_url in ~/.config/ongrid/devctl.toml)"
        );
    }

    #[test]
    fn refused_connections_are_unreachable() {
        let io = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        let err = context().classify(&io, true, false, before_expiry());
        assert_eq!(
            err.to_string(),
            "cannot reach the manager at https://manager.example.org:8443 (connection refused): \
             is it running? (set ONGRID_MANAGER_URL or manager_url in \
             ~/.config/ongrid/devctl.toml)"
        );
    }

    #[test]
    fn alerts_about_the_client_certificate_name_it() {
        for alert in [
            AlertDescription::UnknownCA,
            AlertDescription::BadCertificate,
        ] {
            let io = wrapped(rustls::Error::AlertReceived(alert));
            // The alert may come during the handshake (connect) or on the first read (TLS 1.3).
            for connect in [true, false] {
                let err = context().classify(&io, connect, false, before_expiry());
                assert_eq!(
                    err.to_string(),
                    "the manager refused your certificate /DC=org/DC=example/CN=Alice Smith: is \
                     it issued by a CA the site trusts, and still valid?"
                );
            }
        }
    }

    #[test]
    fn an_unknown_ca_names_the_issuer_and_a_revocation_says_so() {
        let io = wrapped(rustls::Error::AlertReceived(AlertDescription::UnknownCA));
        let context = ErrorContext {
            issuer: Some("/DC=org/DC=example/CN=Example CA".to_owned()),
            ..context()
        };
        assert_eq!(
            context
                .classify(&io, true, false, before_expiry())
                .to_string(),
            "the manager does not trust the CA of your certificate \
             /DC=org/DC=example/CN=Alice Smith (issuer /DC=org/DC=example/CN=Example CA): the \
             manager reads its CAs from its ca_dir (IGTF layout, usually \
             /etc/grid-security/certificates); use a certificate from a CA the site trusts, or \
             ask the site admins to install yours"
        );
        let io = wrapped(rustls::Error::AlertReceived(
            AlertDescription::CertificateRevoked,
        ));
        assert_eq!(
            context
                .classify(&io, false, false, before_expiry())
                .to_string(),
            "the manager refused your certificate /DC=org/DC=example/CN=Alice Smith: its CA has \
             revoked it: ask your CA for a new certificate"
        );
    }

    #[test]
    fn an_expired_certificate_says_so() {
        let io = wrapped(rustls::Error::AlertReceived(
            AlertDescription::CertificateExpired,
        ));
        let after = DateTime::from_timestamp(1_900_000_000, 0).unwrap();
        let err = context().classify(&io, false, false, after);
        assert_eq!(
            err.to_string(),
            "the manager refused your certificate /DC=org/DC=example/CN=Alice Smith: it expired \
             at 2027-01-15 08:00:00Z: run voms-proxy-init (or grid-proxy-init) for a new proxy"
        );
    }

    #[test]
    fn untrusted_server_certificates_name_the_ca_dir() {
        let io = wrapped(rustls::Error::InvalidCertificate(
            CertificateError::UnknownIssuer,
        ));
        let err = context().classify(&io, true, false, before_expiry());
        assert_eq!(
            err.to_string(),
            "cannot verify the manager's certificate against CA dir \
             /etc/grid-security/certificates (issued by a CA that is not in it): set X509_CERT_DIR"
        );
        let io = wrapped(rustls::Error::InvalidCertificate(
            CertificateError::NotValidForName,
        ));
        let err = context().classify(&io, true, false, before_expiry());
        assert!(matches!(err, ClientError::WrongHost { .. }), "{err}");
    }

    #[test]
    fn slow_answers_time_out() {
        let io = std::io::Error::from(std::io::ErrorKind::TimedOut);
        let err = context().classify(&io, false, true, before_expiry());
        assert_eq!(
            err.to_string(),
            "the manager at https://manager.example.org:8443 did not answer within 30 s: try \
             again, or ask the site admins to check it"
        );
    }

    #[test]
    fn fingerprints_are_url_encoded() {
        let http = reqwest::Client::builder().build().unwrap();
        let request =
            remove_key_request(&http, "https://manager.example.org:8443/", "SHA256:ab+c/d=")
                .build()
                .unwrap();
        assert_eq!(request.method(), reqwest::Method::DELETE);
        assert_eq!(
            request.url().as_str(),
            "https://manager.example.org:8443/v1/keys?fingerprint=SHA256%3Aab%2Bc%2Fd%3D"
        );
    }

    #[test]
    fn audit_filters_become_the_query() {
        assert!(audit_query(None, None).is_empty());
        let user = Dn::parse("/DC=org/DC=example/CN=Alice Smith").unwrap();
        let since = DateTime::from_timestamp(1_795_255_200, 0);
        assert_eq!(
            audit_query(Some(&user), since),
            vec![
                ("user", "/DC=org/DC=example/CN=Alice Smith".to_owned()),
                ("since", "2026-11-21T10:00:00Z".to_owned()),
            ]
        );
    }
}
