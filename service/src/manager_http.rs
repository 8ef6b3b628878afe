//! The HTTPS client side of the manager's bearer-token routes, shared by the gateway and the
//! node agents: the one check that `manager_url` is https ([`parse_manager_url`]), a `reqwest`
//! client that trusts exactly the given CAs (no built-in roots, and HTTPS only, so the token is
//! never sent in clear text), route URLs joined under the manager's base path, and answers
//! sorted into [`HttpError`]. Each binary wraps an [`HttpError`] in its own error where it has
//! something to add for its operator (a 401 means its token is wrong).
//!
//! `manager_url` may list several managers (replicas of one PostgreSQL database, any of which
//! answers any call), as Slurm's backup controllers and HTCondor's list of central managers:
//! a call goes to the one that answered last, and to the next in the list when that one cannot
//! be reached. A request is sent to the next only when it cannot have reached the first (the
//! connection was never made), or when it is a read; a write cut off mid-way is the caller's
//! to judge, since the manager may have done it.
//!
//! Every manager's answer names the copy of the store it serves
//! ([`ongrid_core::store_identity`]); the client remembers the newest it saw and refuses, and
//! goes on past, a manager answering from an older copy (one left on the old database after a
//! restore) or from another store, in words that say which manager and what to fix. Each
//! request tells the manager what the client saw, so such a manager learns it is behind.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ongrid_core::api::ErrorBody;
use ongrid_core::store_identity::{Seen, StoreIdentity, SEEN_HEADER, STORE_HEADER};
use reqwest::header::HeaderValue;
use reqwest::{Certificate, StatusCode, Url};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::pem::CaCertificate;
use crate::Token;

/// How much of a body that is not an ongrid error is kept for the message.
const MAX_FOREIGN_BODY: usize = 200;

/// `url`'s error type, reached through reqwest's re-export of [`Url`].
pub type UrlParseError = <Url as std::str::FromStr>::Err;

/// Why `manager_url` in a config file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ManagerUrlError {
    #[error("manager_url {url:?} is not a URL, like https://ongrid.example.org:8443")]
    NotAUrl {
        url: String,
        #[source]
        source: UrlParseError,
    },
    #[error("manager_url {0:?} must use https: the token is only sent to a manager whose certificate is verified")]
    NotHttps(String),
    #[error("manager_url is an empty list: name the manager, or each of its replicas, like [\"https://m1.example.org:8443\", \"https://m2.example.org:8443\"]")]
    Empty,
}

/// `manager_url` as a config file writes it: one URL, or the URLs of the manager's replicas.
#[derive(Debug, Clone, serde::Deserialize)]
#[serde(untagged)]
pub enum ManagerUrlsFile {
    One(String),
    Several(Vec<String>),
}

/// `manager_url` from a config file, one URL or a list: each a URL, and https.
pub fn parse_manager_urls(written: &ManagerUrlsFile) -> Result<Vec<Url>, ManagerUrlError> {
    let urls = match written {
        ManagerUrlsFile::One(url) => vec![parse_manager_url(url)?],
        ManagerUrlsFile::Several(urls) => urls
            .iter()
            .map(|url| parse_manager_url(url))
            .collect::<Result<Vec<_>, _>>()?,
    };
    if urls.is_empty() {
        return Err(ManagerUrlError::Empty);
    }
    Ok(urls)
}

/// `manager_url` from a config file: a URL, and https.
pub fn parse_manager_url(text: &str) -> Result<Url, ManagerUrlError> {
    let url = Url::parse(text).map_err(|source| ManagerUrlError::NotAUrl {
        url: text.to_owned(),
        source,
    })?;
    if url.scheme() != "https" {
        return Err(ManagerUrlError::NotHttps(text.to_owned()));
    }
    Ok(url)
}

