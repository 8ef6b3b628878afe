//! The manager's API end to end over real TLS: `run` on 127.0.0.1:0 with a throwaway CA made by
//! rcgen, a real SQLite file, and reqwest clients presenting client certificates (two users and
//! an admin) or a bearer token (agents, the SSH gateway).

// Test helpers outside `#[test]` functions: a failed setup step should panic right there.
#![allow(clippy::unwrap_used)]

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Datelike, TimeDelta, Utc};

use ongrid_core::api::{
    AddKey, Allowlist, AuditRecord, ConnectionEvent, ConnectionEventKind, ContainerState,
    CreateSession, DesiredState, ErrorBody, GpuView, Institute, KeyCheck, KeyOwner, KeyView,
    NodeReport, NodeView, ObservedContainer, RegisterNode, Route, RouteRequest, RunState,
    SessionView, SetGpuMode, WhoAmI,
};
use ongrid_core::{
    ComputeCapability, Dn, GpuHealth, GpuId, GpuInfo, GpuMode, GpuRequest, GpuUuid, InstituteName,
    MemorySize, NodeName, SessionName, SessionState, Sharing,
};
use ongrid_manager::clock::{Clock, ManualClock};
use ongrid_manager::{Config, Manager};
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, SanType,
};
use reqwest::StatusCode;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

// Frozen images (devctl freeze, devctl image).
#[path = "api/images.rs"]
mod images;
// Batch jobs (devctl job).
#[path = "api/holds.rs"]
mod holds;
#[path = "api/jobs.rs"]
mod jobs;
// The gateway's re-check of open connections' keys.
#[path = "api/gateway_keys.rs"]
mod gateway_keys;
// The long-polls of agents (desired state) and people (a session's state).
#[path = "api/watch.rs"]
mod watch;
// Node and GPU operations: drains, lost nodes, removal.
#[path = "api/nodes.rs"]
mod nodes;

#[path = "api/mig.rs"]
mod mig;
// Removing users and restoring them.
#[path = "api/users.rs"]
mod users;
// Operations: upgrading a previous release's database, backup and restore.
#[path = "api/upgrade.rs"]
mod upgrade;
// Site policy: who may use the site, accounting groups.
#[path = "api/policy.rs"]
mod policy;
// Site policy: owned GPUs and reservations.
#[path = "api/reservations.rs"]
mod reservations;
// The web dashboard: login links, cookies, CSRF, what each viewer sees, live updates.
#[path = "api/dashboard.rs"]
mod dashboard;
// Two managers serving one PostgreSQL database: one leads, the other takes over when it dies;
// copying a SQLite store into PostgreSQL; PostgreSQL backup and restore.
#[path = "api/replicas.rs"]
mod replicas;
// Bearer tokens (WLCG, SciTokens) from a token issuer on loopback.
#[path = "api/tokens.rs"]
mod tokens;

const NODE1_TOKEN: &str = "node1-0123456789abcdef0123456789abcdef";
const NODE2_TOKEN: &str = "node2-fedcba9876543210fedcba9876543210";
const ALICE: &str = "/DC=org/O=Example/CN=Alice Smith";
const BOB: &str = "/DC=org/O=Example/CN=Bob Jones";
const ADMIN: &str = "/DC=org/O=Example/CN=Site Admin";
const GATEWAY_TOKEN: &str = "gateway-00112233445566778899aabbccddeeff";
/// `placement_wait_ms` of these tests' manager: the answers' promise (STARTING, or PENDING once
/// the round ended) is what they check, so a create waits for its placing round however
/// loaded the machine is. That a request answers while its round is still under way is
/// `scheduling::tests::a_request_may_answer_before_the_round_it_asked_for_which_still_places_it`.
const PLACEMENT_WAIT: Duration = Duration::from_secs(10);

struct Ca {
    cert: rcgen::Certificate,
    key: KeyPair,
}

impl Ca {
    fn new(cn: &str) -> Self {
        let mut params = CertificateParams::default();
        params.distinguished_name = DistinguishedName::new();
        params.distinguished_name.push(DnType::CommonName, cn);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let key = KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        Self { cert, key }
    }

    /// A client certificate for a slash-form DN of (type, value) pairs, valid until midnight
    /// UTC of `until` (rcgen's far future when `None`): PEM cert + key.
    fn client_pem_until(&self, parts: &[(DnType, &str)], until: Option<DateTime<Utc>>) -> Vec<u8> {
        let mut params = CertificateParams::default();
        if let Some(until) = until {
            params.not_after =
                rcgen::date_time_ymd(until.year(), until.month() as u8, until.day() as u8);
        }
        params.distinguished_name = DistinguishedName::new();
        for (ty, value) in parts {
            params.distinguished_name.push(ty.clone(), *value);
        }
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.cert, &self.key).unwrap();
        format!("{}{}", cert.pem(), key.serialize_pem()).into_bytes()
    }
}

fn dc() -> DnType {
    DnType::CustomDnType(vec![0, 9, 2342, 19200300, 100, 1, 25])
}

fn user_pem(ca: &Ca, cn: &str) -> Vec<u8> {
    user_pem_until(ca, cn, None)
}

fn user_pem_until(ca: &Ca, cn: &str, until: Option<DateTime<Utc>>) -> Vec<u8> {
    ca.client_pem_until(
        &[
            (dc(), "org"),
            (DnType::OrganizationName, "Example"),
            (DnType::CommonName, cn),
        ],
        until,
    )
}

/// Midnight UTC, three days from now: the notAfter of Alice's short-lived certificate.
fn short_expiry() -> DateTime<Utc> {
    (Utc::now() + TimeDelta::days(3))
        .date_naive()
        .and_hms_opt(0, 0, 0)
        .unwrap()
        .and_utc()
}

/// A site on disk: CA directory, server certificate, tokens, config; and the clients.
struct Site {
    dir: tempfile::TempDir,
    config: Config,
    ca_pem: String,
    alice_pem: Vec<u8>,
    bob_pem: Vec<u8>,
    admin_pem: Vec<u8>,
    stranger_pem: Vec<u8>,
    /// Alice again, with a certificate valid until `short_expiry`.
    alice_short_pem: Vec<u8>,
    /// Midnight UTC three days after the site was made.
    short_expiry: DateTime<Utc>,
}

impl Site {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let ca = Ca::new("ongrid Test CA");
        let ca_dir = dir.path().join("certificates");
        std::fs::create_dir(&ca_dir).unwrap();
        std::fs::write(ca_dir.join("0ca0ca00.0"), ca.cert.pem()).unwrap();

        let mut params = CertificateParams::default();
        params.distinguished_name = DistinguishedName::new();
        params
            .distinguished_name
            .push(DnType::CommonName, "manager.test");
        params.subject_alt_names = vec![
            SanType::DnsName("localhost".try_into().unwrap()),
            SanType::IpAddress(IpAddr::V4(Ipv4Addr::LOCALHOST)),
        ];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let server_key = KeyPair::generate().unwrap();
        let server_cert = params.signed_by(&server_key, &ca.cert, &ca.key).unwrap();
        std::fs::write(dir.path().join("manager.crt"), server_cert.pem()).unwrap();
        std::fs::write(dir.path().join("manager.key"), server_key.serialize_pem()).unwrap();
        std::fs::write(
            dir.path().join("agent-tokens"),
            format!("# test nodes\nnode1 {NODE1_TOKEN}\nnode2 {NODE2_TOKEN}\n"),
        )
        .unwrap();
        std::fs::write(
            dir.path().join("gateway-token"),
            format!("{GATEWAY_TOKEN}\n"),
        )
        .unwrap();

        let config_path = dir.path().join("manager.toml");
        let text = format!(
            r#"
listen = "127.0.0.1:0"
database = "{db}"
tls_cert = "{cert}"
tls_key = "{key}"
ca_dir = "{ca_dir}"
admins = ["{ADMIN}"]
agent_tokens_file = "{tokens}"
gateway_token_file = "{gateway_token}"
node_timeout = "1 hour"
sync_interval = "5 seconds"
# Only wake-ups drive the scheduler here: deterministic, and proof that they work.
schedule_interval = "1 hour"
placement_wait_ms = {placement_wait_ms}
[session_limits]
cpus = "1.5"
memory = "2GiB"
pids = 512
"#,
            db = path(&dir.path().join("manager.db")),
            cert = path(&dir.path().join("manager.crt")),
            key = path(&dir.path().join("manager.key")),
            ca_dir = path(&ca_dir),
            tokens = path(&dir.path().join("agent-tokens")),
            gateway_token = path(&dir.path().join("gateway-token")),
            placement_wait_ms = PLACEMENT_WAIT.as_millis(),
        );
        std::fs::write(&config_path, &text).unwrap();
        let config = Config::from_toml(&text, &config_path, |_| None).unwrap();

        let stranger_ca = Ca::new("Unknown CA");
        let short_expiry = short_expiry();
        Self {
            config,
            ca_pem: ca.cert.pem(),
            alice_pem: user_pem(&ca, "Alice Smith"),
            bob_pem: user_pem(&ca, "Bob Jones"),
            admin_pem: user_pem(&ca, "Site Admin"),
            stranger_pem: user_pem(&stranger_ca, "Alice Smith"),
            alice_short_pem: user_pem_until(&ca, "Alice Smith", Some(short_expiry)),
            short_expiry,
            dir,
        }
    }

    fn client(&self, identity: Option<&[u8]>) -> reqwest::Client {
        let mut builder = reqwest::Client::builder()
            .use_rustls_tls()
            .tls_built_in_root_certs(false)
            .add_root_certificate(reqwest::Certificate::from_pem(self.ca_pem.as_bytes()).unwrap())
            .timeout(Duration::from_secs(20));
        if let Some(pem) = identity {
            builder = builder.identity(reqwest::Identity::from_pem(pem).unwrap());
        }
        builder.build().unwrap()
    }

    async fn start(&self) -> Running {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(ongrid_manager::run(
            self.config.clone(),
            listener,
            shutdown.clone(),
        ));
        self.running(addr, shutdown, task)
    }

    /// Starts a manager with `config` and, when given, a clock the test moves.
    async fn start_with(&self, config: Config, clock: Option<Arc<ManualClock>>) -> Running {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shutdown = CancellationToken::new();
        let mut manager = Manager::open(config).await.unwrap();
        if let Some(clock) = clock {
            manager = manager.with_clock(clock);
        }
        let task = tokio::spawn(manager.serve(listener, shutdown.clone()));
        self.running(addr, shutdown, task)
    }

    fn running(
        &self,
        addr: SocketAddr,
        shutdown: CancellationToken,
        task: JoinHandle<anyhow::Result<()>>,
    ) -> Running {
        Running {
            addr,
            shutdown,
            task,
            alice: Api::new(self.client(Some(&self.alice_pem)), addr),
            alice_short: Api::new(self.client(Some(&self.alice_short_pem)), addr),
            bob: Api::new(self.client(Some(&self.bob_pem)), addr),
            admin: Api::new(self.client(Some(&self.admin_pem)), addr),
            anonymous: Api::new(self.client(None), addr),
            stranger: Api::new(self.client(Some(&self.stranger_pem)), addr),
            node1: Api::new(self.client(None), addr).with_token(NODE1_TOKEN),
            node2: Api::new(self.client(None), addr).with_token(NODE2_TOKEN),
            gateway: Api::new(self.client(None), addr).with_token(GATEWAY_TOKEN),
        }
    }
}

fn path(p: &Path) -> String {
    p.display().to_string()
}

struct Running {
    addr: SocketAddr,
    shutdown: CancellationToken,
    task: JoinHandle<anyhow::Result<()>>,
    alice: Api,
    /// Alice with her certificate valid until `Site::short_expiry`.
    alice_short: Api,
    bob: Api,
    admin: Api,
    anonymous: Api,
    stranger: Api,
    node1: Api,
    node2: Api,
    gateway: Api,
}

impl Running {
    async fn stop(self) {
        self.shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(20), self.task)
            .await
            .expect("the manager stops within 20 s")
            .unwrap()
            .unwrap();
    }
}

/// One caller of the API.
struct Api {
    client: reqwest::Client,
    base: String,
    token: Option<String>,
}

