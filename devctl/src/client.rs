//! The HTTPS client of the manager's API, presenting the user's certificate or proxy, or
//! sending the user's bearer token (`Authorization: Bearer`, no client certificate), and the
//! mapping of every failure to one line that says what to do: manager unreachable, certificate
//! or token refused, manager's certificate not trusted, or the API's own error message.
//!
//! The routes themselves are called by the command that uses them (`session`, `key`, ...), as
//! `client.get("v1/sessions").all(all).send().await`; routes and bodies are those listed in
//! `ongrid_core::api`.

use std::error::Error as StdError;
use std::path::PathBuf;
use std::time::Duration;

use chrono::{DateTime, Utc};
use ongrid_core::api::ErrorBody;
use ongrid_core::Dn;
use ongrid_service::manager_http::{Failure, Managers};
use reqwest::{Method, RequestBuilder, Url};
use rustls::{AlertDescription, CertificateError};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::config::{Credential, Settings};
use crate::credentials::{self, TlsSetupError, UserCertificate};
use crate::format::format_time;
use crate::token::{BearerToken, TokenError};
use ongrid_service::Token;

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
    #[error(transparent)]
    Token(#[from] TokenError),
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
    /// A 401 or 403 to a call with a bearer token: the manager's message, after where the
    /// token came from (`token_source`: `BEARER_TOKEN_FILE /run/user/1000/bt_u1000`).
    #[error("the manager refused the bearer token from {token_source}: {message}")]
    TokenRefused {
        token_source: String,
        status: u16,
        code: String,
        message: String,
    },
    /// The manager wants a client certificate and so takes no bearer token (it does not accept
    /// tokens, or not at this address).
    #[error("the manager at {url} asked for a client certificate and took no bearer token (from {token_source}): if the site does not accept tokens, use your certificate or proxy with --cert FILE")]
    CertificateRequired { url: String, token_source: String },
    #[error("{url} answered HTTP {status} without an ongrid error body: is it the ongrid manager? ({CONFIG_HINT})")]
    UnexpectedStatus { url: String, status: u16 },
    #[error("cannot read the manager's answer ({cause}): are devctl and the manager of the same version?")]
    BadBody { cause: String },
    #[error("request to the manager at {url} failed: {cause}")]
    Other { url: String, cause: String },
    /// Every manager that answered serves an older copy of the store than one that answered
    /// before, or another store: the sentence names the manager and what the site admins fix.
    #[error("{refusal}: ask the site admins")]
    StaleStore { refusal: String },
    /// A change reached the manager, which went away or stopped answering before it answered:
    /// it may have been made. `look` says where to look before asking again.
    #[error("the manager at {url} went away before answering ({cause}); {look}")]
    AnswerLost {
        url: String,
        cause: String,
        look: String,
    },
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
            Self::Api { code, .. } | Self::TokenRefused { code, .. } => Some(code),
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
    /// The DN of the user's certificate, or its path when it cannot be parsed; with a token,
    /// its `sub` claim (`-` when it has none).
    pub identity: String,
    /// With a bearer token, where it came from: `BEARER_TOKEN`, `BEARER_TOKEN_FILE /path`, or
    /// the path of the file found (`/run/user/1000/bt_u1000`).
    pub token_source: Option<String>,
    /// The issuer of the end-entity certificate (the user's CA), when it can be read; with a
    /// token, its `iss` claim.
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

    /// The body of a non-2xx answer as an error ([`api_error`]); with a token, a 401 or 403
    /// names where the token came from.
    pub fn refusal(&self, status: u16, body: &[u8]) -> ClientError {
        match (
            api_error(status, body, &self.manager_url),
            &self.token_source,
        ) {
            (
                ClientError::Api {
                    status,
                    code,
                    message,
                },
                Some(token_source),
            ) if status == 401 || status == 403 => ClientError::TokenRefused {
                token_source: token_source.clone(),
                status,
                code,
                message,
            },
            (other, _) => other,
        }
    }

    fn classify_tls(&self, err: &rustls::Error, now: DateTime<Utc>) -> ClientError {
        use AlertDescription as A;
        // Without a client certificate the handshake fails only when the manager wants one.
        if let (
            Some(token_source),
            rustls::Error::AlertReceived(
                A::CertificateRequired
                | A::HandshakeFailure
                | A::BadCertificate
                | A::CertificateUnknown
                | A::UnknownCA
                | A::AccessDenied,
            ),
        ) = (&self.token_source, err)
        {
            return ClientError::CertificateRequired {
                url: self.manager_url.clone(),
                token_source: token_source.clone(),
            };
        }
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

/// Everything but the unreserved characters of RFC 3986 (letters, digits, `-`, `.`, `_`, `~`).
const PATH_SEGMENT: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

/// `text` as one segment of a route's path, percent-encoded: a DN like
/// `/DC=org/CN=Alice Smith` becomes `%2FDC%3Dorg%2FCN%3DAlice%20Smith`.
pub fn path_segment(text: &str) -> String {
    percent_encoding::utf8_percent_encode(text, PATH_SEGMENT).to_string()
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

/// A client of the manager's API, presenting the user's certificate, or sending the user's
/// bearer token with every request. With several managers named (the manager's replicas), a
/// call goes to the one that answered last, and on to the next when that one cannot be reached;
/// a read also when the one it reached went away before answering. A change that reached a
/// manager is never sent to another: it may have been made ([`ClientError::AnswerLost`]).
#[derive(Debug, Clone)]
pub struct Client {
    http: reqwest::Client,
    /// Ends with `/`; the first of `managers`.
    base: String,
    /// Every manager named, and the one that answered last.
    managers: Managers,
    /// Sent as `Authorization: Bearer` with every request; `None` with a certificate.
    bearer: Option<Token>,
    context: ErrorContext,
}

impl Client {
    /// Reads the user's certificate or bearer token and the CA directory and builds the HTTPS
    /// client.
    pub fn new(settings: &Settings) -> Result<Self, ClientError> {
        let base = settings.manager_url.value.to_string();
        let mut context = ErrorContext {
            manager_url: base.trim_end_matches('/').to_owned(),
            ca_dir: settings.ca_dir.value.clone(),
            identity: String::new(),
            token_source: None,
            issuer: None,
            not_after: None,
            request_timeout: REQUEST_TIMEOUT,
        };
        let (tls, bearer) = match &settings.credential {
            Credential::Certificate(certificate) => {
                let cas = credentials::load_grid_cas(&settings.ca_dir);
                let user = UserCertificate::load(certificate, cas.as_ref(), Utc::now())?;
                // Expired, legacy and other unusable credentials are refused here, in one
                // line, rather than by a TLS alert from the manager.
                user.check(certificate)?;
                let roots = credentials::load_ca_dir(&settings.ca_dir)?;
                let tls = credentials::client_config(roots, &user, certificate)?;
                context.identity = user
                    .identity
                    .clone()
                    .unwrap_or_else(|| certificate.cert.display().to_string());
                context.issuer = user.issuer.clone();
                context.not_after = user.not_after;
                (tls, None)
            }
            Credential::Token(source) => {
                // Empty, malformed and expired tokens are refused here, naming their source.
                let token = BearerToken::load(source, Utc::now())?;
                let roots = credentials::load_ca_dir(&settings.ca_dir)?;
                context.identity = token
                    .claims
                    .subject
                    .clone()
                    .unwrap_or_else(|| "-".to_owned());
                context.issuer = token.claims.issuer.clone();
                context.not_after = token.claims.expires_at;
                context.token_source = Some(token.source.to_string());
                (credentials::token_client_config(roots)?, Some(token.token))
            }
        };
        let http = reqwest::Client::builder()
            .use_preconfigured_tls(tls)
            .https_only(true)
            .connect_timeout(CONNECT_TIMEOUT)
            .timeout(REQUEST_TIMEOUT)
            .user_agent(concat!("devctl/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|err| ClientError::Build(err.to_string()))?;
        let urls: Vec<Url> = std::iter::once(settings.manager_url.value.clone())
            .chain(settings.other_managers.iter().cloned())
            .collect();
        let managers = Managers::new(&urls).map_err(|err| ClientError::Build(err.to_string()))?;
        Ok(Self {
            http,
            base,
            managers,
            bearer,
            context,
        })
    }

    pub fn context(&self) -> &ErrorContext {
        &self.context
    }

    /// `GET {base}{path}`; `path` is relative to the manager's URL, like `v1/sessions`.
    pub fn get(&self, path: &str) -> Request<'_> {
        self.request(Method::GET, path)
    }

    /// `POST {base}{path}`
    pub fn post(&self, path: &str) -> Request<'_> {
        self.request(Method::POST, path)
    }

    /// `PUT {base}{path}`
    pub fn put(&self, path: &str) -> Request<'_> {
        self.request(Method::PUT, path)
    }

    /// `DELETE {base}{path}`
    pub fn delete(&self, path: &str) -> Request<'_> {
        self.request(Method::DELETE, path)
    }

    fn request(&self, method: Method, path: &str) -> Request<'_> {
        let change = method != Method::GET;
        let mut builder = self.http.request(method, format!("{}{path}", self.base));
        if let Some(token) = &self.bearer {
            // Marked sensitive by reqwest, so it is never printed.
            builder = builder.bearer_auth(token.expose());
        }
        Request {
            client: self,
            builder,
            lost: change.then(|| LOST_CHANGE.to_owned()),
            keyed: false,
        }
    }

    /// A client without TLS, for unit tests that only build requests.
    #[cfg(test)]
    pub(crate) fn for_building_requests(base: &str) -> Self {
        Self::for_tests(&[base])
    }

    /// A client without TLS of the managers at `bases` (each ending with `/`), for unit tests.
    #[cfg(test)]
    pub(crate) fn for_tests(bases: &[&str]) -> Self {
        let base = bases[0];
        Self {
            http: reqwest::Client::new(),
            base: base.to_owned(),
            managers: Managers::new(
                &bases
                    .iter()
                    .map(|b| Url::parse(b).expect("a URL"))
                    .collect::<Vec<_>>(),
            )
            .expect("managers"),
            bearer: None,
            context: ErrorContext {
                manager_url: base.trim_end_matches('/').to_owned(),
                ca_dir: PathBuf::new(),
                identity: String::new(),
                token_source: None,
                issuer: None,
                not_after: None,
                request_timeout: REQUEST_TIMEOUT,
            },
        }
    }
}