/// Why a call to the manager failed.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    #[error("CA certificate from {} is not usable by the HTTPS client", path.display())]
    BadCa {
        path: std::path::PathBuf,
        #[source]
        source: reqwest::Error,
    },
    #[error("manager_url {0} cannot be a base URL")]
    BaseUrl(String),
    #[error("building the HTTPS client")]
    Build(#[source] reqwest::Error),
    /// No manager could be reached (`url`: each one tried), or the call was cut off.
    #[error("cannot reach the manager at {url}")]
    Unreachable {
        url: String,
        #[source]
        source: reqwest::Error,
    },
    /// A non-2xx answer. `code` and `message` are the manager's [`ErrorBody`]; when the body is
    /// not one (a proxy in between, another service), `code` is `None` and `message` the start
    /// of the body.
    #[error("the manager answered {status} to {url}: {}", refusal(code.as_deref(), message))]
    Refused {
        url: String,
        status: StatusCode,
        code: Option<String>,
        message: String,
    },
    /// Every manager that answered serves an older copy of the store than one that answered
    /// before, or another store: the sentence names the manager and the fix.
    #[error("{refusal}")]
    StaleStore { refusal: String },
    #[error("the manager's answer to {url} cannot be read: are this program and the manager of the same version?")]
    BadAnswer {
        url: String,
        #[source]
        source: reqwest::Error,
    },
}

fn refusal(code: Option<&str>, message: &str) -> String {
    match code {
        Some(code) => format!("{code}: {message}"),
        None => message.to_owned(),
    }
}

impl HttpError {
    /// The status of a non-2xx answer.
    pub fn status(&self) -> Option<StatusCode> {
        match self {
            Self::Refused { status, .. } => Some(*status),
            _ => None,
        }
    }

    /// Whether the manager refused the bearer token (401 or 403).
    pub fn is_token_refused(&self) -> bool {
        matches!(
            self.status(),
            Some(StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN)
        )
    }
}

/// The client's identity and patience.
#[derive(Debug, Clone, Copy)]
pub struct ClientSettings {
    /// `ongrid-gateway/0.1.0`, ...
    pub user_agent: &'static str,
    pub connect_timeout: Duration,
    pub request_timeout: Duration,
}

/// The managers a client names: one, or each replica of one database, and the one that
/// answered last. A call goes to that one, and on to the next while one cannot be reached (see
/// the module's documentation). Shared by [`ManagerHttp`] (agents, gateway) and devctl.
#[derive(Debug, Clone)]
pub struct Managers {
    /// Each manager's base URL, ending in `/`; requests are made under the first.
    bases: Vec<Url>,
    /// The index in `bases` of the manager that answered last, shared by the clones.
    current: Arc<AtomicUsize>,
    /// The newest copy of the store an answer came from, shared by the clones.
    seen: Arc<Mutex<Seen>>,
}

/// A request no manager answered, or answered from the store seen: the URL it was sent to at
/// each manager, and why the last one did not do.
#[derive(Debug)]
pub struct NoManager {
    pub tried: Vec<Url>,
    pub failure: Failure,
}

/// Why the last manager tried did not do.
#[derive(Debug)]
pub enum Failure {
    /// It could not be reached, or the request was cut off.
    Transport(reqwest::Error),
    /// It answered from an older copy of the store, or from another store (and so did any
    /// other that answered): the sentence names it and the fix.
    StaleStore(String),
}

impl Managers {
    /// The managers at `urls` (not empty), each as a base URL ending in `/`.
    pub fn new(urls: &[Url]) -> Result<Self, HttpError> {
        let mut bases = Vec::with_capacity(urls.len());
        for url in urls {
            let mut base = url.clone();
            if base.cannot_be_a_base() {
                return Err(HttpError::BaseUrl(url.to_string()));
            }
            if !base.path().ends_with('/') {
                let path = format!("{}/", base.path());
                base.set_path(&path);
            }
            bases.push(base);
        }
        if bases.is_empty() {
            return Err(HttpError::BaseUrl("(an empty list)".to_owned()));
        }
        Ok(Self {
            bases,
            current: Arc::new(AtomicUsize::new(0)),
            seen: Arc::new(Mutex::new(Seen::default())),
        })
    }

    /// The newest copy of the store a manager answered from.
    pub fn store_seen(&self) -> Option<StoreIdentity> {
        self.seen().newest().cloned()
    }

    fn seen(&self) -> std::sync::MutexGuard<'_, Seen> {
        // A panic while holding it cannot leave a `Seen` half-written.
        self.seen
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The first manager's base URL: requests are made under it.
    pub fn first(&self) -> &Url {
        &self.bases[0]
    }

