//! The world around a gateway under test: a throwaway PKI, a fake manager (axum over TLS) that
//! answers the gateway routes from tables the test controls, a fake node agent speaking the
//! stream protocol over TLS WebSockets (its "processes" are tiny scripted behaviours), and the
//! real OpenSSH client with a generated key.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Json, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use futures::{SinkExt, StreamExt};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use ongrid_core::api::{
    Allowlist, ConnectionEvent, ErrorBody, ErrorDetail, HeldKeys, KeyCheck, KeyOwner, Revocation,
    RevokedKey, RevokedKeys, Route, RouteRequest,
};
use ongrid_core::holds::{PlannedHold, SessionDeadlines};
use ongrid_core::stream::{ExitStatus, Frame, StreamKind, StreamOpen};
use ongrid_core::{
    Cidr, Dn, Institute, InstituteName, NodeName, SessionId, SessionName, SessionState, UserName,
};
use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair, KeyUsagePurpose, SanType};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use tokio_rustls::TlsAcceptor;
use tokio_tungstenite::tungstenite::handshake::server::{
    ErrorResponse, Request as WsRequest, Response as WsResponse,
};
use tokio_tungstenite::tungstenite::Message;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

pub const GATEWAY_TOKEN: &str = "gateway-test-token";
pub const ALICE_DN: &str = "/DC=org/DC=example/CN=Alice";

/// A CA and one server certificate for 127.0.0.1, as a TLS acceptor; the CA in `ca_dir`.
pub struct Pki {
    pub ca_dir: PathBuf,
    pub acceptor: TlsAcceptor,
}

impl Pki {
    pub fn new(dir: &Path) -> Self {
        let ca_dir = dir.join("certificates");
        std::fs::create_dir_all(&ca_dir).unwrap();
        let ca_key = KeyPair::generate().unwrap();
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let ca = ca_params.self_signed(&ca_key).unwrap();
        std::fs::write(ca_dir.join("testca.0"), ca.pem()).unwrap();
        // Not a certificate: must be skipped, not refused.
        std::fs::write(ca_dir.join("testca.signing_policy"), "access_id_CA X509").unwrap();

        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(vec!["localhost".to_owned()]).unwrap();
        params
            .subject_alt_names
            .push(SanType::IpAddress("127.0.0.1".parse().unwrap()));
        let cert = params.signed_by(&key, &ca, &ca_key).unwrap();
        let config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(
            vec![CertificateDer::from(cert.der().to_vec())],
            PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
        )
        .unwrap();
        Self {
            ca_dir,
            acceptor: TlsAcceptor::from(Arc::new(config)),
        }
    }
}

/// The answer to a route request: the route, or the status and message of a refusal.
pub type RouteAnswer = Result<Route, (StatusCode, String)>;

/// What the fake manager answers, and what it was told.
#[derive(Default)]
pub struct ManagerState {
    pub allowlist: Mutex<Allowlist>,
    /// "algorithm base64" of registered keys → owner.
    pub keys: Mutex<HashMap<String, KeyOwner>>,
    /// Refusals for particular keys ("algorithm base64" → message).
    pub refused_keys: Mutex<HashMap<String, String>>,
    /// SSH user name → the route, or the refusal (status, message).
    pub routes: Mutex<HashMap<String, RouteAnswer>>,
    pub events: Mutex<Vec<ConnectionEvent>>,
    /// The answer to connection events: these deadlines (200), or 204 like an older manager.
    pub deadlines: Mutex<Option<SessionDeadlines>>,
    pub authorize_calls: Mutex<Vec<KeyCheck>>,
    pub allowlist_fetches: std::sync::atomic::AtomicUsize,
}

impl ManagerState {
    pub fn allow(&self, entries: &[(&str, &[&str])]) {
        *self.allowlist.lock().unwrap() = Allowlist {
            institutes: entries
                .iter()
                .map(|(name, cidrs)| Institute {
                    name: InstituteName::parse(name).unwrap(),
                    cidrs: cidrs.iter().map(|c| Cidr::parse(c).unwrap()).collect(),
                })
                .collect(),
        };
    }

