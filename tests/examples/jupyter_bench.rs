//! A Jupyter kernel's round trip through the manager's web-app proxy against `ssh -L` to the
//! same JupyterLab, in the same run: how much slower a notebook cell feels in the browser than
//! over a tunnel a user would make by hand.
//!
//! ```text
//! cargo build --release --workspace --bins
//! cargo run --release -p ongrid-e2e --example jupyter_bench -- [--rounds 200]
//! ```
//!
//! The site (manager, an agent with one simulated GPU, the gateway) is the end-to-end harness's;
//! one user with a key runs one session `nb` of the dev image. The bench logs in to the
//! dashboard as a browser does (`devctl dashboard`'s link, `POST /dashboard/login`, the login
//! cookie) and asks for `.../apps/jupyter/api/status`, which starts JupyterLab in the session;
//! then it loads JupyterLab's first page (`.../apps/jupyter/lab`) while the server is cold, and
//! starts one kernel through the proxy. Both paths then talk to that kernel:
//!
//! - ongrid: `wss://<manager>/dashboard/sessions/nb/apps/jupyter/api/kernels/<id>/channels`,
//!   with the login cookie and the dashboard's `Origin` (TLS to the manager, the proxy, an
//!   agent stream to the port in the session);
//! - reference: `ssh -N -L 127.0.0.1:<free>:127.0.0.1:<jupyter port> nb@gateway`, then
//!   `ws://127.0.0.1:<free>/.../channels` with JupyterLab's token (read from the launcher's
//!   `server.json` in the session): the gateway's direct-tcpip channel to the same port.
//!
//! Each round sends an `execute_request` of `1+1` on the `shell` channel (Jupyter's JSON
//! message protocol on the channels WebSocket, no subprotocol) and waits for the
//! `execute_reply` to it; every other message (IOPub, the other connection's) is skipped. After
//! [`WARMUP`] rounds on each, `--rounds` rounds alternate between the two one by one. Prints p50
//! and p99 (nearest rank) of each, their ratio ongrid / ssh -L and the milliseconds ongrid adds,
//! and the cold first page (no reference: informational); the same rows go to `bench/run.sh`'s
//! table ([`bench_summary`]). Nothing is asserted but that every round got its reply.
//!
//! Most of a round trip is spent in JupyterLab's server, the same on both paths: on the dev
//! image a `1+1` takes about 48 ms over a WebSocket from inside the container, while a client
//! talking ZMQ to the kernel directly has its reply in about 6 ms. The ratio is therefore close
//! to 1 and the added milliseconds say more.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, ExitCode, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::{SinkExt, StreamExt};
use ongrid_e2e::{bench_summary, SimGpu, Site, User};
use reqwest::header::{AUTHORIZATION, COOKIE, ORIGIN, SET_COOKIE};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use serde_json::{json, Value};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::http::HeaderValue;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::WebSocketStream;

/// The session whose JupyterLab both paths reach.
const SESSION: &str = "nb";
/// Rounds on each path before the measured ones (connections, the kernel's first executions).
const WARMUP: usize = 20;
const DEFAULT_ROUNDS: usize = 200;
/// How long a request through the manager may take: JupyterLab's start, whose limit in the
/// manager is 120 s, and a margin, so that the manager's own answer comes first.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(150);
/// How long one round may take before the bench gives up.
const ROUND_TIMEOUT: Duration = Duration::from_secs(30);
/// Where the dev image's launcher records the running server (port, token, base URL).
const SERVER_STATE: &str = "~/.local/state/ongrid-jupyter/server.json";
/// The login cookie of the dashboard.
const LOGIN_COOKIE: &str = "ongrid_dashboard";

const USAGE: &str = "usage: jupyter_bench [--rounds N]  (rounds alternating between ongrid and \
                     ssh -L after 20 warm-up rounds each; default 200)";

fn parse_rounds() -> Result<usize, String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.as_slice() {
        [] => Ok(DEFAULT_ROUNDS),
        [flag, value] if flag == "--rounds" => match value.parse::<usize>() {
            Ok(rounds) if rounds > 0 => Ok(rounds),
            _ => Err(format!(
                "--rounds {value:?} is not a whole number above 0\n{USAGE}"
            )),
        },
        _ => Err(USAGE.to_owned()),
    }
}