impl Api {
    fn new(client: reqwest::Client, addr: SocketAddr) -> Self {
        Self {
            client,
            base: format!("https://{addr}"),
            token: None,
        }
    }

    fn with_token(mut self, token: &str) -> Self {
        self.token = Some(token.to_owned());
        self
    }

    fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let request = self.client.request(method, format!("{}{path}", self.base));
        match &self.token {
            Some(token) => request.bearer_auth(token),
            None => request,
        }
    }

    async fn send(&self, request: reqwest::RequestBuilder) -> (StatusCode, String) {
        let response = request.send().await.unwrap();
        let status = response.status();
        (status, response.text().await.unwrap())
    }

    /// A call that must succeed with `expected`; the body parsed.
    async fn ok<T: DeserializeOwned>(
        &self,
        expected: StatusCode,
        request: reqwest::RequestBuilder,
    ) -> T {
        let (status, body) = self.send(request).await;
        assert_eq!(status, expected, "{body}");
        serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}"))
    }

    /// A call that must fail with `expected`; the error body.
    async fn fails(&self, expected: StatusCode, request: reqwest::RequestBuilder) -> ErrorBody {
        let (status, body) = self.send(request).await;
        assert_eq!(status, expected, "{body}");
        serde_json::from_str(&body).unwrap_or_else(|e| panic!("not an ErrorBody ({e}): {body}"))
    }

    fn get(&self, path: &str) -> reqwest::RequestBuilder {
        self.request(reqwest::Method::GET, path)
    }

    fn delete(&self, path: &str) -> reqwest::RequestBuilder {
        self.request(reqwest::Method::DELETE, path)
    }

    fn post<B: Serialize>(&self, path: &str, body: &B) -> reqwest::RequestBuilder {
        self.request(reqwest::Method::POST, path).json(body)
    }

    fn put<B: Serialize>(&self, path: &str, body: &B) -> reqwest::RequestBuilder {
        self.request(reqwest::Method::PUT, path).json(body)
    }

    async fn create(&self, name: Option<&str>, gpus: GpuRequest) -> SessionView {
        let body = CreateSession {
            name: name.map(|n| SessionName::parse(n).unwrap()),
            gpus,
            image: None,
            idle_timeout_secs: None,
            max_duration_secs: None,
            reservation: None,
        };
        self.ok(StatusCode::CREATED, self.post("/v1/sessions", &body))
            .await
    }

    async fn show(&self, name: &str) -> SessionView {
        self.ok(StatusCode::OK, self.get(&format!("/v1/sessions/{name}")))
            .await
    }

    async fn list(&self, query: &str) -> Vec<SessionView> {
        self.ok(StatusCode::OK, self.get(&format!("/v1/sessions{query}")))
            .await
    }

    /// Waits until the session reaches `state` (the scheduler runs in its own task).
    async fn wait_for(&self, name: &str, state: SessionState) -> SessionView {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
        loop {
            let view = self.show(name).await;
            if view.state == state {
                return view;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{name} is still {} ({}), not {state}",
                view.state,
                view.reason
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn register(&self, node: &str, gpus: Vec<GpuInfo>) -> DesiredState {
        self.register_streams(node, gpus, None).await
    }

    /// Registers with the agent's stream endpoint for the SSH gateway.
    async fn register_streams(
        &self,
        node: &str,
        gpus: Vec<GpuInfo>,
        stream_url: Option<&str>,
    ) -> DesiredState {
        let body = RegisterNode {
            node: NodeName::parse(node).unwrap(),
            agent_version: "test".to_owned(),
            gpu_backend: "simulated".to_owned(),
            gpus,
            stream_url: stream_url.map(str::to_owned),
            start_modes: Default::default(),
        };
        self.ok(StatusCode::OK, self.post("/v1/agent/register", &body))
            .await
    }

    async fn sync(
        &self,
        node: &str,
        gpus: Vec<GpuInfo>,
        containers: Vec<ObservedContainer>,
    ) -> DesiredState {
        let body = NodeReport {
            node: NodeName::parse(node).unwrap(),
            gpus,
            containers,
            activity: Vec::new(),
            freezes: Vec::new(),
            jobs: Vec::new(),
        };
        self.ok(StatusCode::OK, self.post("/v1/agent/sync", &body))
            .await
    }
}

fn gpu(n: u8, capability: (u16, u16), mib: u64) -> GpuInfo {
    GpuInfo {
        uuid: GpuUuid::parse(&format!("GPU-11111111-2222-3333-4444-5555555555{n:02}")).unwrap(),
        model: "NVIDIA A100-SXM4-40GB".to_owned(),
        capability: ComputeCapability::new(capability.0, capability.1),
        memory: MemorySize::from_mib(mib),
        pci_bus_id: Some(format!("00000000:{n:02}:00.0")),
        driver_version: Some("550.54.15".to_owned()),
        mig_enabled: false,
        health: GpuHealth::Healthy,
        utilization_percent: None,
        mig_devices: Vec::new(),
        mig_waiting: None,
    }
}

fn a100(n: u8) -> GpuInfo {
    gpu(n, (8, 0), 40_960)
}

fn one_gpu() -> GpuRequest {
    GpuRequest::default()
}

fn container(
    session: &SessionView,
    state: ContainerState,
    error: Option<&str>,
) -> ObservedContainer {
    ObservedContainer {
        session_id: session.id,
        container_id: format!("c-{}", session.id),
        state,
        error: error.map(str::to_owned),
    }
}

#[tokio::test]
async fn sessions_are_private_and_admins_see_all() {
    let site = Site::new();
    let m = site.start().await;
    m.node1.register("node1", vec![a100(1), a100(2)]).await;

    let who: WhoAmI = m.alice.ok(StatusCode::OK, m.alice.get("/v1/whoami")).await;
    assert_eq!(who.dn.as_str(), ALICE);
    assert_eq!(who.user_name.as_str(), "alice-smith");
    assert_eq!(who.uid, 20_000);
    assert!(!who.admin);
    let admin: WhoAmI = m.admin.ok(StatusCode::OK, m.admin.get("/v1/whoami")).await;
    assert!(admin.admin);

    let created = m.alice.create(Some("train1"), one_gpu()).await;
    assert_eq!(created.name.as_str(), "train1");
    assert_eq!(created.owner.as_str(), ALICE);
    // A GPU is free, so the session is placed before the answer is sent.
    assert_eq!(created.state, SessionState::Starting);
    assert_eq!(created.queue_position, None);
    assert_eq!(created.image, "ongrid/dev:latest");
    assert_eq!(created.container, created.id.container_name());
    assert_eq!(created.transitions.len(), 2);
    assert_eq!(created.transitions[0].reason, "requested by alice-smith");

    // Default names, and a duplicate live name is a conflict that says what to do.
    let dev = m.alice.create(None, one_gpu()).await;
    assert_eq!(dev.name.as_str(), "dev");
    let dev2 = m.alice.create(None, one_gpu()).await;
    assert_eq!(dev2.name.as_str(), "dev-2");
    let body = CreateSession {
        name: Some(SessionName::parse("train1").unwrap()),
        gpus: one_gpu(),
        image: None,
        idle_timeout_secs: None,
        max_duration_secs: None,
        reservation: None,
    };
    let err = m
        .alice
        .fails(StatusCode::CONFLICT, m.alice.post("/v1/sessions", &body))
        .await;
    assert_eq!(err.error.code, "conflict");
    assert!(
        err.error
            .message
            .starts_with("you already have a session named train1 ("),
        "{}",
        err.error.message
    );
    assert!(err
        .error
        .message
        .ends_with("pick another --name or `devctl session rm train1`"));

    // Bob neither sees nor touches Alice's sessions; his own 404 is the same as for nothing.
    assert!(m.bob.list("").await.is_empty());
    let owner = format!("?owner={}", urlencode(ALICE));
    let hidden = m
        .bob
        .fails(
            StatusCode::NOT_FOUND,
            m.bob.get(&format!("/v1/sessions/train1{owner}")),
        )
        .await;
    let absent = m
        .bob
        .fails(
            StatusCode::NOT_FOUND,
            m.bob.get(&format!("/v1/sessions/nosuch{owner}")),
        )
        .await;
    assert_eq!(
        hidden.error.message.replace("train1", "nosuch"),
        absent.error.message
    );
    let mine = m
        .bob
        .fails(StatusCode::NOT_FOUND, m.bob.get("/v1/sessions/train1"))
        .await;
    assert_eq!(
        mine.error.message,
        "you have no session named train1: list yours with `devctl session ls`"
    );
    m.bob
        .fails(
            StatusCode::NOT_FOUND,
            m.bob.delete(&format!("/v1/sessions/train1{owner}")),
        )
        .await;
    let err = m
        .bob
        .fails(StatusCode::FORBIDDEN, m.bob.get("/v1/sessions?all=true"))
        .await;
    assert_eq!(err.error.code, "forbidden");
    let bobs = m.bob.create(Some("train1"), one_gpu()).await;
    assert_eq!(bobs.owner.as_str(), BOB);

    // The admin sees everyone's and can address Alice's by owner.
    let all = m.admin.list("?all=true").await;
    let mut names: Vec<_> = all
        .iter()
        .map(|s| format!("{} {}", s.user_name, s.name))
        .collect();
    names.sort();
    assert_eq!(
        names,
        [
            "alice-smith dev",
            "alice-smith dev-2",
            "alice-smith train1",
            "bob-jones train1"
        ]
    );
    assert!(
        m.admin.list("").await.is_empty(),
        "without all=true: own only"
    );
    let seen: SessionView = m
        .admin
        .ok(
            StatusCode::OK,
            m.admin.get(&format!("/v1/sessions/train1{owner}")),
        )
        .await;
    assert_eq!(seen.id, created.id);

    // Removing: ENDED with who did it; the name is free again; the list leaves it out.
    let ended: SessionView = m
        .alice
        .ok(StatusCode::OK, m.alice.delete("/v1/sessions/dev-2"))
        .await;
    assert_eq!(ended.state, SessionState::Ended);
    assert_eq!(ended.reason, "removed by alice-smith");
    assert_eq!(ended.transitions.last().unwrap().to, SessionState::Ended);
    let shown = m.alice.show("dev-2").await;
    assert_eq!(shown.state, SessionState::Ended);
    m.alice
        .fails(StatusCode::NOT_FOUND, m.alice.delete("/v1/sessions/dev-2"))
        .await;
    let by_admin: SessionView = m
        .admin
        .ok(
            StatusCode::OK,
            m.admin.delete(&format!("/v1/sessions/dev{owner}")),
        )
        .await;
    assert_eq!(by_admin.reason, "removed by site-admin");
    let left: Vec<_> = m
        .alice
        .list("")
        .await
        .into_iter()
        .map(|s| s.name.to_string())
        .collect();
    assert_eq!(left, ["train1"]);
    assert_eq!(m.alice.create(None, one_gpu()).await.name.as_str(), "dev");

    m.stop().await;
}

#[tokio::test]
async fn bad_requests_are_error_bodies() {
    let site = Site::new();
    let m = site.start().await;
    m.node1
        .register("node1", vec![gpu(1, (7, 5), 15_360)])
        .await;

    let err = m
        .alice
        .fails(
            StatusCode::BAD_REQUEST,
            m.alice
                .post("/v1/sessions", &serde_json::json!({"name": "Bad Name", "gpus": {"count": 1, "sharing": "exclusive"}})),
        )
        .await;
    assert_eq!(err.error.code, "bad_request");
    assert!(
        err.error.message.contains("lower-case letters"),
        "{}",
        err.error.message
    );

    let err = m
        .alice
        .fails(
            StatusCode::BAD_REQUEST,
            m.alice
                .request(reqwest::Method::POST, "/v1/sessions")
                .header("content-type", "application/json")
                .body("{not json"),
        )
        .await;
    assert_eq!(err.error.code, "bad_request");

    let zero = GpuRequest {
        count: 0,
        ..one_gpu()
    };
    let body = CreateSession {
        name: None,
        gpus: zero,
        image: None,
        idle_timeout_secs: None,
        max_duration_secs: None,
        reservation: None,
    };
    let err = m
        .alice
        .fails(StatusCode::BAD_REQUEST, m.alice.post("/v1/sessions", &body))
        .await;
    assert_eq!(
        err.error.message,
        "gpus.count: a session needs at least 1 GPU"
    );

    // Unsatisfiable: the scheduler's message plus where to look.
    let too_new = GpuRequest {
        min_capability: Some(ComputeCapability::new(9, 0)),
        ..one_gpu()
    };
    let body = CreateSession {
        name: None,
        gpus: too_new,
        image: None,
        idle_timeout_secs: None,
        max_duration_secs: None,
        reservation: None,
    };
    let err = m
        .alice
        .fails(
            StatusCode::UNPROCESSABLE_ENTITY,
            m.alice.post("/v1/sessions", &body),
        )
        .await;
    assert_eq!(err.error.code, "unsatisfiable");
    assert!(err.error.message.contains("9.0"), "{}", err.error.message);
    assert!(
        err.error.message.ends_with("; see `devctl gpus`"),
        "{}",
        err.error.message
    );
    assert!(m.alice.list("").await.is_empty(), "nothing was created");

    let err = m
        .alice
        .fails(
            StatusCode::BAD_REQUEST,
            m.admin.put(
                "/v1/gpus/GPU-nope/mode",
                &SetGpuMode {
                    mode: GpuMode::Exclusive,
                },
            ),
        )
        .await;
    assert!(
        err.error.message.contains("GPU-nope"),
        "{}",
        err.error.message
    );
    let err = m
        .alice
        .fails(StatusCode::NOT_FOUND, m.alice.get("/v1/nope"))
        .await;
    assert_eq!(err.error.code, "not_found");

    m.stop().await;
}

#[tokio::test]
async fn placement_follows_free_gpus_and_agent_reports() {
    let site = Site::new();
    let m = site.start().await;
    let gpus = vec![a100(1)];
    let desired = m.node1.register("node1", gpus.clone()).await;
    assert_eq!(desired.node.as_str(), "node1");
    assert_eq!(desired.sync_interval_secs, 5);
    assert!(desired.sessions.is_empty());

    m.alice.create(Some("first"), one_gpu()).await;
    let first = m.alice.wait_for("first", SessionState::Starting).await;
    assert_eq!(first.node.as_ref().map(NodeName::as_str), Some("node1"));
    assert_eq!(first.gpus, vec![GpuId::Gpu(a100(1).uuid)]);
    assert_eq!(
        first.reason,
        "placed on node1 (GPU-11111111-2222-3333-4444-555555555501)"
    );
    assert_eq!(first.queue_position, None);

    // The only GPU is taken: Bob waits in the queue.
    let second = m.bob.create(Some("second"), one_gpu()).await;
    assert_eq!(second.state, SessionState::Pending);
    assert_eq!(second.queue_position, Some(1));

    // Nodes: used and free, session names only for their owner (and admins).
    let nodes: Vec<NodeView> = m.bob.ok(StatusCode::OK, m.bob.get("/v1/nodes")).await;
    assert_eq!(nodes.len(), 1);
    assert!(nodes[0].online);
    assert_eq!(nodes[0].gpus[0].used, 1);
    assert_eq!(nodes[0].gpus[0].free, 0);
    assert!(nodes[0].gpus[0].sessions.is_empty());
    let nodes: Vec<NodeView> = m.alice.ok(StatusCode::OK, m.alice.get("/v1/nodes")).await;
    assert_eq!(nodes[0].gpus[0].sessions[0].as_str(), "first");

    // The agent is told to run it, as Alice, with the site's limits.
    let desired = m.node1.sync("node1", gpus.clone(), vec![]).await;
    assert_eq!(desired.sessions.len(), 1);
    let wanted = &desired.sessions[0];
    assert_eq!(wanted.session_id, first.id);
    assert_eq!(wanted.run, RunState::Running);
    assert_eq!(wanted.user.name.as_str(), "alice-smith");
    assert_eq!(wanted.user.uid, 20_000);
    assert_eq!(wanted.gpus, first.gpus);
    assert_eq!(wanted.limits.millicpus, 1500);
    assert_eq!(wanted.limits.memory.bytes(), 2 << 30);
    assert_eq!(wanted.limits.pids, 512);

    // The container runs: WAITING.
    m.node1
        .sync(
            "node1",
            gpus.clone(),
            vec![container(&first, ContainerState::Running, None)],
        )
        .await;
    let running = m.alice.show("first").await;
    assert_eq!(running.state, SessionState::Waiting);
    assert_eq!(running.reason, "container running on node1");

    // It dies of OOM: FAILED with what to do; the agent is told to keep it stopped (the user's
    // files stay until `devctl session rm`); Bob's is placed on the freed GPU.
    let oom = ContainerState::Exited {
        exit_code: 137,
        oom_killed: true,
        error: None,
    };
    let desired = m
        .node1
        .sync("node1", gpus.clone(), vec![container(&first, oom, None)])
        .await;
    let kept: Vec<_> = desired
        .sessions
        .iter()
        .filter(|s| s.session_id == first.id)
        .collect();
    assert_eq!(kept.len(), 1);
    assert_eq!(kept[0].run, RunState::Stopped);
    let failed = m.alice.show("first").await;
    assert_eq!(failed.state, SessionState::Failed);
    assert_eq!(
        failed.reason,
        "container exited with code 137 (out of memory: raise the memory limit or use less)"
    );
    let states: Vec<_> = failed.transitions.iter().map(|t| t.to).collect();
    assert_eq!(
        states,
        [
            SessionState::Pending,
            SessionState::Starting,
            SessionState::Waiting,
            SessionState::Failed
        ]
    );
    let second = m.bob.wait_for("second", SessionState::Starting).await;
    assert_eq!(second.node.as_ref().map(NodeName::as_str), Some("node1"));

    // The agent cannot create Bob's container: FAILED with the agent's words.
    let missing_image = "image ongrid/dev:latest is not on node1: ask your admin to build it";
    m.node1
        .sync(
            "node1",
            gpus.clone(),
            vec![container(
                &second,
                ContainerState::Missing,
                Some(missing_image),
            )],
        )
        .await;
    let second = m.bob.show("second").await;
    assert_eq!(second.state, SessionState::Failed);
    assert_eq!(second.reason, missing_image);

    // A FAILED session still holds its name until removed.
    let err = m
        .bob
        .fails(
            StatusCode::CONFLICT,
            m.bob.post(
                "/v1/sessions",
                &CreateSession {
                    name: Some(SessionName::parse("second").unwrap()),
                    gpus: one_gpu(),
                    image: None,
                    idle_timeout_secs: None,
                    max_duration_secs: None,
                    reservation: None,
                },
            ),
        )
        .await;
    assert!(
        err.error.message.contains("(FAILED)"),
        "{}",
        err.error.message
    );

    // Deleting a session frees its GPU for the next one.
    let third = m.alice.create(Some("third"), one_gpu()).await;
    m.alice.wait_for("third", SessionState::Starting).await;
    let fourth = m.bob.create(Some("fourth"), one_gpu()).await;
    assert_eq!(fourth.queue_position, Some(1));
    let _: SessionView = m
        .alice
        .ok(
            StatusCode::OK,
            m.alice.delete(&format!("/v1/sessions/{}", third.name)),
        )
        .await;
    m.bob.wait_for("fourth", SessionState::Starting).await;

    m.stop().await;
}

#[tokio::test]
async fn agents_speak_only_for_their_own_node() {
    let site = Site::new();
    let m = site.start().await;
    let body = RegisterNode {
        node: NodeName::parse("node2").unwrap(),
        agent_version: "test".to_owned(),
        gpu_backend: "simulated".to_owned(),
        gpus: vec![a100(1)],
        stream_url: None,
        start_modes: Default::default(),
    };
    let err = m
        .node1
        .fails(
            StatusCode::FORBIDDEN,
            m.node1.post("/v1/agent/register", &body),
        )
        .await;
    assert_eq!(
        err.error.message,
        "this token belongs to node node1; it cannot speak for node node2"
    );
    let wrong = Api::new(site.client(None), m.addr).with_token("not-a-token-of-any-node");
    let err = wrong
        .fails(
            StatusCode::UNAUTHORIZED,
            wrong.post("/v1/agent/register", &body),
        )
        .await;
    assert_eq!(err.error.code, "unauthenticated");
    m.anonymous
        .fails(
            StatusCode::UNAUTHORIZED,
            m.anonymous.post("/v1/agent/sync", &body),
        )
        .await;
    // A user's certificate is not an agent's token.
    m.alice
        .fails(
            StatusCode::UNAUTHORIZED,
            m.alice.post("/v1/agent/register", &body),
        )
        .await;

    // Syncing before registering says what to do.
    let report = NodeReport {
        node: NodeName::parse("node2").unwrap(),
        gpus: vec![],
        containers: vec![],
        activity: Vec::new(),
        freezes: Vec::new(),
        jobs: Vec::new(),
    };
    let err = m
        .node2
        .fails(
            StatusCode::NOT_FOUND,
            m.node2.post("/v1/agent/sync", &report),
        )
        .await;
    assert!(
        err.error.message.contains("/v1/agent/register"),
        "{}",
        err.error.message
    );

    // GPU modes: admins only; a new GPU starts exclusive and keeps the admin's mode.
    m.node2.register("node2", vec![a100(7)]).await;
    let path = format!("/v1/gpus/{}/mode", a100(7).uuid);
    let shared = SetGpuMode {
        mode: GpuMode::Shared { max_sessions: 2 },
    };
    m.alice
        .fails(StatusCode::FORBIDDEN, m.alice.put(&path, &shared))
        .await;
    let view: GpuView = m
        .admin
        .ok(StatusCode::OK, m.admin.put(&path, &shared))
        .await;
    assert_eq!(view.mode, shared.mode);
    assert_eq!(view.free, 2);
    let err = m
        .admin
        .fails(
            StatusCode::BAD_REQUEST,
            m.admin.put(
                &path,
                &SetGpuMode {
                    mode: GpuMode::Shared { max_sessions: 1 },
                },
            ),
        )
        .await;
    assert!(
        err.error.message.contains("shared:N"),
        "{}",
        err.error.message
    );
    m.node2.register("node2", vec![a100(7)]).await;
    let nodes: Vec<NodeView> = m.alice.ok(StatusCode::OK, m.alice.get("/v1/nodes")).await;
    assert_eq!(nodes[0].gpus[0].mode, shared.mode);

    // Two sessions share it.
    let share = GpuRequest {
        sharing: Sharing::Shared,
        ..one_gpu()
    };
    m.alice.create(Some("a"), share).await;
    m.bob.create(Some("b"), share).await;
    m.alice.wait_for("a", SessionState::Starting).await;
    m.bob.wait_for("b", SessionState::Starting).await;
    let nodes: Vec<NodeView> = m.admin.ok(StatusCode::OK, m.admin.get("/v1/nodes")).await;
    assert_eq!(nodes[0].gpus[0].used, 2);
    assert_eq!(nodes[0].gpus[0].free, 0);
    assert_eq!(nodes[0].gpus[0].sessions.len(), 2, "admins see every name");

    m.stop().await;
}

#[tokio::test]
async fn certificates_decide_who_gets_in() {
    let site = Site::new();
    let m = site.start().await;

    // No certificate: the connection works, user routes say 401.
    let err = m
        .anonymous
        .fails(StatusCode::UNAUTHORIZED, m.anonymous.get("/v1/sessions"))
        .await;
    assert_eq!(err.error.code, "unauthenticated");
    m.anonymous
        .fails(StatusCode::UNAUTHORIZED, m.anonymous.get("/v1/whoami"))
        .await;

    // A certificate from a CA the site does not trust: the TLS handshake is refused.
    let error = m
        .stranger
        .get("/v1/whoami")
        .send()
        .await
        .expect_err("a certificate from an unknown CA must be refused");
    let chain = error_chain(&error);
    assert!(
        chain.contains("received fatal alert: UnknownCA"),
        "not a TLS refusal: {chain}"
    );

    m.stop().await;
}

#[tokio::test]
async fn a_restart_loses_nothing() {
    let site = Site::new();
    let m = site.start().await;
    m.node1.register("node1", vec![a100(1)]).await;
    m.alice.create(Some("kept"), one_gpu()).await;
    let placed = m.alice.wait_for("kept", SessionState::Starting).await;
    m.node1
        .sync(
            "node1",
            vec![a100(1)],
            vec![container(&placed, ContainerState::Running, None)],
        )
        .await;
    m.bob.create(Some("queued"), one_gpu()).await;
    let removed = m.bob.create(Some("gone"), one_gpu()).await;
    let _: SessionView = m
        .bob
        .ok(
            StatusCode::OK,
            m.bob.delete(&format!("/v1/sessions/{}", removed.name)),
        )
        .await;
    let path = format!("/v1/gpus/{}/mode", a100(1).uuid);
    let _: GpuView = m
        .admin
        .ok(
            StatusCode::OK,
            m.admin.put(
                &path,
                &SetGpuMode {
                    mode: GpuMode::Exclusive,
                },
            ),
        )
        .await;

    let before = snapshot(&m).await;
    assert_eq!(before.kept.state, SessionState::Waiting);
    assert_eq!(before.queued.state, SessionState::Pending);
    m.stop().await;

    let m = site.start().await;
    let after = snapshot(&m).await;
    assert_eq!(after.kept, before.kept);
    assert_eq!(after.queued, before.queued);
    assert_eq!(after.gone, before.gone);
    assert_eq!(after.all, before.all);
    assert_eq!(after.alice, before.alice);
    assert_eq!(after.bob, before.bob);
    assert_eq!(after.nodes.len(), 1);
    assert_eq!(after.nodes[0].gpus, before.nodes[0].gpus);
    assert_eq!(after.nodes[0].last_seen, before.nodes[0].last_seen);
    assert!(site.dir.path().join("manager.db").exists());

    // And it carries on: the agent syncs, the container still runs, nothing changes.
    let desired = m
        .node1
        .sync(
            "node1",
            vec![a100(1)],
            vec![container(&after.kept, ContainerState::Running, None)],
        )
        .await;
    assert_eq!(desired.sessions.len(), 1);
    assert_eq!(desired.sessions[0].session_id, after.kept.id);
    m.stop().await;
}

#[tokio::test]
async fn the_binary_checks_its_config_and_announces_its_address() {
    use std::io::BufRead;
    use std::process::{Command, Stdio};

    let site = Site::new();
    let binary = env!("CARGO_BIN_EXE_ongrid-manager");
    let config = &site.config.path;

    let check = Command::new(binary)
        .args(["--config", &path(config), "--check-config"])
        .output()
        .unwrap();
    assert!(
        check.status.success(),
        "{}",
        String::from_utf8_lossy(&check.stderr)
    );

    let bad = site.dir.path().join("bad.toml");
    let text = std::fs::read_to_string(config).unwrap();
    std::fs::write(&bad, text.replace("1 hour", "1 fortnight")).unwrap();
    let check = Command::new(binary)
        .args(["--config", &path(&bad), "--check-config"])
        .output()
        .unwrap();
    assert_eq!(check.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&check.stderr);
    assert!(
        stderr.contains("bad.toml") && stderr.contains("`node_timeout`"),
        "{stderr}"
    );

    // A missing CA directory is caught by --check-config too, naming the key.
    let no_cas = site.dir.path().join("no-cas.toml");
    std::fs::write(&no_cas, text.replace("/certificates", "/nowhere")).unwrap();
    let check = Command::new(binary)
        .args(["--config", &path(&no_cas), "--check-config"])
        .output()
        .unwrap();
    assert_eq!(check.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&check.stderr).contains("ca_dir"));

    // Started for real, with the listen address from the environment.
    let mut child = Command::new(binary)
        .args(["--config", &path(config)])
        .env("ONGRID_MANAGER_LISTEN", "127.0.0.1:0")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let line = tokio::task::spawn_blocking(move || {
        let mut line = String::new();
        std::io::BufReader::new(stdout)
            .read_line(&mut line)
            .unwrap();
        line
    })
    .await
    .unwrap();
    let addr: SocketAddr = line
        .trim()
        .strip_prefix("listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .parse()
        .unwrap();
    assert_ne!(addr.port(), 0);
    let alice = Api::new(site.client(Some(&site.alice_pem)), addr);
    let who: WhoAmI = alice.ok(StatusCode::OK, alice.get("/v1/whoami")).await;
    assert_eq!(who.dn.as_str(), ALICE);

    let killed = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let status = tokio::task::spawn_blocking(move || child.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "SIGTERM is a clean shutdown: {status}");
}

/// `--check-config` (and every start) checks what a grid target needs of this host, naming each
/// key and its fix at once: a command that is not there, an `output_dir` that does not exist,
/// an image store the mapped account cannot read (Apptainer reads the SIF as the account; a
/// root-only store passed every check before and failed only when a job ran). Once fixed it
/// passes; an `image_dir` this host does not have is a warning, since it may be mounted only
/// on the engine's nodes. The accounts' access is tested as the account, through `runuser`.
#[test]
fn check_config_names_what_a_grid_target_lacks_on_this_host() {
    use std::os::unix::fs::PermissionsExt;
    use std::process::Command;

    let uid = Command::new("id").arg("-u").output().unwrap().stdout;
    assert_eq!(
        String::from_utf8_lossy(&uid).trim(),
        "0",
        "this test switches to the account nobody with runuser: run the tests as root"
    );
    let site = Site::new();
    let d = site.dir.path();
    let base = std::fs::read_to_string(&site.config.path).unwrap();
    let images = d.join("images");
    std::fs::create_dir_all(images.join("sha256")).unwrap();
    std::fs::set_permissions(&images, std::fs::Permissions::from_mode(0o700)).unwrap();
    // Searchable by others, so that only the store's own mode decides.
    std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o711)).unwrap();
    let out = d.join("out");
    let check = |name: &str, sbatch: &str, image_dir: &Path| {
        let text = format!(
            "{base}\n[targets]\naccounts = [ {{ dn = \"{ALICE}\", account = \"nobody\" }} ]\n\
             [targets.slurm]\nsbatch = \"{sbatch}\"\nsqueue = \"true\"\nsacct = \"true\"\n\
             scancel = \"true\"\nimage_dir = \"{}\"\noutput_dir = \"{}\"\n",
            image_dir.display(),
            out.display()
        );
        let file = d.join(name);
        std::fs::write(&file, text).unwrap();
        let run = Command::new(env!("CARGO_BIN_EXE_ongrid-manager"))
            .args(["--config", &path(&file), "--check-config"])
            .output()
            .unwrap();
        (
            run.status.code(),
            String::from_utf8_lossy(&run.stderr).into_owned(),
        )
    };

    let missing = d.join("bin/sbatch");
    let (code, stderr) = check("wrong.toml", &path(&missing), &images);
    assert_eq!(code, Some(2), "{stderr}");
    for expected in [
        format!(
            "targets.slurm.sbatch: {} is not an executable file",
            missing.display()
        ),
        format!(
            "targets.slurm.output_dir: {} is not a directory on this host",
            out.display()
        ),
        format!(
            "targets.slurm.image_dir: account nobody cannot read {}",
            images.display()
        ),
    ] {
        assert!(stderr.contains(&expected), "{expected:?} not in: {stderr}");
    }

    std::fs::create_dir(&out).unwrap();
    std::fs::set_permissions(&out, std::fs::Permissions::from_mode(0o755)).unwrap();
    let (code, stderr) = check("root-only-output.toml", "true", &images);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "targets.slurm.output_dir: account nobody cannot write to {}",
            out.display()
        )),
        "{stderr}"
    );
    assert!(!stderr.contains("sbatch"), "{stderr}");

    std::fs::set_permissions(&out, std::fs::Permissions::from_mode(0o1777)).unwrap();
    std::fs::set_permissions(&images, std::fs::Permissions::from_mode(0o755)).unwrap();
    let (code, stderr) = check("right.toml", "true", &images);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(!stderr.contains("targets.slurm"), "{stderr}");

    let elsewhere = d.join("on-the-nodes-only");
    let (code, stderr) = check("elsewhere.toml", "true", &elsewhere);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "targets.slurm.image_dir: {} is not a directory on this host",
            elsewhere.display()
        )),
        "{stderr}"
    );
}