    pub fn events(&self) -> Vec<ConnectionEvent> {
        self.events.lock().unwrap().clone()
    }

    /// Plans a hold (or none) in the deadlines answered from now on.
    pub fn plan_hold(&self, hold: Option<PlannedHold>) {
        if let Some(deadlines) = self.deadlines.lock().unwrap().as_mut() {
            deadlines.next_hold = hold;
        }
    }
}

/// "ssh-ed25519 AAAA..." without the comment.
pub fn key_id(openssh: &str) -> String {
    openssh
        .split_whitespace()
        .take(2)
        .collect::<Vec<_>>()
        .join(" ")
}

fn error(status: StatusCode, code: &str, message: &str) -> Response {
    (
        status,
        Json(ErrorBody {
            error: ErrorDetail {
                code: code.to_owned(),
                message: message.to_owned(),
            },
        }),
    )
        .into_response()
}

fn authorized(headers: &HeaderMap) -> bool {
    headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v == format!("Bearer {GATEWAY_TOKEN}"))
}

async fn allowlist(State(state): State<Arc<ManagerState>>, headers: HeaderMap) -> Response {
    if !authorized(&headers) {
        return error(
            StatusCode::UNAUTHORIZED,
            "unauthenticated",
            "wrong gateway token",
        );
    }
    state
        .allowlist_fetches
        .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    Json(state.allowlist.lock().unwrap().clone()).into_response()
}

async fn authorize(
    State(state): State<Arc<ManagerState>>,
    headers: HeaderMap,
    Json(check): Json<KeyCheck>,
) -> Response {
    if !authorized(&headers) {
        return error(
            StatusCode::UNAUTHORIZED,
            "unauthenticated",
            "wrong gateway token",
        );
    }
    state.authorize_calls.lock().unwrap().push(check.clone());
    let id = key_id(&check.public_key);
    if let Some(message) = state.refused_keys.lock().unwrap().get(&id) {
        return error(StatusCode::UNAUTHORIZED, "unauthenticated", message);
    }
    match state.keys.lock().unwrap().get(&id) {
        Some(owner) => Json(owner.clone()).into_response(),
        None => error(
            StatusCode::UNAUTHORIZED,
            "unauthenticated",
            "this SSH key is not registered: add it with `devctl key add ~/.ssh/id_ed25519.pub`",
        ),
    }
}

async fn route(
    State(state): State<Arc<ManagerState>>,
    headers: HeaderMap,
    Json(request): Json<RouteRequest>,
) -> Response {
    if !authorized(&headers) {
        return error(
            StatusCode::UNAUTHORIZED,
            "unauthenticated",
            "wrong gateway token",
        );
    }
    match state.routes.lock().unwrap().get(&request.target) {
        Some(Ok(route)) => Json(route.clone()).into_response(),
        Some(Err((status, message))) => error(*status, "conflict", message),
        None => error(
            StatusCode::NOT_FOUND,
            "not_found",
            &format!("no session named {}: see devctl session ls", request.target),
        ),
    }
}

async fn connections(
    State(state): State<Arc<ManagerState>>,
    headers: HeaderMap,
    Json(event): Json<ConnectionEvent>,
) -> Response {
    if !authorized(&headers) {
        return error(
            StatusCode::UNAUTHORIZED,
            "unauthenticated",
            "wrong gateway token",
        );
    }
    state.events.lock().unwrap().push(event);
    match state.deadlines.lock().unwrap().clone() {
        Some(deadlines) => Json(deadlines).into_response(),
        None => StatusCode::NO_CONTENT.into_response(),
    }
}