/// What a change whose answer was lost may have done, unless the command says it better
/// ([`Request::if_lost`]).
const LOST_CHANGE: &str =
    "what you asked may have been done: look (devctl ... ls or show) before asking again";

/// One call of the API: built with [`Client::get`] and friends, then [`Request::send`].
#[must_use = "a request does nothing until it is sent"]
pub struct Request<'a> {
    client: &'a Client,
    builder: RequestBuilder,
    /// For a change (POST, PUT, DELETE): what to look at when it reached the manager and the
    /// answer was lost.
    lost: Option<String>,
    /// The change carries an `Idempotency-Key`: the manager answers the same request sent
    /// again with what the first one made, so it may go on to another manager even after it
    /// reached one that went away.
    keyed: bool,
}

impl Request<'_> {
    /// Adds query parameters, URL-encoded (a fingerprint's base64 holds `+` and `/`, a DN
    /// spaces).
    pub fn query<T: Serialize + ?Sized>(self, query: &T) -> Self {
        Self {
            builder: self.builder.query(query),
            ..self
        }
    }

    /// `?all=true` when `all`: everybody's, not only the caller's (admins only).
    pub fn all(self, all: bool) -> Self {
        if all {
            self.query(&[("all", "true")])
        } else {
            self
        }
    }

    /// `?owner=DN` when given: another user's session or image (admins only).
    pub fn owner(self, owner: Option<&Dn>) -> Self {
        match owner {
            Some(owner) => self.query(&[("owner", owner.as_str())]),
            None => self,
        }
    }

    /// For a change: what may exist when the manager went away before answering, and the
    /// command to look at it ("the session may exist: devctl session show train1").
    pub fn if_lost(self, look: impl Into<String>) -> Self {
        Self {
            lost: self.lost.map(|_| look.into()),
            ..self
        }
    }

    /// A create the manager makes once however often it is sent (`Idempotency-Key`, a new
    /// UUID): when the manager it reached goes away before answering, it is sent again to the
    /// next manager named, which answers with what the first one made, if it made it.
    pub fn idempotent(self) -> Self {
        Self {
            builder: self
                .builder
                .header("Idempotency-Key", uuid::Uuid::new_v4().to_string()),
            keyed: true,
            ..self
        }
    }

    /// A JSON body.
    pub fn json<T: Serialize + ?Sized>(self, body: &T) -> Self {
        Self {
            builder: self.builder.json(body),
            ..self
        }
    }

    /// Sends the request and decodes a 2xx answer; anything else becomes a [`ClientError`].
    pub async fn send<T: DeserializeOwned>(self) -> Result<T, ClientError> {
        self.send_with_status().await.map(|(_, body)| body)
    }

    /// Like [`Request::send`], with the HTTP status of the successful answer.
    pub async fn send_with_status<T: DeserializeOwned>(self) -> Result<(u16, T), ClientError> {
        let context = &self.client.context;
        let lost = self.lost;
        let failed = |e: reqwest::Error| lost_answer(context.classify_reqwest(&e), lost.as_deref());
        // Not sent yet: a request that cannot be built is no lost answer.
        let request = self
            .builder
            .build()
            .map_err(|e| context.classify_reqwest(&e))?;
        // A read, or a change the manager makes once however often it is sent, may go on to
        // another manager after the one it reached went away ([`Managers::execute`]).
        let resend = lost.is_none() || self.keyed;
        let (_, response) = self
            .client
            .managers
            .execute(&self.client.http, request, resend)
            .await
            .map_err(|no_manager| match no_manager.failure {
                Failure::Transport(error) => failed(error),
                Failure::StaleStore(refusal) => ClientError::StaleStore { refusal },
            })?;
        let status = response.status();
        let body = response.bytes().await.map_err(failed)?;
        if !status.is_success() {
            return Err(context.refusal(status.as_u16(), &body));
        }
        let body = serde_json::from_slice(&body).map_err(|err| ClientError::BadBody {
            cause: err.to_string(),
        })?;
        Ok((status.as_u16(), body))
    }

    /// The request as it would be sent, for unit tests of routes and queries.
    #[cfg(test)]
    pub(crate) fn build(self) -> reqwest::Request {
        self.builder.build().unwrap()
    }
}