/// A create sent again with the same `Idempotency-Key` (its answer was lost: the manager went
/// away, and devctl asks another replica) answers with the session the first one made, though
/// the first one's session now takes the user's GPU and name; another key, or another user's
/// same key, is another request. A malformed key is refused.
#[tokio::test]
async fn a_create_sent_again_with_its_idempotency_key_answers_with_the_first_ones_session() {
    let site = Site::new();
    let m = site.start().await;
    m.node1.register("node1", vec![a100(1)]).await;
    let body = CreateSession {
        name: Some(SessionName::parse("train1").unwrap()),
        gpus: one_gpu(),
        image: None,
        idle_timeout_secs: None,
        max_duration_secs: None,
        reservation: None,
    };
    let send = |api: &Api, key: &str| {
        api.post("/v1/sessions", &body)
            .header("Idempotency-Key", key.to_owned())
    };
    let key = "5f1c2d0e-8a7b-4c3d-9e8f-0a1b2c3d4e5f";
    let first: SessionView = m.alice.ok(StatusCode::CREATED, send(&m.alice, key)).await;
    let again: SessionView = m.alice.ok(StatusCode::CREATED, send(&m.alice, key)).await;
    assert_eq!(again.id, first.id);
    assert_eq!(m.alice.list("").await.len(), 1, "one session, not two");
    // Without the key, the same body is a second request: its name is taken.
    let err = m
        .alice
        .fails(StatusCode::CONFLICT, m.alice.post("/v1/sessions", &body))
        .await;
    assert!(
        err.error
            .message
            .contains("already have a session named train1"),
        "{}",
        err.error.message
    );
    // Bob's request with Alice's key is his own.
    let bobs: SessionView = m.bob.ok(StatusCode::CREATED, send(&m.bob, key)).await;
    assert_ne!(bobs.id, first.id);
    let err = m
        .alice
        .fails(StatusCode::BAD_REQUEST, send(&m.alice, "not a key!"))
        .await;
    assert!(
        err.error.message.contains("idempotency-key header"),
        "{}",
        err.error.message
    );
    m.stop().await;
}

