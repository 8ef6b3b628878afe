//! The manager client and the whole agent against a fake manager: a small HTTPS server in the
//! test (a throwaway CA from rcgen, rustls) that records every request and answers with the
//! desired state the test sets, versioned like the manager's (`ETag`; the long-poll
//! `GET /v1/agent/desired?after=` waits until the test changes it). The agent side is real: TLS
//! trust from `ca_dir`, the bearer token, the simulated GPU backend, Docker.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use ongrid_agent::config::Token;
use ongrid_agent::gpu::{self, GpuBackendConfig};
use ongrid_agent::manager_client::{AgentRoutes, ClientError, HttpError};
use ongrid_agent::metrics::Readiness;
use ongrid_agent::Agent;
use ongrid_core::api::{
    ContainerState, DesiredSession, DesiredState, NodeReport, ObservedContainer, RegisterNode,
};
use ongrid_core::NodeName;
use reqwest::Url;
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_rustls::rustls;
use tokio_util::sync::CancellationToken;

use crate::{docker, eventually, exists, inspect, TestNode};

const TOKEN: &str = "node-token-0123456789";

/// A CA written into a `ca_dir`, with its key to sign server certificates.
struct TestCa {
    dir: tempfile::TempDir,
    cert: rcgen::Certificate,
    key: rcgen::KeyPair,
}

impl TestCa {
    fn new() -> Self {
        let key = rcgen::KeyPair::generate().expect("key");
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "ongrid test CA");
        let cert = params.self_signed(&key).expect("CA certificate");
        let dir = tempfile::tempdir().expect("temp dir");
        std::fs::write(dir.path().join("0a1b2c3d.0"), cert.pem()).expect("CA file");
        Self { dir, cert, key }
    }
}

#[derive(Debug, Clone)]
pub(crate) struct Request {
    pub(crate) path: String,
    authorization: Option<String>,
    pub(crate) body: Value,
}

struct ManagerState {
    requests: Vec<Request>,
    desired: DesiredState,
    /// The desired state's version: how many times the test changed it.
    version: u64,
    /// When set, every request is answered with this status and body.
    failure: Option<(u16, String)>,
    /// When set, every request is read and recorded, then the connection closed unanswered
    /// (a manager dying while it handles the request).
    hang_up: bool,
}

pub(crate) struct FakeManager {
    url: Url,
    ca: Arc<TestCa>,
    state: Arc<Mutex<ManagerState>>,
    /// The version, for long-polls to wait on.
    versions: Arc<watch::Sender<u64>>,
    server: tokio::task::JoinHandle<()>,
}

impl FakeManager {
    pub(crate) async fn start(node: &NodeName) -> Self {
        Self::start_with(node, Arc::new(TestCa::new())).await
    }

    /// A second manager with a certificate of the same CA, like a replica of this one.
    async fn replica(&self, node: &NodeName) -> Self {
        Self::start_with(node, self.ca.clone()).await
    }

    /// Stops accepting connections (they are refused from now on), as a manager that died.
    fn stop(&self) {
        self.server.abort();
    }