    /// The base URL of the manager that answered last (the first before any answered).
    pub fn answered_last(&self) -> &Url {
        &self.bases[self.current.load(Ordering::Relaxed) % self.bases.len()]
    }

    /// The URL of a route (`v1/agent/sync`) under the first manager's base path; a call sends
    /// it under whichever manager answers.
    pub fn url(&self, route: &str) -> Result<Url, HttpError> {
        self.bases[0]
            .join(route)
            .map_err(|_| HttpError::BaseUrl(self.bases[0].to_string()))
    }

    /// `url` (made under the first manager, possibly with a query since) under manager `i`.
    fn on(&self, i: usize, url: &Url) -> Url {
        let relative = url
            .as_str()
            .strip_prefix(self.bases[0].as_str())
            .unwrap_or(url.as_str());
        self.bases[i].join(relative).unwrap_or_else(|_| url.clone())
    }

    /// Sends `request` (made under the first manager's URL) with `http` to the manager that
    /// answered last, and on to the next while one cannot be reached; with `resend` (a read, or
    /// a change the manager makes once however often it is sent) also while the one it reached
    /// went away before answering. An answer from an older copy of the store than one seen, or
    /// from another store, is refused, and the request sent on to the next (what that manager
    /// did, it did to a copy nobody else serves). A request whose body cannot be sent twice is
    /// sent once. The answer comes with the URL it was sent to.
    pub async fn execute(
        &self,
        http: &reqwest::Client,
        request: reqwest::Request,
        resend: bool,
    ) -> Result<(Url, reqwest::Response), NoManager> {
        let count = self.bases.len();
        let first = self.current.load(Ordering::Relaxed) % count;
        let mut tried = Vec::new();
        let mut refusal = None;
        let mut next_request = Some(request);
        for k in 0..count {
            let i = (first + k) % count;
            let Some(template) = next_request.take() else {
                break;
            };
            let target = self.on(i, template.url());
            let spare = if k + 1 < count {
                template.try_clone()
            } else {
                None
            };
            let mut attempt = template;
            *attempt.url_mut() = target.clone();
            if let Some(seen) = self.store_seen() {
                if let Ok(value) = HeaderValue::from_str(&seen.to_string()) {
                    attempt.headers_mut().insert(SEEN_HEADER, value);
                }
            }
            match http.execute(attempt).await {
                Ok(response) => match self.judge_store(i, &response) {
                    Ok(()) => {
                        if i != first {
                            self.current.store(i, Ordering::Relaxed);
                            tracing::warn!(manager = %self.bases[i], unreachable = %join(&tried), "Going on with the next manager of manager_url.");
                        }
                        return Ok((target, response));
                    }
                    Err(sentence) => {
                        tracing::error!(manager = %self.bases[i], why = %sentence, "Refused an answer from an old copy of the store, or from another store.");
                        tried.push(target);
                        if spare.is_none() {
                            return Err(NoManager {
                                tried,
                                failure: Failure::StaleStore(sentence),
                            });
                        }
                        refusal = Some(sentence);
                        next_request = spare;
                    }
                },
                Err(error) => {
                    tried.push(target);
                    let next = error.is_connect() || (resend && !error.is_timeout());
                    if !next || spare.is_none() {
                        // Those that answered were refused: that is what there is to fix.
                        let failure = match refusal {
                            Some(sentence) if error.is_connect() => Failure::StaleStore(sentence),
                            _ => Failure::Transport(error),
                        };
                        return Err(NoManager { tried, failure });
                    }
                    next_request = spare;
                }
            }
        }
        unreachable!("the last manager's error returns")
    }

    /// Whether manager `i`'s answer comes from the newest copy of the store seen (remembered
    /// when newer); an answer without the header (a manager of an older release) is taken.
    fn judge_store(&self, i: usize, response: &reqwest::Response) -> Result<(), String> {
        let Some(header) = response.headers().get(STORE_HEADER) else {
            return Ok(());
        };
        let served = match header.to_str().map(str::parse::<StoreIdentity>) {
            Ok(Ok(served)) => served,
            _ => {
                tracing::warn!(manager = %self.bases[i], header = ?header, "Ignored a store identity that does not parse.");
                return Ok(());
            }
        };
        self.seen()
            .judge(&served)
            .map_err(|refused| refused.explain(self.bases[i].as_str().trim_end_matches('/')))
    }
}