struct Snapshot {
    kept: SessionView,
    queued: SessionView,
    gone: SessionView,
    all: Vec<SessionView>,
    alice: WhoAmI,
    bob: WhoAmI,
    nodes: Vec<NodeView>,
}

async fn snapshot(m: &Running) -> Snapshot {
    Snapshot {
        kept: m.alice.show("kept").await,
        queued: m.bob.show("queued").await,
        gone: m.bob.show("gone").await,
        all: m.admin.list("?all=true").await,
        alice: m.alice.ok(StatusCode::OK, m.alice.get("/v1/whoami")).await,
        bob: m.bob.ok(StatusCode::OK, m.bob.get("/v1/whoami")).await,
        nodes: m.admin.ok(StatusCode::OK, m.admin.get("/v1/nodes")).await,
    }
}

fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut out = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        out.push_str(": ");
        out.push_str(&cause.to_string());
        source = cause.source();
    }
    out
}

fn urlencode(value: &str) -> String {
    value
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

#[tokio::test]
async fn a_whole_gpu_is_never_shared_even_after_its_mode_changes() {
    let site = Site::new();
    let m = site.start().await;
    m.node1.register("node1", vec![a100(1)]).await;
    let whole = m.alice.create(Some("whole"), one_gpu()).await;
    assert_eq!(whole.state, SessionState::Starting);

    // The admin turns the occupied GPU into a shared one.
    let path = format!("/v1/gpus/{}/mode", a100(1).uuid);
    let mode = SetGpuMode {
        mode: GpuMode::Shared { max_sessions: 4 },
    };
    let view: GpuView = m.admin.ok(StatusCode::OK, m.admin.put(&path, &mode)).await;
    assert_eq!(view.free, 0, "Alice asked for the whole GPU: it stays full");

    // A session content with a share waits until Alice's leaves.
    let share = GpuRequest {
        sharing: Sharing::Shared,
        ..one_gpu()
    };
    let shared = m.bob.create(Some("share"), share).await;
    assert_eq!(shared.state, SessionState::Pending);
    let _: SessionView = m
        .alice
        .ok(StatusCode::OK, m.alice.delete("/v1/sessions/whole"))
        .await;
    m.bob.wait_for("share", SessionState::Starting).await;
    m.stop().await;
}

// SSH keys, institutes, the gateway's routes and the audit log.

// Made with ssh-keygen (OpenSSH 9.2); fingerprints as `ssh-keygen -l` printed them.
const KEY_A: &str =
    "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIIs0Rx6fnjvHHuZiVBU9tDldTJLHwhaBajt5VxhThYaf a@laptop";
const KEY_A_FP: &str = "SHA256:FMdHV0bU+9XlaPjjJLAHWoiOLovS2CpdtRPnTxXxb9U";
const KEY_B: &str =
    "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIFnUoydclnTq3QyHiXlXitZnZ3Qj7/kkmT1u3EhQYco8 b@laptop";
const KEY_B_FP: &str = "SHA256:oQz+mZPg4WXWwKKqJ3pdzDyGMWBXnavj1/EMe2Rp4Ic";
const KEY_C: &str =
    "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIFunBqqyyw/KZanROIaWaG1oFf0Yz93okgDEPgIjIMeu c@laptop";
const KEY_C_FP: &str = "SHA256:HqNoeiTwLrbMSHMzPFaaXi6H+H46T3zdIU9/qzQPzhY";
const KEY_ECDSA: &str = "ecdsa-sha2-nistp256 AAAAE2VjZHNhLXNoYTItbmlzdHAyNTYAAAAIbmlzdHAyNTYAAABBBE4D80FoKsrIcz9Z6BHzO7tC2vTLKUpjVybrQm9CheJBetZbULbvPzwFy10ziJ5cm67iHK/hoLv7VW5L/+CCyrM= p256@laptop";
const KEY_ECDSA_FP: &str = "SHA256:ynvezT+yxjEoFlToVZ+Mk/HTrmRrTbvWFSfEdltJI5E";
const KEY_RSA_1024: &str = "ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAAAgQCxVktU6sXh8jMLYoq/PFqgOWb2soMFSzr+BIFw5bFuKooBXCKuXBF7O+Mn3x/o2wVmKIwvkqzCNCmPxuvHwfj5gOdlKj+NNYzdDyPZuejmDlWJpf6IHneNQHJhdG1/opNJthvcqjJKcbeN3mb+Gm+3pH/Fg/iyqdD8v66EUc8JbQ== r1024@laptop";
const KEY_DSA: &str = "ssh-dss AAAAB3NzaC1kc3MAAACBAPu15W+zZ6hRcJwkqCq4J7GTZgqIVcFlum70XhBR4DxDXmcTL9O+pH4wzMO+k2ckhheJXzuKGCceMcGtFIZgIG4ggmoagAuPR4gAR0yJGlJJjRbu2ZZvWHhIr2VBawiwtx9ewxkNxiFPtot5gL1QzXHhRZrzYFUpPPbqGQUREzXxAAAAFQCY7GG3Ltxwn50cLnxfqgwhXpWayQAAAIEAqA2gJ3/nndl1+gbnIhsuUflczm2cgxzL7gt3gg63nTnlOdbLmDe1ZwIhP9SAWzTmetG/59Vck38X2jZcp1SuAHj3FTD1Xlhm5WXDoElolV5Xr5z8ZId3uAOqtg46QrrSFjpkdeepJfYLTZTHBLkQxH88nwaWbHCUluv2gxNYSc0AAACAIKLdoPGU9D4GNYLW/XeMmkpHm1sCaT8E7gYB/CKajP7nxCNaK8rNnMNCHg868dt8opmzoPk4vq4mMzdXyKkqj0IVk3kosn3lAyXR5R0wKT0zOMRnPTWX6q+EIQHEo7G+ef0+3otKdh7cYck2s2K0TEqpLZDwzsGjOInAJ3yHqhA= d@laptop";
const KEY_CERT: &str = "ssh-ed25519-cert-v01@openssh.com AAAAIHNzaC1lZDI1NTE5LWNlcnQtdjAxQG9wZW5zc2guY29tAAAAIKNLCR5H0dgwsWE+xhy4Dbqwe3r53H7lE25Oj0qduMj9AAAAIIs0Rx6fnjvHHuZiVBU9tDldTJLHwhaBajt5VxhThYafAAAAAAAAAAAAAAABAAAABHRlc3QAAAAJAAAABWFsaWNlAAAAAAAAAAD//////////wAAAAAAAACCAAAAFXBlcm1pdC1YMTEtZm9yd2FyZGluZwAAAAAAAAAXcGVybWl0LWFnZW50LWZvcndhcmRpbmcAAAAAAAAAFnBlcm1pdC1wb3J0LWZvcndhcmRpbmcAAAAAAAAACnBlcm1pdC1wdHkAAAAAAAAADnBlcm1pdC11c2VyLXJjAAAAAAAAAAAAAAAzAAAAC3NzaC1lZDI1NTE5AAAAICGWRcCmk+5eNzbpvYttr66MPmXNXj5G6XDRi4UcdtXEAAAAUwAAAAtzc2gtZWQyNTUxOQAAAED+sg1quRm4I+nsGCqJUqkIx/D1hHIZTd/Wl4jITdvKmaYO2N3YQd4h6i4RHvx2Y8bp0zmmEiLT2MHKQnginuoJ a@laptop";

/// An Ed25519 public key line made of `n` (valid as far as parsing goes; nobody holds its
/// private key).
fn synthetic_key(n: u8) -> String {
    use russh::keys::ssh_key::public::{Ed25519PublicKey, KeyData};
    russh::keys::PublicKey::new(KeyData::Ed25519(Ed25519PublicKey([n; 32])), "synthetic")
        .to_openssh()
        .unwrap()
}

fn add_key(public_key: &str) -> AddKey {
    AddKey {
        public_key: public_key.to_owned(),
    }
}

#[tokio::test]
async fn ssh_keys_are_bound_to_the_certificate_that_added_them() {
    let site = Site::new();
    let m = site.start().await;

    // Alice's long-lived certificate: the key expires with it (rcgen's default notAfter).
    let key: KeyView = m
        .alice
        .ok(
            StatusCode::CREATED,
            m.alice.post("/v1/keys", &add_key(KEY_A)),
        )
        .await;
    assert_eq!(key.fingerprint, KEY_A_FP);
    assert_eq!(key.algorithm, "ssh-ed25519");
    assert_eq!(key.comment, "a@laptop");
    assert_eq!(key.owner.as_str(), ALICE);
    assert_eq!(key.expires_at.to_rfc3339(), "4096-01-01T00:00:00+00:00");

    // Adding it again with her short-lived certificate renews it to that certificate's end.
    let renewed: KeyView = m
        .alice_short
        .ok(
            StatusCode::OK,
            m.alice_short.post("/v1/keys", &add_key(KEY_A)),
        )
        .await;
    assert_eq!(renewed.expires_at, site.short_expiry);
    assert_eq!(renewed.added_at, key.added_at);

    // The same key for Bob is a conflict that says what to do.
    let err = m
        .bob
        .fails(
            StatusCode::CONFLICT,
            m.bob.post("/v1/keys", &add_key(KEY_A)),
        )
        .await;
    assert_eq!(
        err.error.message,
        format!(
            "key {KEY_A_FP} is registered to another user: make a key of your own with \
             `ssh-keygen -t ed25519` and add it"
        )
    );

    // Keys that are refused, each with what to do.
    let private = "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAABG5vbmU=\n-----END OPENSSH PRIVATE KEY-----\n";
    for (text, expected) in [
        (KEY_DSA, "DSA keys (ssh-dss) are too weak"),
        (
            KEY_RSA_1024,
            "this RSA key has 1024 bits, fewer than the 2048 required",
        ),
        (
            KEY_CERT,
            "SSH certificates (ssh-ed25519-cert-v01@openssh.com) are not accepted",
        ),
        (
            private,
            "this is a private key, which must never leave your machine",
        ),
        ("ssh-ed25519 AAAA-not-base64", "not an OpenSSH public key"),
        ("", "the public key is empty"),
    ] {
        let err = m
            .alice
            .fails(
                StatusCode::BAD_REQUEST,
                m.alice.post("/v1/keys", &add_key(text)),
            )
            .await;
        assert_eq!(err.error.code, "bad_request");
        assert!(
            err.error.message.starts_with(expected),
            "{}",
            err.error.message
        );
    }

    let ecdsa: KeyView = m
        .alice
        .ok(
            StatusCode::CREATED,
            m.alice.post("/v1/keys", &add_key(KEY_ECDSA)),
        )
        .await;
    assert_eq!(ecdsa.fingerprint, KEY_ECDSA_FP);
    let bobs: KeyView = m
        .bob
        .ok(StatusCode::CREATED, m.bob.post("/v1/keys", &add_key(KEY_B)))
        .await;
    assert_eq!(bobs.fingerprint, KEY_B_FP);

    // Listing: own keys; everyone's for admins only.
    let fingerprints =
        |keys: Vec<KeyView>| -> Vec<String> { keys.into_iter().map(|k| k.fingerprint).collect() };
    let mine: Vec<KeyView> = m.alice.ok(StatusCode::OK, m.alice.get("/v1/keys")).await;
    assert_eq!(fingerprints(mine), [KEY_A_FP, KEY_ECDSA_FP]);
    let bobs: Vec<KeyView> = m.bob.ok(StatusCode::OK, m.bob.get("/v1/keys")).await;
    assert_eq!(fingerprints(bobs), [KEY_B_FP]);
    m.bob
        .fails(StatusCode::FORBIDDEN, m.bob.get("/v1/keys?all=true"))
        .await;
    let all: Vec<KeyView> = m
        .admin
        .ok(StatusCode::OK, m.admin.get("/v1/keys?all=true"))
        .await;
    assert_eq!(all.len(), 3);

    // Removal: a user only their own (someone else's is "not found"); admins any.
    let remove = |fingerprint: &str| format!("/v1/keys?fingerprint={}", urlencode(fingerprint));
    let err = m
        .bob
        .fails(StatusCode::NOT_FOUND, m.bob.delete(&remove(KEY_A_FP)))
        .await;
    assert_eq!(
        err.error.message,
        format!("you have no key {KEY_A_FP}: list yours with `devctl key ls`")
    );
    let removed: KeyView = m
        .alice
        .ok(StatusCode::OK, m.alice.delete(&remove(KEY_A_FP)))
        .await;
    assert_eq!(removed.fingerprint, KEY_A_FP);
    m.alice
        .fails(StatusCode::NOT_FOUND, m.alice.delete(&remove(KEY_A_FP)))
        .await;
    let by_admin: KeyView = m
        .admin
        .ok(StatusCode::OK, m.admin.delete(&remove(KEY_B_FP)))
        .await;
    assert_eq!(by_admin.owner.as_str(), BOB);
    let err = m
        .alice
        .fails(StatusCode::BAD_REQUEST, m.alice.delete("/v1/keys"))
        .await;
    assert!(
        err.error.message.contains("?fingerprint=SHA256:"),
        "{}",
        err.error.message
    );
    // Removed, Bob's key is free for Alice.
    let _: KeyView = m
        .alice
        .ok(
            StatusCode::CREATED,
            m.alice.post("/v1/keys", &add_key(KEY_B)),
        )
        .await;

    // At most 32 keys each (she has 2).
    for n in 0..30 {
        let _: KeyView = m
            .alice
            .ok(
                StatusCode::CREATED,
                m.alice.post("/v1/keys", &add_key(&synthetic_key(n))),
            )
            .await;
    }
    let err = m
        .alice
        .fails(
            StatusCode::CONFLICT,
            m.alice.post("/v1/keys", &add_key(&synthetic_key(99))),
        )
        .await;
    assert_eq!(
        err.error.message,
        "you already have 32 keys, the most allowed: remove one with `devctl key rm FINGERPRINT` \
         (see `devctl key ls`)"
    );
    // Renewing one of them is still allowed.
    let _: KeyView = m
        .alice
        .ok(
            StatusCode::OK,
            m.alice.post("/v1/keys", &add_key(&synthetic_key(7))),
        )
        .await;
    m.anonymous
        .fails(StatusCode::UNAUTHORIZED, m.anonymous.get("/v1/keys"))
        .await;
    m.stop().await;
}

fn institute(name: &str, cidrs: &[&str]) -> serde_json::Value {
    serde_json::json!({"name": name, "cidrs": cidrs})
}

#[tokio::test]
async fn admins_manage_institutes_and_the_gateway_sees_them() {
    let site = Site::new();
    let m = site.start().await;
    let lab = institute("uni-lab", &["10.5.0.0/16", "2001:db8::/32", "10.5.0.0/16"]);

    // Users may not.
    for request in [
        m.alice.get("/v1/institutes"),
        m.alice.post("/v1/institutes", &lab),
        m.alice.get("/v1/institutes/uni-lab"),
        m.alice.delete("/v1/institutes/uni-lab"),
        m.alice.get("/v1/audit"),
    ] {
        let err = m.alice.fails(StatusCode::FORBIDDEN, request).await;
        assert!(
            err.error.message.starts_with("only admins "),
            "{}",
            err.error.message
        );
    }

    let added: Institute = m
        .admin
        .ok(StatusCode::CREATED, m.admin.post("/v1/institutes", &lab))
        .await;
    let networks: Vec<String> = added.cidrs.iter().map(ToString::to_string).collect();
    assert_eq!(
        networks,
        ["10.5.0.0/16", "2001:db8::/32"],
        "each network once"
    );
    let err = m
        .admin
        .fails(StatusCode::CONFLICT, m.admin.post("/v1/institutes", &lab))
        .await;
    assert_eq!(
        err.error.message,
        "institute uni-lab already exists: to change its networks, remove it with \
         `devctl admin institute rm uni-lab` and add it again"
    );

    // Validation.
    let err = m
        .admin
        .fails(
            StatusCode::BAD_REQUEST,
            m.admin.post("/v1/institutes", &institute("cern.ch", &[])),
        )
        .await;
    assert!(
        err.error
            .message
            .starts_with("institute cern.ch needs at least one network"),
        "{}",
        err.error.message
    );
    let err = m
        .admin
        .fails(
            StatusCode::BAD_REQUEST,
            m.admin
                .post("/v1/institutes", &institute("cern.ch", &["10.1.2.3/16"])),
        )
        .await;
    assert!(
        err.error.message.contains("10.1.0.0/16"),
        "{}",
        err.error.message
    );
    let err = m
        .admin
        .fails(
            StatusCode::BAD_REQUEST,
            m.admin
                .post("/v1/institutes", &institute("CERN", &["192.0.2.0/24"])),
        )
        .await;
    assert!(
        err.error.message.contains("institute name"),
        "{}",
        err.error.message
    );
    let _: Institute = m
        .admin
        .ok(
            StatusCode::CREATED,
            m.admin
                .post("/v1/institutes", &institute("cern.ch", &["192.0.2.0/24"])),
        )
        .await;

    let listed: Vec<Institute> = m
        .admin
        .ok(StatusCode::OK, m.admin.get("/v1/institutes"))
        .await;
    let names: Vec<&str> = listed.iter().map(|i| i.name.as_str()).collect();
    assert_eq!(names, ["cern.ch", "uni-lab"]);
    let shown: Institute = m
        .admin
        .ok(StatusCode::OK, m.admin.get("/v1/institutes/uni-lab"))
        .await;
    assert_eq!(shown, added);
    let err = m
        .admin
        .fails(StatusCode::NOT_FOUND, m.admin.get("/v1/institutes/nowhere"))
        .await;
    assert_eq!(
        err.error.message,
        "no institute named nowhere: list them with `devctl admin institute ls`"
    );
    m.admin
        .fails(
            StatusCode::BAD_REQUEST,
            m.admin.get("/v1/institutes/No%20Such"),
        )
        .await;

    // The gateway's view changes as soon as the admin's does.
    let allowlist: Allowlist = m
        .gateway
        .ok(StatusCode::OK, m.gateway.get("/v1/gateway/allowlist"))
        .await;
    let ip = |s: &str| s.parse::<IpAddr>().unwrap();
    assert_eq!(
        allowlist
            .institute_of(ip("10.5.3.4"))
            .map(InstituteName::as_str),
        Some("uni-lab")
    );
    assert_eq!(
        allowlist
            .institute_of(ip("2001:db8::7"))
            .map(InstituteName::as_str),
        Some("uni-lab")
    );
    let removed: Institute = m
        .admin
        .ok(StatusCode::OK, m.admin.delete("/v1/institutes/uni-lab"))
        .await;
    assert_eq!(removed, added);
    m.admin
        .fails(
            StatusCode::NOT_FOUND,
            m.admin.delete("/v1/institutes/uni-lab"),
        )
        .await;
    let allowlist: Allowlist = m
        .gateway
        .ok(StatusCode::OK, m.gateway.get("/v1/gateway/allowlist"))
        .await;
    assert_eq!(allowlist.institute_of(ip("10.5.3.4")), None);
    assert_eq!(allowlist.institutes.len(), 1);
    m.stop().await;
}

#[tokio::test]
async fn gateway_routes_need_the_gateway_token() {
    let site = Site::new();
    let m = site.start().await;
    let wrong = Api::new(site.client(None), m.addr).with_token("not-the-gateway-token-at-all");
    for (caller, expected) in [
        (
            &m.anonymous,
            "gateway routes need `Authorization: Bearer <gateway token>`",
        ),
        (
            &m.alice,
            "gateway routes need `Authorization: Bearer <gateway token>`",
        ),
        (&wrong, "wrong gateway token"),
        (&m.node1, "wrong gateway token"),
    ] {
        let err = caller
            .fails(
                StatusCode::UNAUTHORIZED,
                caller.get("/v1/gateway/allowlist"),
            )
            .await;
        assert_eq!(err.error.code, "unauthenticated");
        assert!(
            err.error.message.starts_with(expected),
            "{}",
            err.error.message
        );
        let check = KeyCheck {
            public_key: KEY_A.to_owned(),
            source: ip_v4(192, 0, 2, 7),
            login: "alice".to_owned(),
        };
        caller
            .fails(
                StatusCode::UNAUTHORIZED,
                caller.post("/v1/gateway/authorize", &check),
            )
            .await;
    }
    // The gateway's token is not an agent's.
    m.gateway
        .fails(
            StatusCode::UNAUTHORIZED,
            m.gateway.post("/v1/agent/sync", &serde_json::json!({})),
        )
        .await;
    m.stop().await;

    // Without gateway_token_file the routes are off, and say so.
    let mut config = site.config.clone();
    config.gateway_token_file = None;
    let m = site.start_with(config, None).await;
    let err = m
        .gateway
        .fails(
            StatusCode::UNAUTHORIZED,
            m.gateway.get("/v1/gateway/allowlist"),
        )
        .await;
    assert_eq!(
        err.error.message,
        "gateway routes are not enabled on this manager: set gateway_token_file in its config to \
         the gateway's token"
    );
    m.stop().await;

    // A gateway token that is also a node's token is refused at start-up.
    std::fs::write(site.dir.path().join("gateway-token"), NODE2_TOKEN).unwrap();
    let Err(err) = ongrid_manager::prepare(site.config.clone()) else {
        panic!("a gateway token shared with node2 must be refused");
    };
    assert!(
        err.to_string().contains("holds node node2's agent token"),
        "{err}"
    );
}

fn ip_v4(a: u8, b: u8, c: u8, d: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(a, b, c, d))
}

