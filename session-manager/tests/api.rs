//! The manager's API end to end over real TLS: `run` on 127.0.0.1:0 with a throwaway CA made by
//! rcgen, a real SQLite file, and reqwest clients presenting client certificates (two users and
//! an admin) or a node token (an agent).

// Test helpers outside `#[test]` functions: a failed setup step should panic right there.
#![allow(clippy::unwrap_used)]

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::Path;
use std::time::Duration;

use ongrid_core::api::{
    ContainerState, CreateSession, DesiredState, ErrorBody, GpuView, NodeReport, NodeView,
    ObservedContainer, RegisterNode, RunState, SessionView, SetGpuMode, WhoAmI,
};
use ongrid_core::{
    ComputeCapability, GpuHealth, GpuId, GpuInfo, GpuMode, GpuRequest, GpuUuid, MemorySize,
    NodeName, SessionName, SessionState, Sharing,
};
use ongrid_manager::Config;
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

const NODE1_TOKEN: &str = "node1-0123456789abcdef0123456789abcdef";
const NODE2_TOKEN: &str = "node2-fedcba9876543210fedcba9876543210";
const ALICE: &str = "/DC=org/O=Example/CN=Alice Smith";
const BOB: &str = "/DC=org/O=Example/CN=Bob Jones";
const ADMIN: &str = "/DC=org/O=Example/CN=Site Admin";

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

    /// A client certificate for a slash-form DN of (type, value) pairs: PEM cert + key.
    fn client_pem(&self, parts: &[(DnType, &str)]) -> Vec<u8> {
        let mut params = CertificateParams::default();
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
    ca.client_pem(&[
        (dc(), "org"),
        (DnType::OrganizationName, "Example"),
        (DnType::CommonName, cn),
    ])
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
}

impl Site {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let ca = Ca::new("ongrid Test CA");
        let ca_dir = dir.path().join("certificates");
        std::fs::create_dir(&ca_dir).unwrap();
        std::fs::write(ca_dir.join("ca.0"), ca.cert.pem()).unwrap();

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
node_timeout = "1 hour"
sync_interval = "5 seconds"
# Only wake-ups drive the scheduler here: deterministic, and proof that they work.
schedule_interval = "1 hour"
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
        );
        std::fs::write(&config_path, &text).unwrap();
        let config = Config::from_toml(&text, &config_path, |_| None).unwrap();

        let stranger_ca = Ca::new("Unknown CA");
        Self {
            config,
            ca_pem: ca.cert.pem(),
            alice_pem: user_pem(&ca, "Alice Smith"),
            bob_pem: user_pem(&ca, "Bob Jones"),
            admin_pem: user_pem(&ca, "Site Admin"),
            stranger_pem: user_pem(&stranger_ca, "Alice Smith"),
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
        Running {
            addr,
            shutdown,
            task,
            alice: Api::new(self.client(Some(&self.alice_pem)), addr),
            bob: Api::new(self.client(Some(&self.bob_pem)), addr),
            admin: Api::new(self.client(Some(&self.admin_pem)), addr),
            anonymous: Api::new(self.client(None), addr),
            stranger: Api::new(self.client(Some(&self.stranger_pem)), addr),
            node1: Api::new(self.client(None), addr).with_token(NODE1_TOKEN),
            node2: Api::new(self.client(None), addr).with_token(NODE2_TOKEN),
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
    bob: Api,
    admin: Api,
    anonymous: Api,
    stranger: Api,
    node1: Api,
    node2: Api,
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
        let body = RegisterNode {
            node: NodeName::parse(node).unwrap(),
            agent_version: "test".to_owned(),
            gpu_backend: "simulated".to_owned(),
            gpus,
            stream_url: None,
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
    };
    let err = m
        .alice
        .fails(StatusCode::BAD_REQUEST, m.alice.post("/v1/sessions", &body))
        .await;
    assert_eq!(err.error.message, "a session needs at least 1 GPU");

    // Unsatisfiable: the scheduler's message plus where to look.
    let too_new = GpuRequest {
        min_capability: Some(ComputeCapability::new(9, 0)),
        ..one_gpu()
    };
    let body = CreateSession {
        name: None,
        gpus: too_new,
        image: None,
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