/// Like the manager: a held key is revoked unless a registered key has its fingerprint and
/// owner (then it is "removed"; expiry is the manager's business, tested there).
async fn check_keys(
    State(state): State<Arc<ManagerState>>,
    headers: HeaderMap,
    Json(held): Json<HeldKeys>,
) -> Response {
    if !authorized(&headers) {
        return error(
            StatusCode::UNAUTHORIZED,
            "unauthenticated",
            "wrong gateway token",
        );
    }
    let keys = state.keys.lock().unwrap();
    let revoked = held
        .keys
        .into_iter()
        .filter(|key| {
            !keys
                .values()
                .any(|k| k.fingerprint == key.fingerprint && k.owner == key.owner)
        })
        .map(|key| {
            let message = format!(
                "your SSH key {} was removed: run `devctl key add` to register a key again",
                key.fingerprint
            );
            RevokedKey {
                key,
                why: Revocation::Removed,
                at: chrono::Utc::now(),
                message,
            }
        })
        .collect();
    Json(RevokedKeys { revoked }).into_response()
}

/// Serves the fake manager's gateway routes over TLS; returns its address.
pub async fn start_manager(acceptor: TlsAcceptor, state: Arc<ManagerState>) -> SocketAddr {
    let router = Router::new()
        .route("/v1/gateway/allowlist", get(allowlist))
        .route("/v1/gateway/authorize", post(authorize))
        .route("/v1/gateway/route", post(route))
        .route("/v1/gateway/connections", post(connections))
        .route("/v1/gateway/keys/check", post(check_keys))
        .with_state(state);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                continue;
            };
            let acceptor = acceptor.clone();
            let router = router.clone();
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let service =
                    hyper::service::service_fn(move |request: hyper::Request<Incoming>| {
                        router.clone().oneshot(request)
                    });
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(tls), service)
                    .await;
            });
        }
    });
    address
}

/// The fake node agent: what it was asked to open.
#[derive(Default)]
pub struct AgentState {
    pub opens: Mutex<Vec<StreamOpen>>,
}

/// Serves the fake agent's stream endpoint over TLS; returns its `wss://` base URL.
pub async fn start_agent(acceptor: TlsAcceptor, state: Arc<AgentState>) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                continue;
            };
            let acceptor = acceptor.clone();
            let state = state.clone();
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(tcp).await else {
                    return;
                };
                #[allow(clippy::result_large_err)] // tungstenite's callback signature
                let check = |request: &WsRequest, response: WsResponse| {
                    let bearer = request
                        .headers()
                        .get("authorization")
                        .and_then(|v| v.to_str().ok());
                    if request.uri().path() != "/v1/streams"
                        || bearer != Some(&format!("Bearer {GATEWAY_TOKEN}"))
                    {
                        let mut refusal = ErrorResponse::new(Some("bad token or path".to_owned()));
                        *refusal.status_mut() = StatusCode::UNAUTHORIZED;
                        return Err(refusal);
                    }
                    Ok(response)
                };
                let Ok(ws) = tokio_tungstenite::accept_hdr_async(tls, check).await else {
                    return;
                };
                serve_stream(ws, state).await;
            });
        }
    });
    format!("wss://127.0.0.1:{}", address.port())
}

type AgentWs = tokio_tungstenite::WebSocketStream<tokio_rustls::server::TlsStream<TcpStream>>;

async fn send(ws: &mut AgentWs, frame: Frame) {
    let _ = ws.send(Message::binary(frame.encode())).await;
}

async fn next_frame(ws: &mut AgentWs) -> Option<Frame> {
    loop {
        match ws.next().await? {
            Ok(Message::Binary(bytes)) => return Frame::decode(&bytes).ok(),
            Ok(Message::Close(_)) | Err(_) => return None,
            Ok(_) => continue,
        }
    }
}

/// stdout's EOF, the exit status, then a proper close: the gateway's last frames are read, so
/// the socket never resets under data still on its way.
async fn finish(ws: &mut AgentWs, status: ExitStatus) {
    send(ws, Frame::Eof).await;
    send(ws, Frame::Exit(status)).await;
    let _ = ws.close(None).await;
    let _ = tokio::time::timeout(Duration::from_secs(5), async {
        while let Some(Ok(_)) = ws.next().await {}
    })
    .await;
}