impl Api {
    async fn route(&self, owner: &str, target: &str) -> (StatusCode, String) {
        let request = RouteRequest {
            owner: Dn::parse(owner).unwrap(),
            target: target.to_owned(),
        };
        self.send(self.post("/v1/gateway/route", &request)).await
    }

    async fn routed(&self, owner: &str, target: &str) -> Route {
        let (status, body) = self.route(owner, target).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        serde_json::from_str(&body).unwrap()
    }

    /// The refusal's status and message.
    async fn refused(&self, owner: &str, target: &str) -> (StatusCode, String) {
        let (status, body) = self.route(owner, target).await;
        assert!(!status.is_success(), "{body}");
        let body: ErrorBody = serde_json::from_str(&body).unwrap();
        (status, body.error.message)
    }

    async fn authorize(&self, public_key: &str) -> (StatusCode, String) {
        let check = KeyCheck {
            public_key: public_key.to_owned(),
            source: ip_v4(192, 0, 2, 7),
            login: "train1".to_owned(),
        };
        self.send(self.post("/v1/gateway/authorize", &check)).await
    }

    async fn connection(&self, event: &ConnectionEvent) {
        let (status, body) = self.send(self.post("/v1/gateway/connections", event)).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        let deadlines: ongrid_core::holds::SessionDeadlines = serde_json::from_str(&body).unwrap();
        assert_eq!(deadlines.session_id, event.session_id);
    }
}