/// URLs for a message: `A, nor at B`.
pub fn join(urls: &[Url]) -> String {
    urls.iter()
        .map(Url::as_str)
        .collect::<Vec<_>>()
        .join(", nor at ")
}

/// A client of the manager's bearer-token routes, at one URL or at each of its replicas'.
#[derive(Debug, Clone)]
pub struct ManagerHttp {
    http: reqwest::Client,
    managers: Managers,
    token: Token,
}

impl ManagerHttp {
    /// A client of the managers at `manager_urls` (one, or each replica; not empty) that trusts
    /// only `roots` (from [`crate::pem::load_ca_dir`]).
    pub fn new(
        manager_urls: &[Url],
        roots: &[CaCertificate],
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
            let certificate =
                Certificate::from_der(&root.der).map_err(|source| HttpError::BadCa {
                    path: root.path.clone(),
                    source,
                })?;
            builder = builder.add_root_certificate(certificate);
        }
        Ok(Self {
            http: builder.build().map_err(HttpError::Build)?,
            managers: Managers::new(manager_urls)?,
            token,
        })
    }

    /// The URL of a route (`v1/agent/sync`) under the (first) manager's base path; a call sends
    /// it under whichever manager answers.
    pub fn url(&self, route: &str) -> Result<Url, HttpError> {
        self.managers.url(route)
    }

    /// `GET url`, the answer decoded.
    pub async fn get<R: DeserializeOwned>(&self, url: &Url) -> Result<R, HttpError> {
        let response = self.send(self.http.get(url.clone()), true).await?;
        decode(url, response).await
    }

    /// `GET url` allowed to take `timeout` instead of the client's request timeout (a
    /// long-poll); a 2xx answer is returned as it is, for callers that read its status and
    /// headers.
    pub async fn get_for_response(
        &self,
        url: &Url,
        timeout: Duration,
    ) -> Result<reqwest::Response, HttpError> {
        self.send(self.http.get(url.clone()).timeout(timeout), true)
            .await
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
    /// tell its statuses apart. Sent to another manager only when it cannot have reached the
    /// first.
    pub async fn post_for_response<T: Serialize>(
        &self,
        url: &Url,
        body: &T,
    ) -> Result<reqwest::Response, HttpError> {
        self.send(self.http.post(url.clone()).json(body), false)
            .await
    }

    /// Sends with the token through [`Managers::execute`] (`resend`: a GET); a non-2xx answer
    /// becomes [`HttpError::Refused`].
    async fn send(
        &self,
        request: reqwest::RequestBuilder,
        resend: bool,
    ) -> Result<reqwest::Response, HttpError> {
        let request = request
            .bearer_auth(self.token.expose())
            .build()
            .map_err(HttpError::Build)?;
        match self.managers.execute(&self.http, request, resend).await {
            Ok((target, response)) => judge(&target, response).await,
            Err(NoManager {
                tried,
                failure: Failure::Transport(error),
            }) => Err(HttpError::Unreachable {
                url: join(&tried),
                // The URL is in our message already.
                source: error.without_url(),
            }),
            Err(NoManager {
                failure: Failure::StaleStore(refusal),
                ..
            }) => Err(HttpError::StaleStore { refusal }),
        }
    }
}