    async fn start_with(node: &NodeName, ca: Arc<TestCa>) -> Self {
        let key = rcgen::KeyPair::generate().expect("key");
        let params = rcgen::CertificateParams::new(vec!["127.0.0.1".to_owned()]).expect("params");
        let cert = params
            .signed_by(&key, &ca.cert, &ca.key)
            .expect("server certificate");
        let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .expect("protocol versions")
        .with_no_client_auth()
        .with_single_cert(
            vec![cert.der().clone()],
            rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
        )
        .expect("server TLS config");
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));

        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let url =
            Url::parse(&format!("https://{}", listener.local_addr().expect("addr"))).expect("url");
        let state = Arc::new(Mutex::new(ManagerState {
            requests: Vec::new(),
            desired: DesiredState {
                node: node.clone(),
                sync_interval_secs: 1,
                sessions: Vec::new(),
                freezes: Vec::new(),
                removed_images: Vec::new(),
                jobs: Vec::new(),
                mig_layouts: Default::default(),
                mig_off: Default::default(),
            },
            version: 0,
            failure: None,
            hang_up: false,
        }));
        let versions = Arc::new(watch::channel(0).0);
        let server_versions = versions.clone();
        let server_state = state.clone();
        let server = tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    return;
                };
                let acceptor = acceptor.clone();
                let state = server_state.clone();
                let versions = server_versions.subscribe();
                tokio::spawn(async move {
                    // A client that rejects our certificate ends the handshake: nothing to do.
                    if let Ok(tls) = acceptor.accept(tcp).await {
                        let _ = serve_one(tls, &state, versions).await;
                    }
                });
            }
        });
        Self {
            url,
            ca,
            state,
            versions,
            server,
        }
    }

    fn state(&self) -> MutexGuard<'_, ManagerState> {
        self.state.lock().expect("not poisoned")
    }

    pub(crate) fn client(&self) -> AgentRoutes {
        AgentRoutes::new(
            std::slice::from_ref(&self.url),
            self.ca.dir.path(),
            Token::new(TOKEN),
        )
        .expect("client")
    }

    pub(crate) fn set_sessions(&self, sessions: Vec<DesiredSession>) {
        self.change(|desired| desired.sessions = sessions);
    }

    /// Changes the desired state: a new version, and open long-polls answer.
    pub(crate) fn change(&self, change: impl FnOnce(&mut DesiredState)) {
        let version = {
            let mut state = self.state();
            change(&mut state.desired);
            state.version += 1;
            state.version
        };
        self.versions.send_replace(version);
    }

    /// The sync requests received so far.
    fn syncs(&self) -> usize {
        self.requests()
            .iter()
            .filter(|r| r.path == "/v1/agent/sync")
            .count()
    }

    pub(crate) fn requests(&self) -> Vec<Request> {
        self.state().requests.clone()
    }

    /// The containers of the sync requests received after the first `skip` requests.
    fn reports_after(&self, skip: usize) -> Vec<Vec<ObservedContainer>> {
        self.requests()
            .into_iter()
            .skip(skip)
            .filter(|r| r.path == "/v1/agent/sync")
            .map(|r| {
                serde_json::from_value::<NodeReport>(r.body)
                    .expect("a NodeReport")
                    .containers
            })
            .collect()
    }
}

/// How long the fake's long-poll waits at most, whatever the agent asks.
const LONG_POLL_WAIT: Duration = Duration::from_secs(25);

/// Reads one HTTP/1.1 request, records it (its path without the query), answers, closes. A
/// long-poll after the current version waits for the next one first.
async fn serve_one<S>(
    stream: S,
    state: &Mutex<ManagerState>,
    mut versions: watch::Receiver<u64>,
) -> std::io::Result<()>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let mut reader = BufReader::new(stream);
    let mut request_line = String::new();
    reader.read_line(&mut request_line).await?;
    let target = request_line.split_whitespace().nth(1).unwrap_or_default();
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let path = path.to_owned();
    let after: Option<u64> = query
        .split('&')
        .find_map(|pair| pair.strip_prefix("after="))
        .and_then(|v| v.parse().ok());
    let mut content_length = 0;
    let mut authorization = None;
    loop {
        let mut line = String::new();
        reader.read_line(&mut line).await?;
        let line = line.trim_end();
        if line.is_empty() {
            break;
        }
        if let Some((name, value)) = line.split_once(':') {
            match name.to_ascii_lowercase().as_str() {
                "content-length" => content_length = value.trim().parse().unwrap_or(0),
                "authorization" => authorization = Some(value.trim().to_owned()),
                _ => {}
            }
        }
    }
    let mut body = vec![0; content_length];
    reader.read_exact(&mut body).await?;
    let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let long_poll = path == "/v1/agent/desired";
    let (failing, hang_up) = {
        let mut state = state.lock().expect("not poisoned");
        state.requests.push(Request {
            path,
            authorization,
            body,
        });
        (state.failure.is_some(), state.hang_up)
    };
    if hang_up {
        return Ok(());
    }
    if long_poll && !failing && after.is_some() {
        let changed = versions.wait_for(|version| Some(*version) != after);
        // Nothing new within the wait: the answer below is a 204.
        let _ = tokio::time::timeout(LONG_POLL_WAIT, changed).await;
    }
    let (status, answer, version) = {
        let state = state.lock().expect("not poisoned");
        match &state.failure {
            Some((status, body)) => (*status, body.clone(), state.version),
            None if long_poll && after == Some(state.version) => {
                (204, String::new(), state.version)
            }
            None => (
                200,
                serde_json::to_string(&state.desired).expect("serialisable"),
                state.version,
            ),
        }
    };
    let response = format!(
        "HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
         ETag: \"{version}\"\r\nConnection: close\r\n\r\n{answer}",
        answer.len()
    );
    let mut stream = reader.into_inner();
    stream.write_all(response.as_bytes()).await?;
    stream.shutdown().await
}