fn message(body: &str) -> String {
    serde_json::from_str::<ErrorBody>(body)
        .unwrap()
        .error
        .message
}

#[tokio::test]
async fn the_gateway_authorizes_keys_and_routes_to_running_sessions() {
    let site = Site::new();
    let clock = Arc::new(ManualClock::new(Utc::now()));
    let m = site
        .start_with(site.config.clone(), Some(clock.clone()))
        .await;
    let gw = &m.gateway;

    // Keys: unknown, known (with the owner's login), and later expired.
    let _: KeyView = m
        .alice_short
        .ok(
            StatusCode::CREATED,
            m.alice_short.post("/v1/keys", &add_key(KEY_A)),
        )
        .await;
    let (status, body) = gw.authorize(KEY_C).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert_eq!(
        message(&body),
        format!("key {KEY_C_FP} is not registered: add it with `devctl key add`")
    );
    // The gateway passes the key as offered: without a comment.
    let (status, body) = gw.authorize(KEY_A.trim_end_matches(" a@laptop")).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let owner: KeyOwner = serde_json::from_str(&body).unwrap();
    assert_eq!(owner.owner.as_str(), ALICE);
    assert_eq!(owner.user_name.as_str(), "alice-smith");
    assert_eq!(owner.fingerprint, KEY_A_FP);
    assert_eq!(owner.expires_at, site.short_expiry);
    let (status, _) = gw.authorize("not a key").await;
    assert_eq!(status, StatusCode::BAD_REQUEST);

    // No session yet.
    assert_eq!(
        gw.refused(ALICE, "alice-smith").await,
        (
            StatusCode::NOT_FOUND,
            "you have no session: start one with `devctl session new`".to_owned()
        )
    );

    // Agents must give a wss:// stream endpoint, if any.
    let body = RegisterNode {
        node: NodeName::parse("node1").unwrap(),
        agent_version: "test".to_owned(),
        gpu_backend: "simulated".to_owned(),
        gpus: vec![a100(1)],
        stream_url: Some("ws://node1.test:8444".to_owned()),
        start_modes: Default::default(),
    };
    let err = m
        .node1
        .fails(
            StatusCode::BAD_REQUEST,
            m.node1.post("/v1/agent/register", &body),
        )
        .await;
    assert!(
        err.error.message.contains("must start with wss://"),
        "{}",
        err.error.message
    );

    // node1 has streams; node2 (registered later) has none.
    m.node1
        .register_streams("node1", vec![a100(1)], Some("wss://node1.test:8444"))
        .await;
    let train1 = m.alice.create(Some("train1"), one_gpu()).await;
    assert_eq!(train1.state, SessionState::Starting);
    assert_eq!(
        gw.refused(ALICE, "train1").await,
        (
            StatusCode::CONFLICT,
            "session train1 is starting: try again in a few seconds".to_owned()
        )
    );
    m.node1
        .sync(
            "node1",
            vec![a100(1)],
            vec![container(&train1, ContainerState::Running, None)],
        )
        .await;
    let route = gw.routed(ALICE, "train1").await;
    assert_eq!(route.session_id, train1.id);
    assert_eq!(route.session_name.as_str(), "train1");
    assert_eq!(route.state, SessionState::Waiting);
    assert_eq!(route.node.as_str(), "node1");
    assert_eq!(route.container, train1.id.container_name());
    assert_eq!(route.agent_url, "wss://node1.test:8444");
    // Her only session: any name reaches it.
    assert_eq!(gw.routed(ALICE, "alice-smith").await.session_id, train1.id);

    // Bob never reaches Alice's session, whatever the name.
    assert_eq!(
        gw.refused(BOB, "train1").await.1,
        "you have no session: start one with `devctl session new`"
    );

    // A second session waits for a GPU: names are needed now.
    clock.advance(TimeDelta::seconds(1));
    let exp2 = m.alice.create(Some("exp2"), one_gpu()).await;
    assert_eq!(exp2.state, SessionState::Pending);
    assert_eq!(
        gw.refused(ALICE, "alice-smith").await,
        (
            StatusCode::NOT_FOUND,
            "you have several sessions (train1 WAITING, exp2 PENDING): connect with \
             ssh <name>@<this gateway>"
                .to_owned()
        )
    );
    assert_eq!(
        gw.refused(ALICE, "exp2").await,
        (
            StatusCode::CONFLICT,
            "session exp2 is PENDING, number 1 in the queue: it starts once the scheduler \
             gives it a GPU (devctl session show exp2)"
                .to_owned()
        )
    );
    assert_eq!(gw.routed(ALICE, "train1").await.session_id, train1.id);

    // Placed on node2, whose agent has no [streams].
    m.node2.register("node2", vec![a100(2)]).await;
    let exp2 = m.alice.wait_for("exp2", SessionState::Starting).await;
    m.node2
        .sync(
            "node2",
            vec![a100(2)],
            vec![container(&exp2, ContainerState::Running, None)],
        )
        .await;
    let (status, text) = gw.refused(ALICE, "exp2").await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert!(
        text.starts_with(
            "session exp2 runs on node node2, whose agent has no [streams] configured"
        ),
        "{text}"
    );

    // Its container dies: FAILED, with the reason and the fix.
    let died = ContainerState::Exited {
        exit_code: 1,
        oom_killed: false,
        error: Some("segfault".to_owned()),
    };
    m.node2
        .sync("node2", vec![a100(2)], vec![container(&exp2, died, None)])
        .await;
    assert_eq!(
        gw.refused(ALICE, "exp2").await,
        (
            StatusCode::CONFLICT,
            "session exp2 FAILED (container exited with code 1: segfault): remove it with \
             `devctl session rm exp2` and start a new one"
                .to_owned()
        )
    );
    // A FAILED session does not stand in the way of the live one.
    assert_eq!(gw.routed(ALICE, "alice-smith").await.session_id, train1.id);

    // Connections: WAITING → CONNECTED → (one of two closes) → IDLE → CONNECTED.
    let event = |n: u128, kind: ConnectionEventKind, bytes: (u64, u64)| ConnectionEvent {
        connection_id: uuid::Uuid::from_u128(n),
        event: kind,
        at: clock.now(),
        owner: Dn::parse(ALICE).unwrap(),
        fingerprint: KEY_A_FP.to_owned(),
        source: "::ffff:192.0.2.7".parse().unwrap(),
        institute: InstituteName::parse("uni-lab").unwrap(),
        session_id: train1.id,
        bytes_in: bytes.0,
        bytes_out: bytes.1,
        close_reason: None,
    };
    gw.connection(&event(1, ConnectionEventKind::Open, (0, 0)))
        .await;
    let shown = m.alice.show("train1").await;
    assert_eq!(shown.state, SessionState::Connected);
    assert_eq!(shown.reason, "SSH connection from 192.0.2.7 (uni-lab)");
    clock.advance(TimeDelta::minutes(1));
    gw.connection(&event(2, ConnectionEventKind::Open, (0, 0)))
        .await;
    clock.advance(TimeDelta::minutes(1));
    gw.connection(&event(1, ConnectionEventKind::Close, (1200, 34_000)))
        .await;
    assert_eq!(m.alice.show("train1").await.state, SessionState::Connected);
    assert_eq!(
        gw.routed(ALICE, "train1").await.state,
        SessionState::Connected
    );
    clock.advance(TimeDelta::minutes(1));
    gw.connection(&event(2, ConnectionEventKind::Close, (5, 6)))
        .await;
    let idle = m.alice.show("train1").await;
    assert_eq!(idle.state, SessionState::Idle);
    assert_eq!(idle.reason, "last SSH connection closed");
    assert_eq!(gw.routed(ALICE, "train1").await.state, SessionState::Idle);
    clock.advance(TimeDelta::minutes(1));
    gw.connection(&event(3, ConnectionEventKind::Open, (0, 0)))
        .await;
    let again = m.alice.show("train1").await;
    assert_eq!(again.state, SessionState::Connected);
    let states: Vec<_> = again.transitions.iter().map(|t| t.to).collect();
    assert_eq!(
        states,
        [
            SessionState::Pending,
            SessionState::Starting,
            SessionState::Waiting,
            SessionState::Connected,
            SessionState::Idle,
            SessionState::Connected
        ]
    );

    // Events the gateway gets wrong.
    let mut unknown = event(4, ConnectionEventKind::Open, (0, 0));
    unknown.session_id = ongrid_core::SessionId::new_random();
    let (status, _) = gw.send(gw.post("/v1/gateway/connections", &unknown)).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let mut not_hers = event(4, ConnectionEventKind::Open, (0, 0));
    not_hers.owner = Dn::parse(BOB).unwrap();
    let (status, body) = gw.send(gw.post("/v1/gateway/connections", &not_hers)).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");

    // HELD (the hold policy comes later; the store puts it there here).
    let store = ongrid_manager::store::SqliteStore::open(&site.config.database)
        .await
        .unwrap();
    {
        use ongrid_manager::domain::sessions::{Change, Placement};
        use ongrid_manager::store::Store;
        store
            .transition(
                train1.id,
                Change {
                    to: SessionState::Held,
                    at: clock.now(),
                    reason: "idle for 20 minutes".to_owned(),
                    hold: None,
                    placement: Placement::Keep,
                },
            )
            .await
            .unwrap();
    }
    store.close().await;
    assert_eq!(
        gw.refused(ALICE, "alice-smith").await,
        (
            StatusCode::CONFLICT,
            "session train1 is HELD (idle for 20 minutes): run `devctl session release train1`"
                .to_owned()
        )
    );
    // Connection 3 closes while HELD: recorded, the state stays.
    gw.connection(&event(3, ConnectionEventKind::Close, (9, 9)))
        .await;
    assert_eq!(m.alice.show("train1").await.state, SessionState::Held);

    // The audit log: newest first, by user, since a time or a duration ago.
    let audit = |query: &str| m.admin.get(&format!("/v1/audit{query}"));
    let log: Vec<AuditRecord> = m.admin.ok(StatusCode::OK, audit("")).await;
    let ids: Vec<u128> = log.iter().map(|r| r.connection_id.as_u128()).collect();
    assert_eq!(ids, [3, 2, 1]);
    let first = &log[2];
    assert_eq!(first.owner.as_str(), ALICE);
    assert_eq!(first.fingerprint, KEY_A_FP);
    assert_eq!(first.source, ip_v4(192, 0, 2, 7));
    assert_eq!(first.institute.as_str(), "uni-lab");
    assert_eq!(first.session_name.as_str(), "train1");
    assert_eq!(
        first.closed_at.unwrap() - first.opened_at,
        TimeDelta::minutes(2)
    );
    assert_eq!((first.bytes_in, first.bytes_out), (1200, 34_000));
    let alices: Vec<AuditRecord> = m
        .admin
        .ok(
            StatusCode::OK,
            audit(&format!("?user={}", urlencode(ALICE))),
        )
        .await;
    assert_eq!(alices.len(), 3);
    let bobs: Vec<AuditRecord> = m
        .admin
        .ok(StatusCode::OK, audit(&format!("?user={}", urlencode(BOB))))
        .await;
    assert!(bobs.is_empty());
    // Connection 1 closed 3 minutes ago (by the manager's clock), 2 and 3 later.
    clock.advance(TimeDelta::minutes(1));
    let recent: Vec<AuditRecord> = m
        .admin
        .ok(StatusCode::OK, audit("?since=150%20seconds"))
        .await;
    let ids: Vec<u128> = recent.iter().map(|r| r.connection_id.as_u128()).collect();
    assert_eq!(ids, [3, 2]);
    let since =
        (clock.now() - TimeDelta::seconds(90)).to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    let recent: Vec<AuditRecord> = m
        .admin
        .ok(
            StatusCode::OK,
            audit(&format!("?since={}", urlencode(&since))),
        )
        .await;
    assert_eq!(recent.len(), 1);
    let err = m
        .admin
        .fails(StatusCode::BAD_REQUEST, audit("?since=yesterday"))
        .await;
    assert!(
        err.error.message.contains("\"2 hours\""),
        "{}",
        err.error.message
    );
    m.admin
        .fails(StatusCode::BAD_REQUEST, audit("?user=nobody"))
        .await;

    // Days later Alice's short certificate has expired, and so has her key.
    clock.advance(TimeDelta::days(4));
    let (status, body) = gw.authorize(KEY_A).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert_eq!(
        message(&body),
        format!(
            "key {KEY_A_FP} expired at {} with the proxy or certificate it was registered with: \
             renew your proxy (voms-proxy-init) and run `devctl key add` again",
            site.short_expiry.format("%Y-%m-%d %H:%M:%S UTC")
        )
    );
    m.stop().await;
}