/// A manager's answer: a 2xx as it is, anything else as [`HttpError::Refused`].
async fn judge(url: &Url, response: reqwest::Response) -> Result<reqwest::Response, HttpError> {
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
    use std::io::Read;

    use super::*;

    fn client(url: &str) -> ManagerHttp {
        let settings = ClientSettings {
            user_agent: "ongrid-test/0",
            connect_timeout: Duration::from_secs(1),
            request_timeout: Duration::from_secs(1),
        };
        ManagerHttp::new(&[Url::parse(url).unwrap()], &[], Token::new("t"), settings).unwrap()
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

    #[test]
    fn manager_url_is_one_url_or_a_list_of_them() {
        #[derive(serde::Deserialize)]
        struct File {
            manager_url: ManagerUrlsFile,
        }
        let parse = |text: &str| {
            let file: File = toml::from_str(text).unwrap();
            parse_manager_urls(&file.manager_url)
        };
        let one = parse("manager_url = \"https://127.0.0.1:8443\"").unwrap();
        assert_eq!(one, [Url::parse("https://127.0.0.1:8443").unwrap()]);
        let two =
            parse("manager_url = [\"https://127.0.0.1:8443\", \"https://127.0.0.2\"]").unwrap();
        assert_eq!(two.len(), 2);
        assert_eq!(two[1].as_str(), "https://127.0.0.2/");
        let err = parse("manager_url = []").unwrap_err();
        assert!(matches!(err, ManagerUrlError::Empty), "{err:?}");
        let err = parse("manager_url = [\"https://127.0.0.1\", \"http://m2\"]").unwrap_err();
        assert!(matches!(err, ManagerUrlError::NotHttps(_)), "{err:?}");
    }

    #[test]
    fn manager_url_must_be_an_https_url() {
        let url = parse_manager_url("https://m.example.org:8443/ongrid").unwrap();
        assert_eq!(url.as_str(), "https://m.example.org:8443/ongrid");
        let err = parse_manager_url("http://m.example.org:8443").unwrap_err();
        assert!(matches!(err, ManagerUrlError::NotHttps(_)), "{err:?}");
        assert!(err.to_string().contains("must use https"), "{err}");
        let err = parse_manager_url("//m.example.org:8443").unwrap_err();
        assert!(matches!(err, ManagerUrlError::NotAUrl { .. }), "{err:?}");
    }

    /// A client handed an http URL anyway (config checks it, this is the second guard) does not
    /// even connect: a plain-HTTP listener sees nothing, so the token never travels in clear.
    #[tokio::test]
    async fn plain_http_is_never_sent() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let http = client(&format!("http://{}", listener.local_addr().unwrap()));
        let url = http.url("v1/x").unwrap();
        let err = http.get::<serde_json::Value>(&url).await.unwrap_err();
        assert!(matches!(err, HttpError::Unreachable { .. }), "{err:?}");
        // A connection the client made is queued by the kernel before the call returns.
        match listener.accept() {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => panic!("checking the listener: {e}"),
            Ok((mut stream, _)) => {
                stream.set_nonblocking(true).unwrap();
                let mut sent = [0; 1024];
                let n = stream.read(&mut sent).unwrap_or(0);
                panic!(
                    "the client connected over plain HTTP and sent {:?}",
                    String::from_utf8_lossy(&sent[..n])
                );
            }
        }
    }

    /// A manager over plain HTTP that answers `[]` to everything with `store` in its
    /// `Ongrid-Store` header and keeps the `Ongrid-Store-Seen` header of each request.
    struct FakeManager {
        base: Url,
        seen: Arc<Mutex<Vec<Option<String>>>>,
        task: tokio::task::JoinHandle<()>,
    }

    impl FakeManager {
        async fn start(store: &str) -> Self {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let base = Url::parse(&format!("http://{}/", listener.local_addr().unwrap())).unwrap();
            let seen = Arc::new(Mutex::new(Vec::new()));
            let kept = seen.clone();
            let answer = format!(
                "HTTP/1.1 200 OK\r\n{STORE_HEADER}: {store}\r\ncontent-length: 2\r\n\
                 connection: close\r\n\r\n[]"
            );
            let task = tokio::spawn(async move {
                loop {
                    let (mut stream, _) = listener.accept().await.unwrap();
                    let mut buffer = [0u8; 4096];
                    let n = stream.read(&mut buffer).await.unwrap_or(0);
                    let request = String::from_utf8_lossy(&buffer[..n]).to_lowercase();
                    let header = request.lines().find_map(|line| {
                        line.strip_prefix(&format!("{SEEN_HEADER}: "))
                            .map(str::to_owned)
                    });
                    kept.lock().unwrap().push(header);
                    stream.write_all(answer.as_bytes()).await.unwrap();
                }
            });
            Self { base, seen, task }
        }

        /// Stops listening: connections to it are refused from now on.
        async fn stop(&mut self) {
            self.task.abort();
            let _ = (&mut self.task).await;
        }
    }

    async fn call(managers: &Managers) -> Result<Url, NoManager> {
        let http = reqwest::Client::new();
        let request = http
            .get(managers.url("v1/sessions").unwrap())
            .build()
            .unwrap();
        managers
            .execute(&http, request, true)
            .await
            .map(|(url, _)| url)
    }

    /// Three replicas, the second left on an older copy of the store (generation 1; the others
    /// serve 2): once the client saw generation 2, a call that reaches the second is refused
    /// with words naming it and the fix, and goes on to the third; with only the second left,
    /// the call fails with those words. Each request after the first tells the manager what the
    /// client saw.
    #[tokio::test]
    async fn a_manager_on_an_older_copy_of_the_store_is_refused_and_passed() {
        let mut first = FakeManager::start("aa.2").await;
        let mut older = FakeManager::start("aa.1").await;
        let mut third = FakeManager::start("aa.2").await;
        let managers =
            Managers::new(&[first.base.clone(), older.base.clone(), third.base.clone()]).unwrap();
        assert_eq!(call(&managers).await.unwrap().origin(), first.base.origin());
        assert_eq!(managers.store_seen().unwrap().to_string(), "aa.2");

        first.stop().await;
        let answered = call(&managers).await.unwrap();
        assert_eq!(answered.origin(), third.base.origin());
        assert_eq!(managers.answered_last(), &third.base);
        assert_eq!(*older.seen.lock().unwrap(), [Some("aa.2".to_owned())]);
        assert_eq!(*third.seen.lock().unwrap(), [Some("aa.2".to_owned())]);

        third.stop().await;
        let err = call(&managers).await.unwrap_err();
        let Failure::StaleStore(sentence) = &err.failure else {
            panic!("{err:?}");
        };
        let older_name = older.base.as_str().trim_end_matches('/');
        assert_eq!(
            sentence,
            &format!(
                "manager {older_name} serves an older copy of the store (generation 1, others \
                 serve 2): its `database` setting was missed after a restore; fix its \
                 manager.toml and restart it"
            )
        );
        assert_eq!(err.tried.len(), 3, "{:?}", err.tried);
        older.stop().await;
    }

    /// A manager serving another store than the one the client saw is refused, and a newer
    /// generation of the same store is taken and remembered.
    #[tokio::test]
    async fn a_manager_of_another_store_is_refused_and_a_newer_copy_taken() {
        let mut first = FakeManager::start("aa.2").await;
        let mut other = FakeManager::start("bb.9").await;
        let mut newer = FakeManager::start("aa.3").await;
        let managers = Managers::new(&[first.base.clone(), other.base.clone()]).unwrap();
        call(&managers).await.unwrap();
        first.stop().await;
        let err = call(&managers).await.unwrap_err();
        assert!(
            matches!(&err.failure, Failure::StaleStore(s) if s.contains("serves another store (id bb, others serve aa)")),
            "{err:?}"
        );
        let managers = Managers::new(&[newer.base.clone(), other.base.clone()]).unwrap();
        *managers.seen() = {
            let mut seen = Seen::default();
            seen.judge(&"aa.2".parse().unwrap()).unwrap();
            seen
        };
        call(&managers).await.unwrap();
        assert_eq!(managers.store_seen().unwrap().to_string(), "aa.3");
        other.stop().await;
        newer.stop().await;
    }

    #[test]
    fn a_refusal_carries_the_managers_code_and_message() {
        let refused = |status, code: Option<&str>| HttpError::Refused {
            url: "https://m/v1/x".to_owned(),
            status,
            code: code.map(str::to_owned),
            message: "unknown token".to_owned(),
        };
        let err = refused(StatusCode::UNAUTHORIZED, Some("unauthenticated"));
        assert_eq!(
            err.to_string(),
            "the manager answered 401 Unauthorized to https://m/v1/x: unauthenticated: unknown token"
        );
        assert!(err.is_token_refused());
        let err = refused(StatusCode::BAD_GATEWAY, None);
        assert!(err
            .to_string()
            .ends_with("to https://m/v1/x: unknown token"));
        assert!(!err.is_token_refused());
        assert_eq!(err.status(), Some(StatusCode::BAD_GATEWAY));
    }
}