/// A sync of a node with nothing on it.
fn empty_report(node: &NodeName) -> NodeReport {
    NodeReport {
        node: node.clone(),
        gpus: Vec::new(),
        containers: Vec::new(),
        activity: Vec::new(),
        freezes: Vec::new(),
        jobs: Vec::new(),
    }
}

fn registration(node: &NodeName) -> RegisterNode {
    RegisterNode {
        node: node.clone(),
        agent_version: "test".into(),
        gpu_backend: "simulated".into(),
        gpus: Vec::new(),
        stream_url: None,
        start_modes: Default::default(),
    }
}

#[tokio::test]
async fn client_registers_and_syncs_with_its_token() {
    let node = NodeName::parse("node-a").expect("name");
    let manager = FakeManager::start(&node).await;
    let client = manager.client();

    let desired = client
        .register(&registration(&node))
        .await
        .expect("registered");
    assert_eq!(desired, manager.state().desired);
    let report = empty_report(&node);
    let synced = client.sync(&report).await.expect("synced");
    assert_eq!(synced.desired, manager.state().desired);
    assert_eq!(synced.version.as_deref(), Some("0"));

    let requests = manager.requests();
    assert_eq!(requests.len(), 2);
    assert_eq!(requests[0].path, "/v1/agent/register");
    assert_eq!(requests[1].path, "/v1/agent/sync");
    for request in &requests {
        assert_eq!(
            request.authorization.as_deref(),
            Some(format!("Bearer {TOKEN}").as_str())
        );
    }
    assert_eq!(
        requests[0].body,
        serde_json::to_value(registration(&node)).expect("json")
    );
    assert_eq!(
        requests[1].body,
        serde_json::to_value(&report).expect("json")
    );
}

/// With `manager_url` listing two managers (replicas of one database), the client goes on with
/// the other when one cannot be reached, and stays with the one that answered last. A write
/// cut off after it reached a manager is not sent to the other (that manager may have done it:
/// a session would start twice); a read is.
#[tokio::test]
async fn a_client_of_two_managers_goes_on_with_the_one_that_answers() {
    let node = NodeName::parse("node-ha").expect("name");
    let first = FakeManager::start(&node).await;
    let second = first.replica(&node).await;
    let client = AgentRoutes::new(
        &[first.url.clone(), second.url.clone()],
        first.ca.dir.path(),
        Token::new(TOKEN),
    )
    .expect("client");
    let paths = |manager: &FakeManager| -> Vec<String> {
        manager.requests().into_iter().map(|r| r.path).collect()
    };
    let report = empty_report(&node);

    client
        .register(&registration(&node))
        .await
        .expect("registered");
    assert_eq!(paths(&first), ["/v1/agent/register"]);
    assert!(paths(&second).is_empty());

    // The first dies while it handles a sync: an error, and nothing sent to the second.
    first.state().hang_up = true;
    let err = client.sync(&report).await.unwrap_err();
    assert!(
        matches!(err, ClientError::Http(HttpError::Unreachable { .. })),
        "{err:?}"
    );
    assert_eq!(paths(&first), ["/v1/agent/register", "/v1/agent/sync"]);
    assert!(paths(&second).is_empty(), "{:?}", paths(&second));
    // A read cut off the same way is asked of the second.
    let desired = client
        .desired(None, Duration::from_secs(1))
        .await
        .expect("the second answers");
    assert!(desired.is_some());
    assert_eq!(paths(&second), ["/v1/agent/desired"]);
    // The second answered last: the next sync goes there, though the first answers again.
    first.state().hang_up = false;
    client.sync(&report).await.expect("synced");
    assert_eq!(paths(&second), ["/v1/agent/desired", "/v1/agent/sync"]);
    assert_eq!(paths(&first).len(), 3);
    // The second is gone (its connections refused): a write that could not reach it goes to
    // the first, and the one after it too.
    second.stop();
    client
        .sync(&report)
        .await
        .expect("synced through the first");
    client
        .sync(&report)
        .await
        .expect("synced through the first");
    assert_eq!(
        paths(&first)[3..],
        ["/v1/agent/sync", "/v1/agent/sync"],
        "{:?}",
        paths(&first)
    );
    assert_eq!(paths(&second).len(), 2);

    // Both gone: the error names both.
    first.stop();
    let err = client.sync(&report).await.unwrap_err();
    let text = err.to_string() + &format!("{:#}", anyhow::Error::from(err));
    assert!(
        text.contains(&first.url.to_string()) && text.contains(&second.url.to_string()),
        "{text}"
    );
}