/// One stream: the `StreamOpen`, then a scripted "process" chosen by the command.
async fn serve_stream(mut ws: AgentWs, state: Arc<AgentState>) {
    let open: StreamOpen = match ws.next().await {
        Some(Ok(Message::Text(text))) => serde_json::from_str(&text).unwrap(),
        _ => return,
    };
    state.opens.lock().unwrap().push(open.clone());
    let (command, pty) = match &open.kind {
        StreamKind::Exec { command, pty } => (command.clone(), pty.clone()),
        StreamKind::Shell { pty } => ("cat".to_owned(), pty.clone()),
        StreamKind::Subsystem { .. } => ("cat".to_owned(), None),
        StreamKind::DirectTcpip { host, port } => {
            return forward(ws, host, *port).await;
        }
    };
    let (verb, argument) = command.split_once(' ').unwrap_or((&command, ""));
    match verb {
        "refuse" => {
            send(&mut ws, Frame::Error(argument.to_owned())).await;
            let _ = ws.close(None).await;
            while let Some(Ok(_)) = ws.next().await {}
            return;
        }
        _ => send(&mut ws, Frame::Ready).await,
    }
    match verb {
        "exit" => {
            let code = argument.parse().unwrap_or(0);
            finish(&mut ws, ExitStatus::Code { code }).await;
        }
        "fail" => {
            let (code, text) = argument.split_once(' ').unwrap_or((argument, ""));
            send(&mut ws, Frame::Data(b"out\n".to_vec())).await;
            send(&mut ws, Frame::Stderr(format!("{text}\n").into_bytes())).await;
            finish(
                &mut ws,
                ExitStatus::Code {
                    code: code.parse().unwrap_or(1),
                },
            )
            .await;
        }
        "kill" => {
            finish(
                &mut ws,
                ExitStatus::Signal {
                    signal: argument.to_owned(),
                    core_dumped: false,
                },
            )
            .await;
        }
        "count" => {
            let mut total = 0usize;
            while let Some(frame) = next_frame(&mut ws).await {
                match frame {
                    Frame::Data(data) => total += data.len(),
                    Frame::Eof => break,
                    _ => {}
                }
            }
            send(&mut ws, Frame::Data(format!("{total}\n").into_bytes())).await;
            finish(&mut ws, ExitStatus::Code { code: 0 }).await;
        }
        "big" => {
            let mut left: usize = argument.parse().unwrap_or(0);
            while left > 0 {
                let n = left.min(64 * 1024);
                send(&mut ws, Frame::Data(vec![b'x'; n])).await;
                left -= n;
            }
            finish(&mut ws, ExitStatus::Code { code: 0 }).await;
        }
        "env" => {
            let mut text = match &pty {
                Some(pty) => format!("pty={} {}x{}\n", pty.term, pty.cols, pty.rows),
                None => "pty=none\n".to_owned(),
            };
            for (name, value) in &open.env {
                text.push_str(&format!("{name}={value}\n"));
            }
            send(&mut ws, Frame::Data(text.into_bytes())).await;
            finish(&mut ws, ExitStatus::Code { code: 0 }).await;
        }
        // "cat" and anything else: stdin back on stdout until EOF.
        _ => {
            while let Some(frame) = next_frame(&mut ws).await {
                match frame {
                    Frame::Data(data) => send(&mut ws, Frame::Data(data)).await,
                    Frame::Eof => {
                        finish(&mut ws, ExitStatus::Code { code: 0 }).await;
                        return;
                    }
                    _ => {}
                }
            }
        }
    }
}

/// `direct-tcpip`: connects to host:port (here, the test's own listeners) and relays.
async fn forward(mut ws: AgentWs, host: &str, port: u16) {
    let tcp = match TcpStream::connect((host, port)).await {
        Ok(tcp) => tcp,
        Err(e) => {
            send(
                &mut ws,
                Frame::Error(format!(
                    "connecting to {host}:{port} in the container failed: {e}"
                )),
            )
            .await;
            let _ = ws.close(None).await;
            return;
        }
    };
    send(&mut ws, Frame::Ready).await;
    let (mut tcp_read, mut tcp_write) = tcp.into_split();
    let (mut sink, mut source) = ws.split();
    let to_tcp = async move {
        while let Some(Ok(message)) = source.next().await {
            let Message::Binary(bytes) = message else {
                continue;
            };
            match Frame::decode(&bytes) {
                Ok(Frame::Data(data)) if tcp_write.write_all(&data).await.is_err() => break,
                Ok(Frame::Eof) => {
                    let _ = tcp_write.shutdown().await;
                }
                _ => {}
            }
        }
    };
    let from_tcp = async move {
        let mut buffer = vec![0u8; 32 * 1024];
        loop {
            match tcp_read.read(&mut buffer).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if sink
                        .send(Message::binary(Frame::Data(buffer[..n].to_vec()).encode()))
                        .await
                        .is_err()
                    {
                        return;
                    }
                }
            }
        }
        let _ = sink.send(Message::binary(Frame::Eof.encode())).await;
        let _ = sink.close().await;
    };
    tokio::join!(to_tcp, from_tcp);
}