fn main() -> ExitCode {
    let rounds = match parse_rounds() {
        Ok(rounds) => rounds,
        Err(message) => {
            eprintln!("{message}");
            return ExitCode::from(2);
        }
    };
    let mut site = Site::start(&[SimGpu::a100(1)]);
    let user = site.user("Bench");
    site.allow_loopback();
    site.add_key(&user);
    site.devctl_ok(&user, &["session", "new", "--name", SESSION, "--wait"]);
    // One thread: both clients are driven from it, one request at a time, so neither waits
    // for a wake-up on another thread.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");

    let manager = site.manager_addr.clone().expect("the manager runs");
    let roots = ca_certificates(&site.pki.ca_dir);
    let dashboard = runtime.block_on(Dashboard::log_in(&site, &user, &manager, &roots));
    let base = format!("/dashboard/sessions/{SESSION}/apps/jupyter/");

    println!("==> JupyterLab of session {SESSION}, started through ongrid");
    let start = Instant::now();
    let status = runtime.block_on(dashboard.get(&format!("{base}api/status")));
    println!(
        "GET {base}api/status (starts JupyterLab): {} ms",
        ms(start.elapsed())
    );
    check_status(&status, "api/status", 200);
    let start = Instant::now();
    let page = runtime.block_on(dashboard.get(&format!("{base}lab")));
    let first_page = start.elapsed();
    check_status(&page, "lab", 200);
    println!(
        "first page (GET {base}lab, cold, {} bytes): {} ms",
        page.1.len(),
        ms(first_page)
    );

    let server = jupyter_server(&site, &user);
    let kernel = runtime.block_on(dashboard.start_kernel(&base));
    let channels = format!("{base}api/kernels/{kernel}/channels");
    println!(
        "kernel {kernel} (python3); JupyterLab on 127.0.0.1:{} in the session",
        server.port
    );

    let mut ongrid = runtime.block_on(Kernel::through_ongrid(&dashboard, &roots, &channels));
    let forward = Forward::start(&site, &user, server.port);
    let mut ssh = runtime.block_on(Kernel::through_forward(
        forward.local_port,
        &server.token,
        &channels,
    ));

    println!(
        "\n==> kernel round trip (execute `1+1` until its execute_reply), {WARMUP} warm-up \
         rounds each, then {rounds} alternating"
    );
    let mut times = [Vec::with_capacity(rounds), Vec::with_capacity(rounds)];
    runtime.block_on(async {
        for _ in 0..WARMUP {
            ongrid.execute().await;
            ssh.execute().await;
        }
        for _ in 0..rounds {
            times[0].push(ongrid.execute().await);
            times[1].push(ssh.execute().await);
        }
        ongrid.close().await;
        ssh.close().await;
    });
    drop(forward);

    for samples in &mut times {
        samples.sort();
    }
    let p = |i: usize, rank: usize| percentile(&times[i], rank);
    for (i, name) in ["ongrid", "ssh -L"].into_iter().enumerate() {
        println!(
            "{name:<8} p50 {} ms, p99 {} ms (n = {rounds})",
            ms(p(i, 50)),
            ms(p(i, 99))
        );
    }
    let ratio = |rank: usize| p(0, rank).as_secs_f64() / p(1, rank).as_secs_f64();
    // What ongrid adds, beside the ratio: most of a round trip is JupyterLab's own.
    let added = |rank: usize| (p(0, rank).as_secs_f64() - p(1, rank).as_secs_f64()) * 1000.0;
    println!(
        "ratio ongrid / ssh -L: p50 {:.2} ({:+.2} ms), p99 {:.2} ({:+.2} ms)",
        ratio(50),
        added(50),
        ratio(99),
        added(99)
    );
    for rank in [50, 99] {
        bench_summary(
            &format!("Jupyter kernel round trip (1+1) p{rank} ({rounds}), ms"),
            &ms(p(0, rank)),
            &ms(p(1, rank)),
            Some(ratio(rank)),
        );
    }
    bench_summary(
        "JupyterLab first page through ongrid, cold, ms",
        &ms(first_page),
        "-",
        None,
    );
    ExitCode::SUCCESS
}