#[tokio::test]
async fn client_trusts_only_the_cas_of_its_ca_dir() {
    let node = NodeName::parse("node-a").expect("name");
    let manager = FakeManager::start(&node).await;
    let stranger = TestCa::new();
    let client = AgentRoutes::new(
        std::slice::from_ref(&manager.url),
        stranger.dir.path(),
        Token::new(TOKEN),
    )
    .expect("client");
    let err = client.register(&registration(&node)).await.unwrap_err();
    assert!(
        matches!(err, ClientError::Http(HttpError::Unreachable { .. })),
        "{err:?}"
    );
    assert!(
        manager.requests().is_empty(),
        "no request may reach an untrusted server"
    );
}

#[tokio::test]
async fn refusals_carry_the_managers_message_and_the_fix() {
    let node = NodeName::parse("node-a").expect("name");
    let manager = FakeManager::start(&node).await;
    manager.state().failure = Some((
        401,
        r#"{"error":{"code":"unauthenticated","message":"unknown node token"}}"#.into(),
    ));
    let err = manager
        .client()
        .register(&registration(&node))
        .await
        .unwrap_err();
    assert!(matches!(err, ClientError::TokenRefused(_)), "{err:?}");
    // The whole chain, as the agent logs it.
    let text = format!("{:#}", anyhow::Error::from(err));
    assert!(text.contains("401"), "{text}");
    assert!(
        text.contains("unauthenticated: unknown node token"),
        "{text}"
    );
    assert!(text.contains("token_file"), "{text}");
}