/// `error` of a change that reached the manager (`lost`: where to look) as
/// [`ClientError::AnswerLost`]: the manager went away or stopped answering after the request was
/// sent, so it may have been made. A change that never left (the manager unreachable, TLS
/// refused) stays what it was.
fn lost_answer(error: ClientError, lost: Option<&str>) -> ClientError {
    let Some(look) = lost else {
        return error;
    };
    match error {
        ClientError::Other { url, cause } => ClientError::AnswerLost {
            url,
            cause,
            look: look.to_owned(),
        },
        ClientError::Timeout { url, timeout } => ClientError::AnswerLost {
            url,
            cause: format!("no answer within {} s", timeout.as_secs()),
            look: look.to_owned(),
        },
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn context() -> ErrorContext {
        ErrorContext {
            manager_url: "https://manager.test.invalid:8443".to_owned(),
            ca_dir: PathBuf::from("/etc/grid-security/certificates"),
            identity: "/DC=org/DC=example/CN=Alice Smith".to_owned(),
            token_source: None,
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

    /// A manager that reads a change and closes the connection without answering (a replica
    /// killed while it creates a session): the change may have been made, and devctl says so,
    /// with where to look, instead of a transport error that reads like a failure. A read
    /// cut off the same way is a plain failure, and a change that never reached a manager is
    /// "cannot reach".
    #[tokio::test]
    async fn a_change_whose_answer_is_lost_says_it_may_have_been_made() {
        use tokio::io::AsyncReadExt;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            loop {
                let (mut stream, _) = listener.accept().await.unwrap();
                // Reads the request, then goes away.
                let mut buffer = [0u8; 4096];
                let _ = stream.read(&mut buffer).await;
                drop(stream);
            }
        });
        let client = Client::for_building_requests(&format!("http://{addr}/"));
        let err = client
            .post("v1/sessions")
            .json(&serde_json::json!({"name": "train1"}))
            .if_lost("the session may exist: devctl session show train1")
            .send::<serde_json::Value>()
            .await
            .unwrap_err();
        assert!(matches!(err, ClientError::AnswerLost { .. }), "{err:?}");
        let text = err.to_string();
        assert!(
            text.starts_with(&format!(
                "the manager at http://{addr} went away before answering ("
            )),
            "{text}"
        );
        assert!(
            text.ends_with("); the session may exist: devctl session show train1"),
            "{text}"
        );
        let err = client
            .delete("v1/sessions/train1")
            .send::<serde_json::Value>()
            .await
            .unwrap_err();
        assert!(err.to_string().ends_with(LOST_CHANGE), "{err}");
        let err = client
            .get("v1/sessions")
            .send::<serde_json::Value>()
            .await
            .unwrap_err();
        assert!(matches!(err, ClientError::Other { .. }), "{err:?}");
        server.abort();
        let _ = server.await;
        let err = client
            .post("v1/sessions")
            .if_lost("the session may exist")
            .send::<serde_json::Value>()
            .await
            .unwrap_err();
        assert!(matches!(err, ClientError::Unreachable { .. }), "{err:?}");
    }

    /// With two managers named, a call goes on to the second when the first refuses
    /// connections, and then stays with it; a read reaching a manager that goes away is asked
    /// of the other, a change is not (it may have been made there).
    #[tokio::test]
    async fn with_two_managers_a_call_goes_on_to_the_one_that_answers() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use std::sync::Arc;
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        // A manager that answers `[]` to everything, counting the requests it read.
        async fn manager(answer: bool) -> (String, Arc<AtomicUsize>, tokio::task::JoinHandle<()>) {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let base = format!("http://{}/", listener.local_addr().unwrap());
            let count = Arc::new(AtomicUsize::new(0));
            let counted = count.clone();
            let task = tokio::spawn(async move {
                loop {
                    let (mut stream, _) = listener.accept().await.unwrap();
                    let mut buffer = [0u8; 4096];
                    let _ = stream.read(&mut buffer).await;
                    counted.fetch_add(1, Ordering::SeqCst);
                    if answer {
                        let _ = stream
                            .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n[]")
                            .await;
                    }
                }
            });
            (base, count, task)
        }
        let dead = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let dead_base = format!("http://{}/", dead.local_addr().unwrap());
        drop(dead);
        let (live, live_count, _live) = manager(true).await;
        let client = Client::for_tests(&[&dead_base, &live]);
        let listed: Vec<String> = client.get("v1/sessions").send().await.unwrap();
        assert!(listed.is_empty());
        let _: Vec<String> = client.post("v1/sessions").send().await.unwrap();
        assert_eq!(live_count.load(Ordering::SeqCst), 2);
        assert_eq!(client.managers.answered_last().as_str(), live);

        let (mute, mute_count, _mute) = manager(false).await;
        let client = Client::for_tests(&[&mute, &live]);
        let err = client
            .post("v1/sessions")
            .send::<Vec<String>>()
            .await
            .unwrap_err();
        assert!(matches!(err, ClientError::AnswerLost { .. }), "{err:?}");
        assert_eq!(mute_count.load(Ordering::SeqCst), 1);
        assert_eq!(
            live_count.load(Ordering::SeqCst),
            2,
            "a change is sent once"
        );
        let _: Vec<String> = client.get("v1/sessions").send().await.unwrap();
        assert_eq!(mute_count.load(Ordering::SeqCst), 2);
        assert_eq!(live_count.load(Ordering::SeqCst), 3, "a read goes on");
        // A create with an idempotency key goes on too: the next manager answers with what
        // the first made, if it made it.
        let client = Client::for_tests(&[&mute, &live]);
        let _: Vec<String> = client
            .post("v1/sessions")
            .idempotent()
            .send()
            .await
            .unwrap();
        assert_eq!(mute_count.load(Ordering::SeqCst), 3);
        assert_eq!(
            live_count.load(Ordering::SeqCst),
            4,
            "a keyed change goes on"
        );
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

    /// With a token, the manager's 401 and 403 name where the token came from; other errors,
    /// and every error with a certificate, are the manager's message alone.
    #[test]
    fn refusals_of_a_token_name_its_source() {
        let body = br#"{"error":{"code":"unauthenticated","message":"the token expired at 2026-11-21 10:00:00Z"}}"#;
        let token = ErrorContext {
            token_source: Some("BEARER_TOKEN_FILE /run/user/1000/bt_u1000".to_owned()),
            ..context()
        };
        for status in [401, 403] {
            let err = token.refusal(status, body);
            assert_eq!(err.api_code(), Some("unauthenticated"));
            assert_eq!(
                err.to_string(),
                "the manager refused the bearer token from BEARER_TOKEN_FILE \
                 /run/user/1000/bt_u1000: the token expired at 2026-11-21 10:00:00Z"
            );
            assert_eq!(
                context().refusal(status, body).to_string(),
                "the token expired at 2026-11-21 10:00:00Z"
            );
        }
        assert!(matches!(token.refusal(404, body), ClientError::Api { .. }));
        assert!(matches!(
            token.refusal(401, b"<html>"),
            ClientError::UnexpectedStatus { .. }
        ));
    }

    /// A manager that wants a client certificate fails the handshake of a token's connection,
    /// which has none: devctl says so and names --cert, not "your certificate".
    #[test]
    fn a_manager_that_wants_a_certificate_says_so_to_a_token() {
        let token = ErrorContext {
            token_source: Some("BEARER_TOKEN".to_owned()),
            ..context()
        };
        for alert in [
            AlertDescription::CertificateRequired,
            AlertDescription::HandshakeFailure,
        ] {
            let io = wrapped(rustls::Error::AlertReceived(alert));
            assert_eq!(
                token
                    .classify(&io, true, false, before_expiry())
                    .to_string(),
                "the manager at https://manager.test.invalid:8443 asked for a client certificate \
                 and took no bearer token (from BEARER_TOKEN): if the site does not accept \
                 tokens, use your certificate or proxy with --cert FILE"
            );
        }
        // The manager's own certificate is still checked.
        let io = wrapped(rustls::Error::InvalidCertificate(
            CertificateError::UnknownIssuer,
        ));
        assert!(matches!(
            token.classify(&io, true, false, before_expiry()),
            ClientError::ServerUntrusted { .. }
        ));
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
            "cannot reach the manager at https://manager.test.invalid:8443 (connection refused): \
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
            "the manager at https://manager.test.invalid:8443 did not answer within 30 s: try \
             again, or ask the site admins to check it"
        );
    }
}