/// The CA certificates of the site's CA directory (`<hash>.0`): the only roots of both clients.
fn ca_certificates(dir: &Path) -> Vec<CertificateDer<'static>> {
    let mut roots = Vec::new();
    let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("read {}: {e}", dir.display()));
    for entry in entries {
        let path = entry.expect("a CA directory entry").path();
        if path.extension().is_some_and(|ext| ext == "0") {
            let certificates = CertificateDer::pem_file_iter(&path)
                .unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
            for certificate in certificates {
                roots.push(certificate.unwrap_or_else(|e| panic!("parse {}: {e}", path.display())));
            }
        }
    }
    assert!(!roots.is_empty(), "no CA certificate in {}", dir.display());
    roots
}

/// A browser logged in to the dashboard: its HTTP client and login cookie.
struct Dashboard {
    client: reqwest::Client,
    /// `host:port` of the manager.
    manager: String,
    /// `https://host:port`, which requests that change something carry as `Origin`.
    origin: String,
    /// `ongrid_dashboard=...`, as the `Cookie` header carries it.
    cookie: String,
}

impl Dashboard {
    /// Logs in with a one-time link of `devctl dashboard`, as the link's page does.
    async fn log_in(
        site: &Site,
        user: &User,
        manager: &str,
        roots: &[CertificateDer<'static>],
    ) -> Self {
        let mut builder = reqwest::Client::builder()
            .use_rustls_tls()
            .tls_built_in_root_certs(false)
            .redirect(reqwest::redirect::Policy::none());
        for root in roots {
            let certificate = reqwest::Certificate::from_der(root).expect("a CA certificate");
            builder = builder.add_root_certificate(certificate);
        }
        let client = builder.build().expect("an HTTP client");
        let link: Value = site
            .devctl_json(user, &["dashboard"])
            .expect("devctl dashboard");
        let url = link["url"].as_str().expect("the link's url");
        let token = url
            .split_once("token=")
            .map(|(_, rest)| rest.split('&').next().unwrap_or_default())
            .unwrap_or_else(|| panic!("no token in the login link {url}"));
        let origin = format!("https://{manager}");
        let answer = client
            .post(format!("{origin}/dashboard/login"))
            .header(ORIGIN, &origin)
            .form(&[("token", token)])
            .send()
            .await
            .expect("POST /dashboard/login");
        assert!(
            answer.status().is_redirection(),
            "POST /dashboard/login answered {}: {}",
            answer.status(),
            answer.text().await.unwrap_or_default()
        );
        let cookie = answer
            .headers()
            .get_all(SET_COOKIE)
            .iter()
            .filter_map(|value| value.to_str().ok())
            .filter_map(|value| value.split(';').next())
            .find(|pair| pair.starts_with(&format!("{LOGIN_COOKIE}=")))
            .unwrap_or_else(|| panic!("POST /dashboard/login set no {LOGIN_COOKIE} cookie"))
            .to_owned();
        Self {
            client,
            manager: manager.to_owned(),
            origin,
            cookie,
        }
    }

    /// `GET path` with the login cookie: the status and the whole body.
    async fn get(&self, path: &str) -> (reqwest::StatusCode, Vec<u8>) {
        let answer = self
            .client
            .get(format!("{}{path}", self.origin))
            .header(COOKIE, &self.cookie)
            .timeout(REQUEST_TIMEOUT)
            .send()
            .await
            .unwrap_or_else(|e| panic!("GET {path}: {e}"));
        let status = answer.status();
        let body = answer
            .bytes()
            .await
            .unwrap_or_else(|e| panic!("the body of GET {path}: {e}"));
        (status, body.to_vec())
    }

    /// `POST <base>api/kernels` (a python3 kernel): its id.
    async fn start_kernel(&self, base: &str) -> String {
        let path = format!("{base}api/kernels");
        let answer = self
            .client
            .post(format!("{}{path}", self.origin))
            .header(COOKIE, &self.cookie)
            .header(ORIGIN, &self.origin)
            .json(&json!({"name": "python3"}))
            .timeout(REQUEST_TIMEOUT)
            .send()
            .await
            .unwrap_or_else(|e| panic!("POST {path}: {e}"));
        let status = answer.status();
        let body = answer.bytes().await.expect("the new kernel");
        check_status(&(status, body.to_vec()), "api/kernels", 201);
        let kernel: Value = serde_json::from_slice(&body).expect("the new kernel's JSON");
        kernel["id"]
            .as_str()
            .unwrap_or_else(|| panic!("no id in the new kernel: {kernel}"))
            .to_owned()
    }
}

fn check_status(answer: &(reqwest::StatusCode, Vec<u8>), what: &str, expected: u16) {
    assert_eq!(
        answer.0.as_u16(),
        expected,
        "{what} through ongrid answered {}: {}",
        answer.0,
        String::from_utf8_lossy(&answer.1)
    );
}

/// The session's JupyterLab as its launcher recorded it.
struct JupyterServer {
    port: u16,
    token: String,
}

fn jupyter_server(site: &Site, user: &User) -> JupyterServer {
    let out = site.ssh(user, SESSION, &format!("cat {SERVER_STATE}"), b"");
    assert!(
        out.status.success(),
        "reading {SERVER_STATE} in session {SESSION} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let state: Value = serde_json::from_slice(&out.stdout).expect("the launcher's server.json");
    JupyterServer {
        port: state["port"]
            .as_u64()
            .and_then(|port| u16::try_from(port).ok())
            .unwrap_or_else(|| panic!("no port in {state}")),
        token: state["token"]
            .as_str()
            .unwrap_or_else(|| panic!("no token in {SERVER_STATE}"))
            .to_owned(),
    }
}

/// `ssh -N -L` to the session's JupyterLab through the gateway; killed when dropped, also when
/// the bench fails.
struct Forward {
    child: Child,
    local_port: u16,
}

impl Forward {
    fn start(site: &Site, user: &User, remote_port: u16) -> Self {
        // ssh binds the port itself; a port taken in between fails it (ExitOnForwardFailure).
        let local_port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|listener| listener.local_addr())
            .expect("a free loopback port")
            .port();
        let log: PathBuf = site.dir.path().join("ssh-forward.log");
        let stderr = std::fs::File::create(&log).expect("create the ssh log");
        let child = site
            .ssh_command(user, SESSION)
            .args(["-N", "-o", "ExitOnForwardFailure=yes", "-L"])
            .arg(format!("127.0.0.1:{local_port}:127.0.0.1:{remote_port}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .expect("run ssh -L");
        let mut forward = Self { child, local_port };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = forward.child.try_wait().expect("ssh -L's status") {
                panic!(
                    "ssh -L exited ({status}): {}\n{}",
                    std::fs::read_to_string(&log).unwrap_or_default(),
                    site.logs()
                );
            }
            if std::net::TcpStream::connect(("127.0.0.1", local_port)).is_ok() {
                return forward;
            }
            assert!(
                Instant::now() < deadline,
                "ssh -L did not listen on 127.0.0.1:{local_port} within 30 s"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Forward {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One connection to the kernel's channels WebSocket.
struct Kernel<S> {
    socket: WebSocketStream<S>,
    /// The Jupyter session id of this client's messages.
    session: String,
    name: &'static str,
}

impl Kernel<tokio_rustls::client::TlsStream<TcpStream>> {
    /// Through the manager: TLS, the login cookie and the dashboard's origin.
    async fn through_ongrid(
        dashboard: &Dashboard,
        roots: &[CertificateDer<'static>],
        channels: &str,
    ) -> Self {
        let mut store = rustls::RootCertStore::empty();
        for root in roots {
            store.add(root.clone()).expect("a usable CA certificate");
        }
        let config = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .expect("TLS versions")
        .with_root_certificates(store)
        .with_no_client_auth();
        let addr: SocketAddr = dashboard.manager.parse().expect("the manager's address");
        let tcp = TcpStream::connect(addr).await.expect("connect the manager");
        tcp.set_nodelay(true).expect("TCP_NODELAY");
        let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
            .connect(ServerName::IpAddress(addr.ip().into()), tcp)
            .await
            .expect("TLS to the manager");
        let mut request = format!("wss://{}{channels}", dashboard.manager)
            .into_client_request()
            .expect("the WebSocket request");
        let headers = request.headers_mut();
        headers.insert(COOKIE, header(&dashboard.cookie));
        headers.insert(ORIGIN, header(&dashboard.origin));
        Self::handshake(request, tls, "ongrid").await
    }
}

impl Kernel<TcpStream> {
    /// Through the `ssh -L` forward: plain WebSocket with JupyterLab's token.
    async fn through_forward(local_port: u16, token: &str, channels: &str) -> Self {
        let tcp = TcpStream::connect(("127.0.0.1", local_port))
            .await
            .expect("connect the forward");
        tcp.set_nodelay(true).expect("TCP_NODELAY");
        let mut request = format!("ws://127.0.0.1:{local_port}{channels}")
            .into_client_request()
            .expect("the WebSocket request");
        request
            .headers_mut()
            .insert(AUTHORIZATION, header(&format!("token {token}")));
        Self::handshake(request, tcp, "ssh -L").await
    }
}

fn header(value: &str) -> HeaderValue {
    HeaderValue::from_str(value).expect("a valid header value")
}

impl<S: AsyncRead + AsyncWrite + Unpin> Kernel<S> {
    async fn handshake(
        request: tokio_tungstenite::tungstenite::handshake::client::Request,
        stream: S,
        name: &'static str,
    ) -> Self {
        let (socket, _answer) = tokio_tungstenite::client_async(request, stream)
            .await
            .unwrap_or_else(|e| panic!("the kernel's WebSocket through {name}: {e}"));
        Self {
            socket,
            session: uuid::Uuid::new_v4().to_string(),
            name,
        }
    }

    /// One `execute_request` of `1+1`: the time until its `execute_reply` arrived.
    async fn execute(&mut self) -> Duration {
        let msg_id = uuid::Uuid::new_v4().to_string();
        let request = json!({
            "header": {
                "msg_id": msg_id,
                "msg_type": "execute_request",
                "session": self.session,
                "username": "bench",
                "version": "5.3",
                "date": chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
            },
            "parent_header": {},
            "metadata": {},
            "content": {
                "code": "1+1",
                "silent": false,
                "store_history": false,
                "user_expressions": {},
                "allow_stdin": false,
                "stop_on_error": true,
            },
            "channel": "shell",
            "buffers": [],
        })
        .to_string();
        let start = Instant::now();
        let reply = tokio::time::timeout(ROUND_TIMEOUT, async {
            self.socket
                .send(Message::text(request))
                .await
                .unwrap_or_else(|e| panic!("sending through {}: {e}", self.name));
            loop {
                let message = self
                    .socket
                    .next()
                    .await
                    .unwrap_or_else(|| panic!("the kernel's WebSocket through {} ended", self.name))
                    .unwrap_or_else(|e| panic!("reading through {}: {e}", self.name));
                let Message::Text(text) = message else {
                    continue;
                };
                // Only the messages about this request carry its id; the rest are skipped
                // unparsed.
                if !text.as_str().contains(&msg_id) {
                    continue;
                }
                let message: Value =
                    serde_json::from_str(text.as_str()).expect("a Jupyter message");
                if message["header"]["msg_type"] == "execute_reply"
                    && message["parent_header"]["msg_id"] == msg_id.as_str()
                {
                    return message;
                }
            }
        })
        .await;
        let elapsed = start.elapsed();
        let reply = reply.unwrap_or_else(|_| {
            panic!(
                "no execute_reply through {} within {} s",
                self.name,
                ROUND_TIMEOUT.as_secs()
            )
        });
        assert_eq!(
            reply["content"]["status"], "ok",
            "1+1 through {} failed: {reply}",
            self.name
        );
        elapsed
    }

    async fn close(&mut self) {
        let _ = self.socket.close(None).await;
    }
}

/// The nearest-rank percentile of sorted samples.
fn percentile(sorted: &[Duration], p: usize) -> Duration {
    let rank = (p * sorted.len()).div_ceil(100).max(1);
    sorted[rank - 1]
}

/// Milliseconds with two decimals (a round trip is a few of them).
fn ms(d: Duration) -> String {
    format!("{:.2}", d.as_secs_f64() * 1000.0)
}