/// The whole agent: registration, a session started and reported, a manager outage that leaves
/// it alone, a restart that adopts it, its death reported, and its removal.
#[tokio::test]
async fn agent_converges_reports_and_survives_restarts_and_outages() {
    let test_node = TestNode::new().await;
    let node = test_node.node.clone();
    let manager = FakeManager::start(&node).await;
    let gpus_dir = tempfile::tempdir().expect("temp dir");
    let gpus_file = gpus_dir.path().join("gpus.toml");
    std::fs::write(
        &gpus_file,
        "[[gpu]]\nuuid = \"GPU-11111111-2222-3333-4444-555555555501\"\n\
         model = \"NVIDIA A100-SXM4-40GB\"\ncapability = \"8.0\"\nmemory = \"40960MiB\"\n",
    )
    .expect("gpu file");
    // What the agent's /readyz answers, shared by both agents started here.
    let readiness = Readiness::default();
    let start_agent = || {
        let agent = Agent {
            node: node.clone(),
            gpus: gpu::from_config(&GpuBackendConfig::Simulated {
                file: gpus_file.clone(),
            })
            .expect("simulated backend"),
            runtime: test_node.runtime.clone(),
            guard: test_node.guard(),
            manager: manager.client(),
            stream_url: Some("wss://node1.example.org:8444".to_owned()),
            images: None,
            jobs: None,
            readiness: readiness.clone(),
            parallel_operations: ongrid_agent::reconcile::DEFAULT_PARALLEL_OPERATIONS,
        };
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(agent.run(shutdown.clone()));
        (shutdown, task)
    };
    let limit = Duration::from_secs(60);

    let (shutdown, task) = start_agent();
    let registered = eventually(limit, "a registration", || {
        manager
            .requests()
            .into_iter()
            .find(|r| r.path == "/v1/agent/register")
    })
    .await;
    let registered: RegisterNode = serde_json::from_value(registered.body).expect("RegisterNode");
    assert_eq!(registered.node, node);
    assert_eq!(registered.gpu_backend, "simulated");
    assert_eq!(registered.gpus.len(), 1);
    assert_eq!(
        registered.stream_url.as_deref(),
        Some("wss://node1.example.org:8444")
    );

    // A session appears in the desired state: the container is created and reported running.
    let session = test_node.session();
    let name = session.session_id.container_name();
    manager.set_sessions(vec![session.clone()]);
    let running = |skip: usize| {
        manager
            .reports_after(skip)
            .into_iter()
            .find_map(|containers| {
                containers.into_iter().find(|c| {
                    c.session_id == session.session_id && c.state == ContainerState::Running
                })
            })
    };
    let observed = eventually(limit, "the session reported running", || running(0)).await;
    assert_eq!(observed.error, None);
    assert_eq!(readiness.get(), Ok(()), "ready once synced");
    assert_eq!(
        inspect("container", &name)["Id"],
        observed.container_id.as_str()
    );
    let started_at = inspect("container", &name)["State"]["StartedAt"].clone();

    // The manager fails for a while: the agent retries and leaves the container alone.
    let before = manager.syncs();
    manager.state().failure = Some((503, "overloaded".into()));
    eventually(limit, "two failed syncs", || {
        (manager.syncs() >= before + 2).then_some(())
    })
    .await;
    assert_eq!(inspect("container", &name)["State"]["Running"], true);
    let not_ready = readiness
        .get()
        .expect_err("not ready while the manager fails");
    assert!(
        not_ready.starts_with("cannot sync with the manager") && not_ready.contains("overloaded"),
        "{not_ready}"
    );
    manager.state().failure = None;
    eventually(limit, "ready again", || readiness.get().ok()).await;

    // Stopping the agent leaves the container running, isolated by the firewall rules it
    // leaves in place; a new agent adopts it.
    let rules = test_node.firewall.rules();
    let chain_exists = |chain: &str| {
        let table = if chain == rules.forward_chain {
            "mangle"
        } else {
            "filter"
        };
        std::process::Command::new("iptables")
            .args(["-t", table, "-S", chain])
            .output()
            .expect("iptables runs")
            .status
            .success()
    };
    assert!(chain_exists(&rules.input_chain) && chain_exists(&rules.forward_chain));
    shutdown.cancel();
    task.await
        .expect("agent task")
        .expect("agent stopped cleanly");
    assert_eq!(inspect("container", &name)["State"]["Running"], true);
    assert!(
        chain_exists(&rules.input_chain) && chain_exists(&rules.forward_chain),
        "an agent stopping with a container left keeps its firewall rules"
    );
    let (shutdown, task) = start_agent();
    let skip = manager.requests().len();
    let adopted = eventually(limit, "the adopted session reported", || running(skip)).await;
    assert_eq!(adopted.container_id, observed.container_id);
    assert_eq!(
        inspect("container", &name)["State"]["StartedAt"],
        started_at
    );

    // The container dies: reported with why, not restarted.
    docker(&["kill", &name]);
    let dead = eventually(limit, "the death reported", || {
        manager.reports_after(0).into_iter().find_map(|containers| {
            containers
                .into_iter()
                .find(|c| matches!(c.state, ContainerState::Exited { .. }))
        })
    })
    .await;
    assert_eq!(
        dead.error.as_deref(),
        Some("the dev container was killed by SIGKILL (exit code 137) without ongrid asking")
    );
    assert_eq!(inspect("container", &name)["State"]["Running"], false);

    // The manager drops the session: the container is removed.
    manager.set_sessions(Vec::new());
    eventually(limit, "the container removed", || {
        (!exists("container", &name)).then_some(())
    })
    .await;
    // No container left: the agent that stops takes its firewall rules with it.
    shutdown.cancel();
    task.await
        .expect("agent task")
        .expect("agent stopped cleanly");
    assert!(
        !chain_exists(&rules.input_chain) && !chain_exists(&rules.forward_chain),
        "an agent stopping with no container left removes its firewall rules"
    );
}