/// A user's SSH key made by `ssh-keygen`.
pub struct SshKey {
    pub path: PathBuf,
    pub public: String,
}

impl SshKey {
    pub fn generate(dir: &Path, name: &str) -> Self {
        let path = dir.join(name);
        let status = std::process::Command::new("ssh-keygen")
            .args(["-q", "-t", "ed25519", "-N", "", "-C", name, "-f"])
            .arg(&path)
            .status()
            .expect("ssh-keygen (openssh-client) must be installed");
        assert!(status.success());
        let public = std::fs::read_to_string(path.with_extension("pub")).unwrap();
        Self { path, public }
    }

    pub fn fingerprint(&self) -> String {
        russh::keys::PublicKey::from_openssh(self.public.trim())
            .unwrap()
            .fingerprint(russh::keys::HashAlg::Sha256)
            .to_string()
    }
}

/// Options of one test's gateway.
pub struct Options {
    pub allowlist: Vec<(&'static str, Vec<&'static str>)>,
    pub proxy_trusted: Option<Vec<&'static str>>,
    /// `activity_report` of the gateway's config; its default (60 s) when `None`.
    pub activity_report: Option<&'static str>,
    /// More top-level lines for the gateway's config.
    pub extra_config: &'static str,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            allowlist: vec![("local", vec!["127.0.0.0/8"])],
            proxy_trusted: None,
            activity_report: None,
            extra_config: "",
        }
    }
}

/// A running gateway with its fake manager and agent, and Alice's registered key.
pub struct Env {
    pub dir: tempfile::TempDir,
    pub manager: Arc<ManagerState>,
    pub agent: Arc<AgentState>,
    pub gateway: SocketAddr,
    pub alice: SshKey,
    pub train1: Route,
    shutdown: CancellationToken,
    task: Option<JoinHandle<anyhow::Result<()>>>,
}

impl Env {
    pub async fn start(options: Options) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let pki = Pki::new(dir.path());
        let manager = Arc::new(ManagerState::default());
        let entries: Vec<(&str, &[&str])> = options
            .allowlist
            .iter()
            .map(|(name, cidrs)| (*name, cidrs.as_slice()))
            .collect();
        manager.allow(&entries);
        let manager_address = start_manager(pki.acceptor.clone(), manager.clone()).await;
        let agent = Arc::new(AgentState::default());
        let agent_url = start_agent(pki.acceptor.clone(), agent.clone()).await;

        let alice = SshKey::generate(dir.path(), "alice");
        manager.keys.lock().unwrap().insert(
            key_id(&alice.public),
            KeyOwner {
                owner: Dn::parse(ALICE_DN).unwrap(),
                user_name: UserName::parse("alice").unwrap(),
                fingerprint: alice.fingerprint(),
                expires_at: chrono::Utc::now() + chrono::Duration::days(1),
            },
        );
        let train1 = Route {
            session_id: SessionId::new_random(),
            session_name: SessionName::parse("train1").unwrap(),
            state: SessionState::Waiting,
            node: NodeName::parse("node1").unwrap(),
            container: "ongrid-test".to_owned(),
            agent_url,
        };
        manager
            .routes
            .lock()
            .unwrap()
            .insert("train1".to_owned(), Ok(train1.clone()));
        *manager.deadlines.lock().unwrap() = Some(SessionDeadlines {
            session_id: train1.session_id,
            state: SessionState::Connected,
            idle_timeout_secs: 2 * 3600,
            max_end_at: Some(chrono::Utc::now() + chrono::Duration::days(7)),
            keep_until: None,
            next_hold: None,
        });