/// Every request body people send refuses unknown fields and out-of-range values with a 400
/// that names the field; admins cannot add a network that can never match.
#[tokio::test]
async fn request_bodies_refuse_unknown_fields_and_out_of_range_values() {
    let site = Site::new();
    let m = site.start().await;
    m.node1.register("node1", vec![a100(1)]).await;
    let refused = |body: serde_json::Value, path: &'static str| {
        let api = if path.starts_with("/v1/institutes") || path.starts_with("/v1/gpus") {
            &m.admin
        } else {
            &m.alice
        };
        let request = if path.starts_with("/v1/gpus") {
            api.put(path, &body)
        } else {
            api.post(path, &body)
        };
        async move {
            let (status, text) = api.send(request).await;
            assert_eq!(status, StatusCode::BAD_REQUEST, "{path} {body}: {text}");
            message(&text)
        }
    };
    let cases: [(serde_json::Value, &str, &str); 9] = [
        (
            serde_json::json!({"name": "x", "evil": true}),
            "/v1/sessions",
            "evil",
        ),
        (
            serde_json::json!({"gpus": {"count": 1, "evil": 1}}),
            "/v1/sessions",
            "gpus",
        ),
        (serde_json::json!({"gpus": -1}), "/v1/sessions", "gpus"),
        (
            serde_json::json!({"gpus": {"count": -1, "sharing": "exclusive"}}),
            "/v1/sessions",
            "gpus.count",
        ),
        (
            serde_json::json!({"public_key": KEY_A, "admin": true}),
            "/v1/keys",
            "admin",
        ),
        (
            serde_json::json!({"session": "t", "reference": "m:1", "x": 1}),
            "/v1/images",
            "x",
        ),
        (
            serde_json::json!({"duration_secs": 60, "x": 1}),
            "/v1/sessions/dev/keep",
            "x",
        ),
        (
            serde_json::json!({"name": "lab", "cidrs": ["10.0.0.0/8"], "x": 1}),
            "/v1/institutes",
            "x",
        ),
        (
            serde_json::json!({"mode": "exclusive", "x": 1}),
            "/v1/gpus/GPU-00000000-0000-0000-0000-000000000001/mode",
            "x",
        ),
    ];
    for (body, path, field) in cases {
        let text = refused(body.clone(), path).await;
        assert!(text.contains(field), "{path} {body}: {text}");
    }
    let text = refused(
        serde_json::json!({"gpus": {"count": 0, "min_capability": null, "min_memory": null, "sharing": "exclusive"}}),
        "/v1/sessions",
    )
    .await;
    assert!(text.starts_with("gpus.count: "), "{text}");
    let text = refused(
        serde_json::json!({"name": "lab", "cidrs": ["::ffff:127.0.0.2/128"]}),
        "/v1/institutes",
    )
    .await;
    assert!(text.contains("write 127.0.0.2/32"), "{text}");
    assert!(m.alice.list("").await.is_empty(), "nothing was stored");
    m.stop().await;
}