/// `ongrid_agent::run` from a config file with `[streams]`: the endpoint is bound, its URL goes
/// to the manager in the registration, it answers there, and it stops with the agent.
#[tokio::test]
async fn run_serves_streams_and_registers_their_url() {
    use futures::{SinkExt, StreamExt};
    use ongrid_core::stream::{Frame, StreamKind, StreamOpen};
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;
    use tokio_tungstenite::tungstenite::Message;

    let test_node = TestNode::new().await;
    let manager = FakeManager::start(&test_node.node).await;
    let dir = tempfile::tempdir().expect("temp dir");
    let path = |name: &str| dir.path().join(name).display().to_string();
    std::fs::write(path("node-token"), format!("{TOKEN}\n")).expect("token");
    std::fs::write(path("gateway-token"), "gw-token-42\n").expect("gateway token");
    std::fs::write(path("gpus.toml"), "").expect("gpu file");
    let key = rcgen::KeyPair::generate().expect("key");
    let cert = rcgen::CertificateParams::new(vec!["127.0.0.1".to_owned()])
        .expect("params")
        .signed_by(&key, &manager.ca.cert, &manager.ca.key)
        .expect("agent certificate");
    std::fs::write(path("agent.crt"), cert.pem()).expect("cert");
    std::fs::write(path("agent.key"), key.serialize_pem()).expect("key");
    let text = format!(
        "node_name = \"{node}\"\nmanager_url = \"{url}\"\nca_dir = \"{ca}\"\n\
         token_file = \"{token}\"\n[gpu]\nbackend = \"simulated\"\nfile = \"{gpus}\"\n\
         [streams]\nlisten = \"127.0.0.1:0\"\ntls_cert = \"{cert}\"\ntls_key = \"{key}\"\n\
         gateway_token_file = \"{gateway}\"\n",
        node = test_node.node,
        url = manager.url,
        ca = manager.ca.dir.path().display(),
        token = path("node-token"),
        gpus = path("gpus.toml"),
        cert = path("agent.crt"),
        key = path("agent.key"),
        gateway = path("gateway-token"),
    );
    let config = ongrid_agent::Config::parse(&text, std::path::Path::new("agent.toml"))
        .expect("valid config");
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(ongrid_agent::run(config, shutdown.clone()));

    let registered = eventually(Duration::from_secs(30), "a registration", || {
        manager
            .requests()
            .into_iter()
            .find(|r| r.path == "/v1/agent/register")
    })
    .await;
    let registered: RegisterNode = serde_json::from_value(registered.body).expect("RegisterNode");
    let url = registered.stream_url.expect("a stream URL");
    let address = url
        .strip_prefix("wss://127.0.0.1:")
        .unwrap_or_else(|| panic!("{url} is the bound address"));
    assert_ne!(address, "0", "{url} has the bound port");

    let mut roots = rustls::RootCertStore::empty();
    roots.add(manager.ca.cert.der().clone()).expect("CA");
    let client = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("protocol versions")
    .with_root_certificates(roots)
    .with_no_client_auth();
    let tcp = tokio::net::TcpStream::connect(url.trim_start_matches("wss://"))
        .await
        .expect("TCP connect");
    let tls = tokio_rustls::TlsConnector::from(Arc::new(client))
        .connect(
            rustls::pki_types::ServerName::try_from("127.0.0.1").expect("name"),
            tcp,
        )
        .await
        .expect("TLS");
    let mut request = format!("{url}/v1/streams")
        .into_client_request()
        .expect("request");
    request.headers_mut().insert(
        "Authorization",
        "Bearer gw-token-42".parse().expect("header"),
    );
    let (mut ws, _) = tokio_tungstenite::client_async(request, tls)
        .await
        .expect("WebSocket");
    let session_id = ongrid_core::SessionId::new_random();
    let open = StreamOpen {
        session_id,
        owner: ongrid_core::Dn::parse("/DC=org/CN=Someone").expect("DN"),
        kind: StreamKind::Shell { pty: None },
        env: vec![],
    };
    let json = serde_json::to_string(&open).expect("JSON");
    ws.send(Message::Text(json.into())).await.expect("send");
    let answer = match ws.next().await {
        Some(Ok(Message::Binary(bytes))) => Frame::decode(&bytes).expect("frame"),
        other => panic!("expected a frame, got {other:?}"),
    };
    assert_eq!(
        answer,
        Frame::Error(format!(
            "session {session_id} is not on this node (it may have ended or moved): connect again"
        ))
    );

    shutdown.cancel();
    task.await
        .expect("agent task")
        .expect("agent stopped cleanly");
    let port: u16 = address.parse().expect("port");
    assert!(
        tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_err(),
        "the endpoint stopped listening"
    );
}