        std::fs::write(dir.path().join("token"), format!("{GATEWAY_TOKEN}\n")).unwrap();
        let mut toml = format!(
            r#"listen = "127.0.0.1:0"
host_key_dir = "{dir}/hostkeys"
manager_url = "https://{manager_address}"
ca_dir = "{ca}"
token_file = "{dir}/token"
allowlist_refresh = "1 second"
"#,
            dir = dir.path().display(),
            ca = pki.ca_dir.display(),
        );
        if let Some(every) = options.activity_report {
            toml.push_str(&format!("activity_report = \"{every}\"\n"));
        }
        toml.push_str(options.extra_config);
        if let Some(trusted) = &options.proxy_trusted {
            toml.push_str(&format!(
                "[proxy_protocol]\ntrusted = [{}]\n",
                trusted
                    .iter()
                    .map(|t| format!("\"{t}\""))
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
        let config_path = dir.path().join("gateway.toml");
        std::fs::write(&config_path, toml).unwrap();
        let config = ongrid_gateway::Config::load(&config_path).unwrap();
        let listener = TcpListener::bind(config.listen).await.unwrap();
        let gateway = listener.local_addr().unwrap();
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(ongrid_gateway::run(config, listener, shutdown.clone()));
        let env = Self {
            dir,
            manager,
            agent,
            gateway,
            alice,
            train1,
            shutdown,
            task: Some(task),
        };
        env.wait_for_banner().await;
        env
    }

    /// Waits until the gateway has its host keys and its first allowlist (when it admits
    /// loopback at all): its SSH banner comes back.
    async fn wait_for_banner(&self) {
        let loopback_allowed = self
            .manager
            .allowlist
            .lock()
            .unwrap()
            .institute_of("127.0.0.1".parse().unwrap())
            .is_some();
        if !loopback_allowed {
            // Nothing to connect to yet; the gateway has started once it asked for the list.
            eventually("the gateway's first allowlist fetch", || async {
                (self
                    .manager
                    .allowlist_fetches
                    .load(std::sync::atomic::Ordering::SeqCst)
                    > 0)
                .then_some(())
            })
            .await;
            return;
        }
        eventually("the gateway's SSH banner", || async {
            banner(self.gateway)
                .await
                .filter(|b| b.starts_with(b"SSH-2.0-"))
        })
        .await;
    }

    /// Stops the gateway like SIGTERM does and waits for `run` to return.
    pub async fn stop(&mut self) -> anyhow::Result<()> {
        self.shutdown.cancel();
        let task = self.task.take().expect("running");
        tokio::time::timeout(Duration::from_secs(20), task)
            .await
            .expect("the gateway stops within 20 s")
            .expect("the gateway task does not panic")
    }

    /// An `ssh` command for `target@127.0.0.1` with `key`, touching nothing of the machine's
    /// own configuration.
    pub fn ssh(&self, key: &SshKey, target: &str, port: u16) -> tokio::process::Command {
        self.ssh_with(key, target, port, &["BatchMode=yes", "LogLevel=ERROR"])
    }

    /// Like [`Self::ssh`] with other `-o` options first (OpenSSH keeps the first value given).
    pub fn ssh_with(
        &self,
        key: &SshKey,
        target: &str,
        port: u16,
        options: &[&str],
    ) -> tokio::process::Command {
        let mut command = tokio::process::Command::new("ssh");
        command.args(["-F", "/dev/null", "-p", &port.to_string()]);
        for option in options {
            command.args(["-o", option]);
        }
        command
            .arg("-i")
            .arg(&key.path)
            .args([
                "-o",
                "IdentitiesOnly=yes",
                "-o",
                "StrictHostKeyChecking=no",
                "-o",
                "UserKnownHostsFile=/dev/null",
                "-o",
                "ConnectTimeout=10",
            ])
            .arg(format!("{target}@127.0.0.1"))
            .kill_on_drop(true);
        command
    }

    /// Runs `ssh alice-key target@gateway command` with `stdin`, returns what it printed.
    pub async fn run_ssh(&self, key: &SshKey, target: &str, command: &str, stdin: &[u8]) -> Output {
        let mut ssh = self.ssh(key, target, self.gateway.port());
        ssh.arg(command);
        run(ssh, stdin).await
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// Runs `command` with `stdin` written (then closed) while its output is collected.
pub async fn run(mut command: tokio::process::Command, stdin: &[u8]) -> Output {
    command
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = command.spawn().expect("spawn ssh");
    let mut input = child.stdin.take().expect("stdin");
    let data = stdin.to_vec();
    let writer = tokio::spawn(async move {
        let _ = input.write_all(&data).await;
        drop(input);
    });
    let output = tokio::time::timeout(Duration::from_secs(60), child.wait_with_output())
        .await
        .expect("ssh finishes within 60 s")
        .expect("ssh runs");
    let _ = writer.await;
    output
}

/// The first bytes a server sends (up to 64 within 3 s); `None` when it closed without any.
pub async fn banner(address: SocketAddr) -> Option<Vec<u8>> {
    let mut tcp = TcpStream::connect(address).await.ok()?;
    let mut buffer = vec![0u8; 64];
    match tokio::time::timeout(Duration::from_secs(3), tcp.read(&mut buffer)).await {
        Ok(Ok(n)) if n > 0 => Some(buffer[..n].to_vec()),
        _ => None,
    }
}

/// Polls `check` every 100 ms until it gives a value, for at most 15 s.
pub async fn eventually<T, F, Fut>(what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

pub fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

pub fn explain(out: &Output) -> String {
    let cut = |bytes: &[u8]| {
        let all = text(bytes);
        if all.len() > 2000 {
            format!("{}... ({} bytes)", &all[..2000], bytes.len())
        } else {
            all
        }
    };
    format!(
        "status {}\nstdout: {}\nstderr: {}",
        out.status,
        cut(&out.stdout),
        cut(&out.stderr)
    )
}

/// A port nobody listens on right now (for `ssh -L`, which must bind it itself).
pub fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

/// A TCP service on loopback that answers every line with it in upper case.
pub async fn upper_case_server() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut tcp, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buffer = vec![0u8; 4096];
                loop {
                    match tcp.read(&mut buffer).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => {
                            let upper = buffer[..n].to_ascii_uppercase();
                            if tcp.write_all(&upper).await.is_err() {
                                return;
                            }
                        }
                    }
                }
            });
        }
    });
    address
}