/// Every body a person sends, valid but for one invented field beside the others, is refused
/// with a 400 naming that field; nothing of it is stored. One row per body type of
/// `ongrid_core::api` and of the handlers (the components' bodies, agent and gateway, stay lenient
/// across versions: the last rows show it).
#[tokio::test]
async fn every_request_body_refuses_an_unknown_field() {
    use ongrid_core::holds::{HoldRequest, KeepRequest};
    use ongrid_core::image::{CreateImage, ImageReference};
    use ongrid_core::reservation::{NewReservation, SetOwner};

    let site = Site::new();
    let m = site.start().await;
    m.node1.register("node1", vec![a100(1)]).await;
    let gpu = format!("/v1/gpus/{}", a100(1).uuid);
    let job = jobs::submit("mymodel:v1", false);
    let reservation = NewReservation {
        name: "night".to_owned(),
        group: "physics".to_owned(),
        gpus: vec![a100(1).uuid],
        node: None,
        from: Utc::now() + TimeDelta::hours(1),
        to: Utc::now() + TimeDelta::hours(2),
    };
    // (caller, method, path, a valid body, where the invented field goes: "" for the top).
    let rows: Vec<(&Api, reqwest::Method, String, serde_json::Value, &str)> = vec![
        (
            &m.alice,
            reqwest::Method::POST,
            "/v1/sessions".into(),
            value(&CreateSession {
                name: Some(SessionName::parse("dev").unwrap()),
                gpus: one_gpu(),
                image: None,
                idle_timeout_secs: None,
                max_duration_secs: None,
                reservation: None,
            }),
            "",
        ),
        (
            &m.alice,
            reqwest::Method::POST,
            "/v1/sessions".into(),
            value(&CreateSession {
                name: None,
                gpus: one_gpu(),
                image: None,
                idle_timeout_secs: None,
                max_duration_secs: None,
                reservation: None,
            }),
            "gpus",
        ),
        (
            &m.alice,
            reqwest::Method::POST,
            "/v1/sessions/dev/hold".into(),
            value(&HoldRequest { reason: None }),
            "",
        ),
        (
            &m.alice,
            reqwest::Method::POST,
            "/v1/sessions/dev/keep".into(),
            value(&KeepRequest { duration_secs: 60 }),
            "",
        ),
        (
            &m.alice,
            reqwest::Method::POST,
            "/v1/keys".into(),
            value(&add_key(KEY_A)),
            "",
        ),
        (
            &m.alice,
            reqwest::Method::POST,
            "/v1/images".into(),
            value(&CreateImage {
                session: SessionName::parse("dev").unwrap(),
                reference: ImageReference::parse("mymodel:v1").unwrap(),
                force: false,
                compression: Default::default(),
            }),
            "",
        ),
        (
            &m.alice,
            reqwest::Method::POST,
            "/v1/jobs".into(),
            value(&job),
            "",
        ),
        (
            &m.alice,
            reqwest::Method::POST,
            "/v1/jobs".into(),
            value(&job),
            "spec",
        ),
        (
            &m.alice,
            reqwest::Method::POST,
            "/v1/jobs".into(),
            value(&job),
            "spec.gpus",
        ),
        (
            &m.admin,
            reqwest::Method::PUT,
            format!("{gpu}/mode"),
            value(&SetGpuMode {
                mode: GpuMode::Exclusive,
            }),
            "",
        ),
        (
            &m.admin,
            reqwest::Method::POST,
            format!("{gpu}/drain"),
            value(&ongrid_core::api::DrainRequest { reason: None }),
            "",
        ),
        (
            &m.admin,
            reqwest::Method::POST,
            "/v1/nodes/node1/drain".into(),
            value(&ongrid_core::api::DrainRequest { reason: None }),
            "",
        ),
        (
            &m.admin,
            reqwest::Method::PUT,
            format!("{gpu}/owner"),
            value(&SetOwner {
                group: "physics".to_owned(),
            }),
            "",
        ),
        (
            &m.admin,
            reqwest::Method::PUT,
            "/v1/nodes/node1/owner".into(),
            value(&SetOwner {
                group: "physics".to_owned(),
            }),
            "",
        ),
        (
            &m.admin,
            reqwest::Method::POST,
            "/v1/reservations".into(),
            value(&reservation),
            "",
        ),
        (
            &m.admin,
            reqwest::Method::POST,
            "/v1/institutes".into(),
            institute("lab", &["192.0.2.0/24"]),
            "",
        ),
    ];
    for (api, method, path, mut body, at) in rows {
        let mut target = &mut body;
        for key in at.split('.').filter(|key| !key.is_empty()) {
            target = &mut target[key];
        }
        target["privileged"] = serde_json::Value::Bool(true);
        let request = api.request(method.clone(), &path).json(&body);
        let (status, text) = api.send(request).await;
        assert_eq!(
            status,
            StatusCode::BAD_REQUEST,
            "{method} {path} {body}: {text}"
        );
        let message = message(&text);
        assert!(
            message.contains("unknown field `privileged`"),
            "{method} {path} {body}: {message}"
        );
    }
    assert!(m.alice.list("").await.is_empty(), "no session was stored");
    let queued: Vec<ongrid_core::job::JobView> =
        m.alice.ok(StatusCode::OK, m.alice.get("/v1/jobs")).await;
    assert!(queued.is_empty(), "no job was queued: {queued:?}");
    let keys: Vec<KeyView> = m.alice.ok(StatusCode::OK, m.alice.get("/v1/keys")).await;
    assert!(keys.is_empty(), "no key was stored: {keys:?}");
    let institutes: Vec<Institute> = m
        .admin
        .ok(StatusCode::OK, m.admin.get("/v1/institutes"))
        .await;
    assert!(
        institutes.is_empty(),
        "no institute was stored: {institutes:?}"
    );
    let node: NodeView = m
        .admin
        .ok(StatusCode::OK, m.admin.get("/v1/nodes/node1"))
        .await;
    assert!(
        node.drain.is_none() && node.gpus[0].drain.is_none(),
        "{node:?}"
    );

    // The components' bodies take a field a newer agent or gateway may send.
    let mut register = value(&RegisterNode {
        node: NodeName::parse("node1").unwrap(),
        agent_version: "test".to_owned(),
        gpu_backend: "simulated".to_owned(),
        gpus: vec![a100(1)],
        stream_url: None,
        start_modes: Default::default(),
    });
    register["from_the_future"] = serde_json::Value::Bool(true);
    let _: DesiredState = m
        .node1
        .ok(
            StatusCode::OK,
            m.node1.post("/v1/agent/register", &register),
        )
        .await;
    let mut route = value(&RouteRequest {
        owner: Dn::parse(ALICE).unwrap(),
        target: "dev".to_owned(),
    });
    route["from_the_future"] = serde_json::Value::Bool(true);
    m.gateway
        .fails(
            StatusCode::NOT_FOUND,
            m.gateway.post("/v1/gateway/route", &route),
        )
        .await;
    m.stop().await;
}

/// A typed body as the JSON it is sent as.
fn value<T: Serialize>(body: &T) -> serde_json::Value {
    serde_json::to_value(body).unwrap()
}

/// The log lines of a test, written by everything that runs on its thread (a current-thread
/// runtime: the manager's tasks too).
#[derive(Clone, Default)]
struct CapturedLog(Arc<std::sync::Mutex<Vec<u8>>>);

impl CapturedLog {
    /// Captures the lines of `level` and above until the guard is dropped.
    ///
    /// `tracing` caches per call site whether any subscriber wants its events. While only one
    /// subscriber is alive in the process, it asks the default subscriber of the thread that
    /// first reaches the call site: another test's thread, with none, would have "Request
    /// refused." cached as never wanted, and the line lost here. A second subscriber kept alive
    /// for the whole process makes it ask every live subscriber instead.
    fn install(level: tracing::Level) -> (Self, tracing::subscriber::DefaultGuard) {
        static SECOND: std::sync::OnceLock<tracing::Dispatch> = std::sync::OnceLock::new();
        SECOND.get_or_init(|| tracing::Dispatch::new(tracing::subscriber::NoSubscriber::default()));
        let log = Self::default();
        let writer = log.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(level)
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish();
        (log, tracing::subscriber::set_default(subscriber))
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

impl std::io::Write for CapturedLog {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test(flavor = "current_thread")]
async fn refusals_are_logged_once_and_user_strings_cannot_forge_lines() {
    let (log, _guard) = CapturedLog::install(tracing::Level::DEBUG);
    let site = Site::new();
    let m = site.start().await;

    // A login name that tries to end the line and start a forged one, with terminal escapes.
    let forged = "x\n2026-11-23T00:00:00Z  INFO ongrid: admin logged in\u{1b}[2K";
    let check = KeyCheck {
        public_key: KEY_C.to_owned(),
        source: IpAddr::V4(Ipv4Addr::LOCALHOST),
        login: forged.to_owned(),
    };
    let (status, _) = m
        .gateway
        .send(m.gateway.post("/v1/gateway/authorize", &check))
        .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    // A 403 for a user, and a 401 without a certificate.
    m.bob
        .fails(StatusCode::FORBIDDEN, m.bob.get("/v1/sessions?all=true"))
        .await;
    m.anonymous
        .fails(StatusCode::UNAUTHORIZED, m.anonymous.get("/v1/sessions"))
        .await;
    m.stop().await;

    let text = log.text();
    assert!(text.contains("SSH key refused: not registered."), "{text}");
    assert!(
        !text
            .lines()
            .any(|line| line.starts_with("2026-11-23T00:00:00Z")),
        "a forged line: {text}"
    );
    assert!(
        !text.contains('\u{1b}'),
        "a raw escape reached the log: {text}"
    );
    let refusals: Vec<&str> = text
        .lines()
        .filter(|line| line.contains("Request refused."))
        .collect();
    assert_eq!(refusals.len(), 2, "{text}");
    assert!(
        refusals[0].contains("status=403") && refusals[0].contains(BOB),
        "{refusals:?}"
    );
    assert!(
        refusals[1].contains("status=401") && refusals[1].contains("127.0.0.1"),
        "{refusals:?}"
    );
    assert!(!text.contains("Bearer"), "{text}");
}

/// An admin route authorises its caller before it looks at the body or the query: a user
/// sending a malformed one gets the 403 (logged, with who asked), not a 400; an admin sending
/// the same gets the 400.
#[tokio::test(flavor = "current_thread")]
async fn admin_routes_refuse_users_before_reading_their_bodies() {
    let (log, _guard) = CapturedLog::install(tracing::Level::INFO);
    let site = Site::new();
    let m = site.start().await;
    m.node1.register("node1", vec![a100(1)]).await;
    let gpu = format!("/v1/gpus/{}", a100(1).uuid);
    let bob = urlencode(BOB);
    let bodies = [
        (reqwest::Method::PUT, format!("{gpu}/mode")),
        (reqwest::Method::POST, format!("{gpu}/drain")),
        (reqwest::Method::POST, "/v1/nodes/node1/drain".to_owned()),
        (reqwest::Method::PUT, format!("{gpu}/owner")),
        (reqwest::Method::PUT, "/v1/nodes/node1/owner".to_owned()),
        (reqwest::Method::POST, "/v1/reservations".to_owned()),
        (reqwest::Method::POST, "/v1/institutes".to_owned()),
        (reqwest::Method::PUT, "/v1/token-links".to_owned()),
    ];
    let queries = [
        (
            reqwest::Method::DELETE,
            format!("/v1/users/{bob}?force=perhaps"),
        ),
        (
            reqwest::Method::GET,
            "/v1/audit?since=bogus&evil=1".to_owned(),
        ),
    ];
    let malformed = |api: &Api, method: &reqwest::Method, path: &str| {
        api.request(method.clone(), path)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(r#"{"mode": "#)
    };
    for (method, path) in bodies.iter().chain(&queries) {
        let (status, text) = m.bob.send(malformed(&m.bob, method, path)).await;
        assert_eq!(status, StatusCode::FORBIDDEN, "{method} {path}: {text}");
        assert!(
            message(&text).starts_with("only admins "),
            "{method} {path}: {text}"
        );
        let (status, text) = m.admin.send(malformed(&m.admin, method, path)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{method} {path}: {text}");
    }
    m.stop().await;

    let text = log.text();
    let refusals: Vec<&str> = text
        .lines()
        .filter(|line| line.contains("Request refused."))
        .collect();
    assert_eq!(refusals.len(), bodies.len() + queries.len(), "{text}");
    for line in refusals {
        assert!(
            line.contains("status=403") && line.contains(BOB) && line.contains("only admins"),
            "{line}"
        );
    }
}