/// The long-poll: answered at once for a version the agent does not have, else when the desired
/// state changes, and with nothing when it does not change in time.
#[tokio::test]
async fn client_long_polls_the_desired_state() {
    let node = NodeName::parse("node-a").expect("name");
    let manager = FakeManager::start(&node).await;
    let client = manager.client();
    let first = client
        .desired(None, Duration::from_secs(25))
        .await
        .expect("answered")
        .expect("a desired state at once");
    assert_eq!(first.version.as_deref(), Some("0"));
    let poll = tokio::spawn({
        let client = client.clone();
        async move { client.desired(Some("0"), Duration::from_secs(25)).await }
    });
    eventually(Duration::from_secs(10), "the long-poll open", || {
        (manager.requests().len() == 2).then_some(())
    })
    .await;
    manager.set_sessions(Vec::new());
    let changed = tokio::time::timeout(Duration::from_secs(10), poll)
        .await
        .expect("answered when the state changed")
        .expect("task")
        .expect("answered")
        .expect("the new state");
    assert_eq!(changed.version.as_deref(), Some("1"));
    assert_eq!(manager.requests()[1].path, "/v1/agent/desired");
}

/// With a sync interval of five minutes, a session that appears in the desired state is started
/// and reported running within seconds: the long-poll brings it, and the agent reports at once;
/// so is its container's death (Docker's event).
#[tokio::test]
async fn a_desired_change_starts_a_container_without_waiting_for_the_sync() {
    let test_node = TestNode::new().await;
    let node = test_node.node.clone();
    let manager = FakeManager::start(&node).await;
    manager.change(|desired| desired.sync_interval_secs = 300);
    let gpus_dir = tempfile::tempdir().expect("temp dir");
    let gpus_file = gpus_dir.path().join("gpus.toml");
    std::fs::write(&gpus_file, "").expect("gpu file");
    let agent = Agent {
        node: node.clone(),
        gpus: gpu::from_config(&GpuBackendConfig::Simulated { file: gpus_file })
            .expect("simulated backend"),
        runtime: test_node.runtime.clone(),
        guard: test_node.guard(),
        manager: manager.client(),
        stream_url: None,
        images: None,
        jobs: None,
        readiness: Readiness::default(),
        parallel_operations: ongrid_agent::reconcile::DEFAULT_PARALLEL_OPERATIONS,
    };
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(agent.run(shutdown.clone()));
    // The first sync, then the long-poll waiting after its version.
    eventually(
        Duration::from_secs(30),
        "the first sync and a long-poll",
        || {
            let requests = manager.requests();
            let synced = requests.iter().any(|r| r.path == "/v1/agent/sync");
            let polling = requests.iter().any(|r| r.path == "/v1/agent/desired");
            (synced && polling).then_some(())
        },
    )
    .await;
    let syncs = manager.syncs();

    let session = test_node.session();
    let started = tokio::time::Instant::now();
    manager.set_sessions(vec![session.clone()]);
    let observed = eventually(
        Duration::from_secs(30),
        "the session reported running",
        || {
            manager.reports_after(0).into_iter().find_map(|containers| {
                containers.into_iter().find(|c| {
                    c.session_id == session.session_id && c.state == ContainerState::Running
                })
            })
        },
    )
    .await;
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "reported well before the 300 s sync interval"
    );
    assert_eq!(
        inspect("container", &session.session_id.container_name())["Id"],
        observed.container_id.as_str()
    );
    // The first sync after the change already reported it running: the agent did not wait for
    // a later sync (others may follow at once, as after every change the agent acts on).
    let first = manager
        .reports_after(0)
        .into_iter()
        .nth(syncs)
        .expect("a sync after the change");
    assert!(
        first
            .iter()
            .any(|c| c.session_id == session.session_id && c.state == ContainerState::Running),
        "the first sync after the change did not report the started container: {first:?}"
    );

    // The container dies: reported at once, not at the next sync.
    let started = tokio::time::Instant::now();
    docker(&["kill", &session.session_id.container_name()]);
    let dead = eventually(Duration::from_secs(30), "the death reported", || {
        manager.reports_after(0).into_iter().find_map(|containers| {
            containers
                .into_iter()
                .find(|c| matches!(c.state, ContainerState::Exited { .. }))
        })
    })
    .await;
    assert!(started.elapsed() < Duration::from_secs(30));
    assert_eq!(dead.session_id, session.session_id);
    shutdown.cancel();
    task.await
        .expect("agent task")
        .expect("agent stopped cleanly");
}