/// A TCP service on loopback that writes without end to whoever connects; returns its address
/// and how many bytes it managed to write.
pub async fn firehose_server() -> (SocketAddr, Arc<std::sync::atomic::AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let written = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = written.clone();
    tokio::spawn(async move {
        while let Ok((mut tcp, _)) = listener.accept().await {
            let counter = counter.clone();
            tokio::spawn(async move {
                let chunk = vec![b'z'; 64 * 1024];
                while tcp.write_all(&chunk).await.is_ok() {
                    counter.fetch_add(chunk.len(), std::sync::atomic::Ordering::SeqCst);
                }
            });
        }
    });
    (address, written)
}

/// A stand-in L4 load balancer: relays connections to `gateway`, first sending a PROXY v2
/// header that names `client` as the source.
pub async fn proxy_balancer(gateway: SocketAddr, client: SocketAddr) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut downstream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let Ok(mut upstream) = TcpStream::connect(gateway).await else {
                    return;
                };
                let header = ongrid_gateway::proxy_protocol::encode(
                    &ongrid_gateway::proxy_protocol::Header::Proxy {
                        source: client,
                        destination: gateway,
                    },
                );
                if upstream.write_all(&header).await.is_err() {
                    return;
                }
                let _ = tokio::io::copy_bidirectional(&mut downstream, &mut upstream).await;
            });
        }
    });
    address
}

pub fn ip(text: &str) -> IpAddr {
    text.parse().unwrap()
}
