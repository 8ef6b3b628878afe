//! The stream endpoint against the real Docker daemon, driven like the gateway drives it: a
//! WebSocket client over TLS (rustls, a throwaway CA from rcgen) with the gateway's token, a
//! `StreamOpen`, then frames. Each test converges its own dev container.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use futures::{SinkExt, StreamExt};
use ongrid_agent::config::{StreamsConfig, Token};
use ongrid_agent::runtime::inject::SFTP_SERVER_PATHS;
use ongrid_agent::runtime::ContainerRuntime;
use ongrid_agent::stream_identity;
use ongrid_agent::streams::StreamServer;
use ongrid_core::api::{ContainerState, DesiredSession};
use ongrid_core::stream::{ExitStatus, Frame, Pty, StreamKind, StreamOpen, MAX_FRAME_PAYLOAD};
use ongrid_core::Dn;
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::rustls;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::http::header::AUTHORIZATION;
use tokio_tungstenite::tungstenite::{self, Message};
use tokio_tungstenite::WebSocketStream;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::netns::TestNetns;
use crate::{docker, eventually, unique, TestNode, IMAGE};

const GATEWAY_TOKEN: &str = "gateway-token-abcdef0123";
/// How long a test waits for any one frame before failing.
const FRAME_TIMEOUT: Duration = Duration::from_secs(30);

/// A dev container of its own and the agent's stream endpoint in front of it.
struct Fixture {
    /// Removes the containers and volumes when the fixture is dropped.
    _node: TestNode,
    session: DesiredSession,
    address: SocketAddr,
    connector: tokio_rustls::TlsConnector,
    shutdown: CancellationToken,
    _pki: tempfile::TempDir,
}

impl Fixture {
    async fn start() -> Self {
        Self::start_on(IMAGE).await
    }

    /// A fixture whose session runs `image`.
    async fn start_on(image: &str) -> Self {
        let node = TestNode::new().await;
        let session = DesiredSession {
            image: image.to_owned(),
            ..node.session()
        };
        let mut reconciler = node.reconciler();
        reconciler
            .converge(std::slice::from_ref(&session))
            .await
            .expect("Docker lists containers");
        let observed = reconciler.observe().await.expect("Docker lists containers");
        assert_eq!(observed.len(), 1, "{observed:?}");
        assert_eq!(observed[0].state, ContainerState::Running, "{observed:?}");

        // A CA, and the agent's certificate for 127.0.0.1 signed by it.
        let pki = tempfile::tempdir().expect("temp dir");
        let ca_key = rcgen::KeyPair::generate().expect("key");
        let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca = ca_params.self_signed(&ca_key).expect("CA");
        let key = rcgen::KeyPair::generate().expect("key");
        let cert = rcgen::CertificateParams::new(vec!["127.0.0.1".to_owned()])
            .expect("params")
            .signed_by(&key, &ca, &ca_key)
            .expect("agent certificate");
        let (cert_path, key_path) = (pki.path().join("agent.crt"), pki.path().join("agent.key"));
        std::fs::write(&cert_path, cert.pem()).expect("cert file");
        std::fs::write(&key_path, key.serialize_pem()).expect("key file");

        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let address = listener.local_addr().expect("address");
        let config = StreamsConfig {
            listen: address,
            url: None,
            tls_cert: cert_path.clone(),
            tls: Arc::new(
                stream_identity::server_config(&cert_path, &key_path).expect("TLS identity"),
            ),
            gateway_token: Token::new(GATEWAY_TOKEN),
        };
        assert_eq!(
            StreamServer::url(&config, address),
            format!("wss://{address}")
        );
        let runtime: Arc<dyn ContainerRuntime> = node.runtime.clone();
        let server = Arc::new(StreamServer::new(node.node.clone(), runtime, &config));
        let shutdown = CancellationToken::new();
        let tracker = TaskTracker::new();
        tokio::spawn(server.serve(listener, tracker, shutdown.clone()));

        let mut roots = rustls::RootCertStore::empty();
        roots.add(ca.der().clone()).expect("CA certificate");
        let client = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .expect("protocol versions")
        .with_root_certificates(roots)
        .with_no_client_auth();
        Self {
            _node: node,
            session,
            address,
            connector: tokio_rustls::TlsConnector::from(Arc::new(client)),
            shutdown,
            _pki: pki,
        }
    }

    fn open(&self, kind: StreamKind) -> StreamOpen {
        StreamOpen {
            session_id: self.session.session_id,
            owner: self.session.owner.clone(),
            kind,
            env: vec![("LANG".to_owned(), "C.UTF-8".to_owned())],
        }
    }

    /// The WebSocket handshake with `token` on `path`: the stream, or tungstenite's error.
    async fn connect_with(
        &self,
        token: Option<&str>,
        path: &str,
    ) -> Result<WebSocketStream<tokio_rustls::client::TlsStream<TcpStream>>, tungstenite::Error>
    {
        let tcp = TcpStream::connect(self.address).await.expect("TCP connect");
        let name = rustls::pki_types::ServerName::try_from("127.0.0.1").expect("server name");
        let tls = self
            .connector
            .connect(name, tcp)
            .await
            .expect("TLS handshake");
        let mut request = format!("wss://{}{path}", self.address)
            .into_client_request()
            .expect("request");
        if let Some(token) = token {
            request.headers_mut().insert(
                AUTHORIZATION,
                format!("Bearer {token}").parse().expect("header value"),
            );
        }
        tokio_tungstenite::client_async(request, tls)
            .await
            .map(|(ws, _)| ws)
    }

    /// Opens a stream as the gateway does.
    async fn stream(&self, open: StreamOpen) -> Client {
        let mut ws = self
            .connect_with(Some(GATEWAY_TOKEN), "/v1/streams")
            .await
            .expect("WebSocket handshake");
        let json = serde_json::to_string(&open).expect("JSON");
        ws.send(Message::Text(json.into())).await.expect("send");
        Client { ws }
    }

    async fn exec(&self, command: &str) -> Client {
        self.stream(self.open(StreamKind::Exec {
            command: command.to_owned(),
            pty: None,
        }))
        .await
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// The gateway's end of one stream.
struct Client {
    ws: WebSocketStream<tokio_rustls::client::TlsStream<TcpStream>>,
}

impl Client {
    async fn send(&mut self, frame: Frame) {
        self.ws
            .send(Message::Binary(frame.encode().into()))
            .await
            .expect("send a frame");
    }

    /// The next frame, or `None` once the agent closed the stream.
    async fn next(&mut self) -> Option<Frame> {
        let message = tokio::time::timeout(FRAME_TIMEOUT, self.ws.next())
            .await
            .expect("a frame within 30 s");
        match message {
            None | Some(Ok(Message::Close(_))) => None,
            Some(Ok(Message::Binary(bytes))) => {
                let frame = Frame::decode(&bytes).expect("a valid frame");
                if let Frame::Data(bytes) | Frame::Stderr(bytes) = &frame {
                    assert!(bytes.len() <= MAX_FRAME_PAYLOAD);
                }
                Some(frame)
            }
            Some(Ok(other)) => panic!("unexpected message {other:?}"),
            Some(Err(e)) => panic!("the stream broke: {e}"),
        }
    }

    async fn expect_ready(&mut self) {
        assert_eq!(self.next().await, Some(Frame::Ready));
    }

    /// Everything until the close, with stdout and stderr joined per stream and the frames
    /// after the output kept in order.
    async fn finish(&mut self) -> Finished {
        let mut finished = Finished::default();
        while let Some(frame) = self.next().await {
            match frame {
                Frame::Data(bytes) if finished.after.is_empty() => finished.stdout.extend(bytes),
                Frame::Stderr(bytes) if finished.after.is_empty() => finished.stderr.extend(bytes),
                other => finished.after.push(other),
            }
        }
        finished
    }

    /// Sends one SFTP packet (a length, its type, the rest).
    async fn send_sftp(&mut self, kind: u8, body: &[u8]) {
        let length = u32::try_from(body.len() + 1).expect("small packet");
        let mut packet = length.to_be_bytes().to_vec();
        packet.push(kind);
        packet.extend(body);
        self.send(Frame::Data(packet)).await;
    }

    /// The next SFTP packet from the server: its type and the rest.
    async fn sftp_reply(&mut self) -> (u8, Vec<u8>) {
        let mut packet = Vec::new();
        loop {
            if packet.len() >= 5 {
                let length = u32::from_be_bytes(packet[..4].try_into().expect("4 bytes"));
                if packet.len() >= 4 + length as usize {
                    assert_eq!(packet.len(), 4 + length as usize, "one packet at a time");
                    return (packet[4], packet[5..].to_vec());
                }
            }
            match self.next().await {
                Some(Frame::Data(bytes)) => packet.extend(bytes),
                other => panic!("expected an SFTP packet, got {other:?} after {packet:?}"),
            }
        }
    }

    /// `SSH_FXP_INIT` version 3, answered by `SSH_FXP_VERSION` 3.
    async fn sftp_init(&mut self) {
        self.send_sftp(1, &3u32.to_be_bytes()).await;
        let (kind, body) = self.sftp_reply().await;
        assert_eq!(kind, 2, "SSH_FXP_VERSION");
        assert_eq!(body[..4], [0, 0, 0, 3], "version 3");
    }

    /// Reads output until it contains `wanted`; the output so far.
    async fn read_until(&mut self, wanted: &str) -> String {
        let mut output = Vec::new();
        loop {
            match self.next().await {
                Some(Frame::Data(bytes)) => output.extend(bytes),
                other => panic!(
                    "expected output containing {wanted:?}, got {other:?} after {:?}",
                    String::from_utf8_lossy(&output)
                ),
            }
            let text = String::from_utf8_lossy(&output).into_owned();
            if text.contains(wanted) {
                return text;
            }
        }
    }
}

#[derive(Debug, Default)]
struct Finished {
    stdout: Vec<u8>,
    stderr: Vec<u8>,
    /// The frames after the output: `Eof`, `Exit` (or an `Error`).
    after: Vec<Frame>,
}

impl Finished {
    fn stdout(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }

    fn stderr(&self) -> String {
        String::from_utf8_lossy(&self.stderr).into_owned()
    }

    fn exited_with(&self, code: u32) -> bool {
        self.after == [Frame::Eof, Frame::Exit(ExitStatus::Code { code })]
    }
}

#[tokio::test]
async fn exec_runs_as_the_user_and_reports_exit_codes_with_stderr_apart() {
    let fixture = Fixture::start().await;
    let mut client = fixture
        .exec("echo out; echo err >&2; id -u; pwd; echo $LANG $HOME $USER; exit 3")
        .await;
    client.expect_ready().await;
    let finished = client.finish().await;
    let login = fixture.session.user.name.as_str();
    let uid = fixture.session.user.uid;
    assert_eq!(
        finished.stdout(),
        format!("out\n{uid}\n/home/{login}\nC.UTF-8 /home/{login} {login}\n")
    );
    assert_eq!(finished.stderr, b"err\n");
    assert!(finished.exited_with(3), "{:?}", finished.after);

    // sshd semantics: the command goes whole to the shell, quoting and all.
    let mut client = fixture.exec(r#"printf '%s|' "a  b" 'c"d'; false"#).await;
    client.expect_ready().await;
    let finished = client.finish().await;
    assert_eq!(finished.stdout(), r#"a  b|c"d|"#);
    assert!(finished.exited_with(1), "{:?}", finished.after);
}

#[tokio::test]
async fn stdin_eof_ends_cat_and_its_output_comes_before_the_exit() {
    let fixture = Fixture::start().await;
    // `ssh host 'cat > f' < file`, then reading it back.
    let input: Vec<u8> = (0..300_000u32).map(|i| (i % 253) as u8).collect();
    let mut client = fixture.exec("cat > ~/upload.bin").await;
    client.expect_ready().await;
    for chunk in input.chunks(MAX_FRAME_PAYLOAD) {
        client.send(Frame::Data(chunk.to_vec())).await;
    }
    client.send(Frame::Eof).await;
    let finished = client.finish().await;
    assert!(finished.exited_with(0), "{:?}", finished.after);

    let mut client = fixture.exec("cat ~/upload.bin").await;
    client.expect_ready().await;
    client.send(Frame::Eof).await;
    let finished = client.finish().await;
    assert_eq!(finished.stdout.len(), input.len());
    assert!(finished.stdout == input, "the file comes back unchanged");
    assert!(finished.exited_with(0), "{:?}", finished.after);

    // A pipe: what goes in comes out before EOF and the exit status.
    let mut client = fixture.exec("cat; echo done").await;
    client.expect_ready().await;
    client.send(Frame::Data(b"first\n".to_vec())).await;
    client.send(Frame::Data(b"second\n".to_vec())).await;
    client.send(Frame::Eof).await;
    let finished = client.finish().await;
    assert_eq!(finished.stdout(), "first\nsecond\ndone\n");
    assert!(finished.exited_with(0), "{:?}", finished.after);
}

#[tokio::test]
async fn a_terminal_has_the_clients_type_and_size_and_follows_resizes() {
    let fixture = Fixture::start().await;
    let pty = Pty {
        term: "xterm-256color".to_owned(),
        cols: 120,
        rows: 40,
    };
    // A command with a terminal sees its size at once.
    let mut client = fixture
        .stream(fixture.open(StreamKind::Exec {
            command: "stty size; echo $TERM; tty".to_owned(),
            pty: Some(pty.clone()),
        }))
        .await;
    client.expect_ready().await;
    let finished = client.finish().await;
    let stdout = finished.stdout();
    assert!(
        stdout.starts_with("40 120\r\nxterm-256color\r\n/dev/pts/"),
        "{stdout:?}"
    );
    assert!(finished.exited_with(0), "{:?}", finished.after);

    // An interactive login shell.
    let mut client = fixture
        .stream(fixture.open(StreamKind::Shell { pty: Some(pty) }))
        .await;
    client.expect_ready().await;
    client
        .send(Frame::Data(b"echo size=$(stty size) term=$TERM\n".to_vec()))
        .await;
    client.read_until("size=40 120 term=xterm-256color").await;
    client
        .send(Frame::Resize {
            cols: 100,
            rows: 30,
        })
        .await;
    client
        .send(Frame::Data(b"echo now=$(stty size)\n".to_vec()))
        .await;
    client.read_until("now=30 100").await;
    client.send(Frame::Data(b"exit 7\n".to_vec())).await;
    let finished = client.finish().await;
    assert!(finished.exited_with(7), "{:?}", finished.after);
    // The gateway going away hangs the terminal up: its process gets SIGHUP.
    let mut client = fixture
        .stream(fixture.open(StreamKind::Exec {
            command: "sleep 101".to_owned(),
            pty: Some(Pty {
                term: "xterm".to_owned(),
                cols: 80,
                rows: 24,
            }),
        }))
        .await;
    client.expect_ready().await;
    let container = fixture.session.session_id.container_name();
    let sleeping = || {
        docker(&[
            "exec",
            &container,
            "sh",
            "-c",
            "ps -eo args | grep -cx 'sleep 101' || true",
        ])
    };
    // Ready means Docker started the exec; the process inside may start a moment later.
    eventually(Duration::from_secs(20), "the sleep to start", || {
        (sleeping() == "1").then_some(())
    })
    .await;
    drop(client);
    eventually(Duration::from_secs(20), "the hung-up sleep to end", || {
        (sleeping() == "0").then_some(())
    })
    .await;
}

#[tokio::test]
async fn a_signal_ends_a_running_command() {
    let fixture = Fixture::start().await;
    let mut client = fixture.exec("sleep 100").await;
    client.expect_ready().await;
    let started = std::time::Instant::now();
    client.send(Frame::Signal("INT".to_owned())).await;
    let finished = client.finish().await;
    // Killed by SIGINT: Docker reports 128 + 2, and the agent reports that code.
    assert!(finished.exited_with(130), "{:?}", finished.after);
    assert!(started.elapsed() < Duration::from_secs(30));

    // TERM to a shell running a pipeline reaches the whole process group.
    let mut client = fixture.exec("sleep 100 | cat; echo not reached").await;
    client.expect_ready().await;
    client.send(Frame::Signal("TERM".to_owned())).await;
    let finished = client.finish().await;
    assert_eq!(finished.stdout(), "");
    assert!(finished.exited_with(143), "{:?}", finished.after);
    assert_eq!(
        docker(&[
            "exec",
            &fixture.session.session_id.container_name(),
            "sh",
            "-c",
            "ps -eo args | grep -cx 'sleep 100' || true"
        ]),
        "0",
        "no sleep left behind"
    );
}

#[tokio::test]
async fn sftp_and_legacy_scp_work() {
    let fixture = Fixture::start().await;
    let mut client = fixture
        .stream(fixture.open(StreamKind::Subsystem {
            name: "sftp".to_owned(),
        }))
        .await;
    client.expect_ready().await;
    // SSH_FXP_INIT, version 3: length 5, type 1, version.
    client
        .send(Frame::Data(vec![0, 0, 0, 5, 1, 0, 0, 0, 3]))
        .await;
    let reply = match client.next().await {
        Some(Frame::Data(bytes)) => bytes,
        other => panic!("expected SSH_FXP_VERSION, got {other:?}"),
    };
    assert!(reply.len() >= 9, "{reply:?}");
    assert_eq!(reply[4], 2, "SSH_FXP_VERSION");
    assert_eq!(reply[5..9], [0, 0, 0, 3], "version 3");
    client.send(Frame::Eof).await;
    let finished = client.finish().await;
    assert!(finished.exited_with(0), "{:?}", finished.after);

    // `scp -O` runs `scp -t` in the container: the sink side of the old protocol.
    let mut client = fixture.exec("scp -t ~/via-scp.txt").await;
    client.expect_ready().await;
    assert_eq!(client.next().await, Some(Frame::Data(vec![0])), "ready");
    client
        .send(Frame::Data(b"C0640 6 via-scp.txt\n".to_vec()))
        .await;
    assert_eq!(
        client.next().await,
        Some(Frame::Data(vec![0])),
        "header accepted"
    );
    client.send(Frame::Data(b"hello\n\0".to_vec())).await;
    assert_eq!(
        client.next().await,
        Some(Frame::Data(vec![0])),
        "file written"
    );
    client.send(Frame::Eof).await;
    let finished = client.finish().await;
    assert!(finished.exited_with(0), "{:?}", finished.after);
    let mut client = fixture
        .exec("stat -c %a ~/via-scp.txt; cat ~/via-scp.txt")
        .await;
    client.expect_ready().await;
    assert_eq!(client.finish().await.stdout(), "640\nhello\n");

    // The image's own server was used: nothing was copied in.
    let mut client = fixture.exec("test -e /run/ongrid").await;
    client.expect_ready().await;
    assert!(client.finish().await.exited_with(1));
}

/// The dev image without any sftp-server and without `/run`, built for one test (no registry:
/// the base is local) and removed after it.
struct ImageWithoutSftp {
    tag: String,
}

impl ImageWithoutSftp {
    fn build() -> Self {
        let context = tempfile::tempdir().expect("temp dir");
        let dockerfile = format!(
            "FROM {IMAGE}\nRUN rm -f {} && rm -rf /run\n",
            SFTP_SERVER_PATHS.join(" ")
        );
        std::fs::write(context.path().join("Dockerfile"), dockerfile).expect("Dockerfile");
        let tag = format!("ongrid-test/no-sftp:{}", unique());
        let context_path = context.path().to_str().expect("UTF-8 path");
        docker(&["build", "-q", "-t", &tag, context_path]);
        Self { tag }
    }
}

impl Drop for ImageWithoutSftp {
    fn drop(&mut self) {
        let _ = std::process::Command::new("docker")
            .args(["rmi", "-f", &self.tag])
            .output();
    }
}

#[tokio::test]
async fn an_image_without_sftp_server_gets_the_nodes_read_only() {
    assert!(
        SFTP_SERVER_PATHS
            .iter()
            .any(|p| std::path::Path::new(p).exists()),
        "this test needs an sftp-server on the machine: apt-get install openssh-sftp-server"
    );
    // Dropped in reverse order: the containers go before their image.
    let image = ImageWithoutSftp::build();
    let fixture = Fixture::start_on(&image.tag).await;
    let login = fixture.session.user.name.as_str().to_owned();
    let run = |script: &str| {
        let fixture = &fixture;
        let script = script.to_owned();
        async move {
            let mut client = fixture.exec(&script).await;
            client.expect_ready().await;
            client.finish().await
        }
    };
    let missing = run(&format!(
        "for p in {} /run; do test -e $p && echo $p; done; true",
        SFTP_SERVER_PATHS.join(" ")
    ))
    .await;
    assert_eq!(
        missing.stdout(),
        "",
        "the image has no sftp-server and no /run"
    );

    // Three streams at once are the container's first sftp: one copy serves them all.
    let sftp = || {
        fixture.stream(fixture.open(StreamKind::Subsystem {
            name: "sftp".to_owned(),
        }))
    };
    let mut clients = futures::future::join_all((0..3).map(|_| async {
        let mut client = sftp().await;
        client.expect_ready().await;
        client.sftp_init().await;
        client
    }))
    .await;
    // SSH_FXP_REALPATH "." (id 7): the server runs in the user's home, and knows the user.
    let mut body = 7u32.to_be_bytes().to_vec();
    body.extend(1u32.to_be_bytes());
    body.push(b'.');
    clients[0].send_sftp(16, &body).await;
    let (kind, reply) = clients[0].sftp_reply().await;
    assert_eq!(kind, 104, "SSH_FXP_NAME: {reply:?}");
    assert_eq!(reply[..8], [0, 0, 0, 7, 0, 0, 0, 1], "id 7, one name");
    let home = format!("/home/{login}");
    assert_eq!(reply[8..12], (home.len() as u32).to_be_bytes());
    assert_eq!(reply[12..12 + home.len()], *home.as_bytes());
    for client in &mut clients {
        client.send(Frame::Eof).await;
        let finished = client.finish().await;
        assert!(finished.exited_with(0), "{:?}", finished.after);
    }

    // Root's and read-only, under /run/ongrid only.
    let listing = run("cd /run/ongrid && find . | sort | xargs stat -c '%u:%g %a %n'").await;
    let lines: Vec<&str> = listing
        .stdout
        .split(|b| *b == b'\n')
        .filter(|l| !l.is_empty())
        .map(|l| std::str::from_utf8(l).expect("UTF-8"))
        .collect();
    assert!(lines.len() >= 7, "{lines:?}");
    for line in &lines {
        let (owner_mode, path) = line.rsplit_once(' ').expect("stat line");
        let expected = match path {
            "." | "./sftp" | "./sftp/lib" => "0:0 755",
            "./sftp/command" => "0:0 444",
            _ => "0:0 555",
        };
        assert_eq!(owner_mode, expected, "{line}");
    }
    assert!(
        lines.iter().any(|l| l.ends_with("./sftp/sftp-server")),
        "{lines:?}"
    );
    assert!(
        lines.iter().any(|l| l.contains("./sftp/lib/ld-")),
        "the loader: {lines:?}"
    );
    assert!(
        lines.iter().any(|l| l.contains("./sftp/lib/libc.")),
        "the C library: {lines:?}"
    );
    let changes = run("echo x > /run/ongrid/sftp/sftp-server; echo $?; \
         rm -f /run/ongrid/sftp/sftp-server; echo $?; \
         touch /run/ongrid/sftp/lib/extra; echo $?; \
         mv /run/ongrid /tmp/ongrid; echo $?")
    .await;
    assert!(
        changes.stdout().lines().all(|code| code != "0") && changes.stdout().lines().count() == 4,
        "the user changed the injected files: {}",
        changes.stdout()
    );
    assert!(
        changes.stderr().contains("Permission denied"),
        "{}",
        changes.stderr()
    );

    // A later stream finds the copy and does not make another (the same file, not replaced).
    let inode = || run("stat -c %i /run/ongrid/sftp/sftp-server /run/ongrid/sftp/command");
    let before = inode().await.stdout();
    let mut client = sftp().await;
    client.expect_ready().await;
    client.sftp_init().await;
    client.send(Frame::Eof).await;
    assert!(client.finish().await.exited_with(0));
    assert_eq!(inode().await.stdout(), before);
}

#[tokio::test]
async fn direct_tcpip_reaches_the_containers_loopback_and_nothing_else() {
    let fixture = Fixture::start().await;
    let container = fixture.session.session_id.container_name();
    let uid = fixture.session.user.uid.to_string();
    docker(&[
        "exec",
        "-d",
        "-u",
        &uid,
        &container,
        "python3",
        "-m",
        "http.server",
        "8888",
        "--bind",
        "127.0.0.1",
    ]);
    let forward = |host: &str, port| StreamKind::DirectTcpip {
        host: host.to_owned(),
        port,
    };
    // The server takes a moment to listen: retry while nothing does.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let mut client = loop {
        let mut client = fixture
            .stream(fixture.open(forward("localhost", 8888)))
            .await;
        match client.next().await {
            Some(Frame::Ready) => break client,
            Some(Frame::Error(message)) if message.contains("nothing listens") => {
                assert!(tokio::time::Instant::now() < deadline, "{message}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            other => panic!("unexpected {other:?}"),
        }
    };
    client
        .send(Frame::Data(b"GET / HTTP/1.0\r\n\r\n".to_vec()))
        .await;
    client.send(Frame::Eof).await;
    let finished = client.finish().await;
    assert!(
        finished.stdout().starts_with("HTTP/1.0 200"),
        "{}",
        finished.stdout()
    );
    assert_eq!(
        finished.after,
        [Frame::Eof],
        "the server closed; no exit status"
    );

    // Nothing listens on that port inside the container.
    let mut client = fixture.stream(fixture.open(forward("127.0.0.1", 9))).await;
    assert_eq!(
        client.next().await,
        Some(Frame::Error(
            "nothing listens on 127.0.0.1:9 inside session train1".to_owned()
        ))
    );
    assert_eq!(client.next().await, None);

    // The node's own loopback is not the container's: a listener of the host is not reached.
    let host_listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let host_port = host_listener.local_addr().expect("address").port();
    let mut client = fixture
        .stream(fixture.open(forward("127.0.0.1", host_port)))
        .await;
    let answer = client.next().await;
    assert!(
        matches!(&answer, Some(Frame::Error(m)) if m.starts_with("nothing listens")),
        "{answer:?}"
    );

    // Destinations outside the container are refused before anything connects. Each one is
    // on this machine (a namespace of the test's own, listening), so a regression would
    // connect here and be seen, never leave the machine: the address, the same address as a
    // name (a number the resolver reads without asking DNS), and Docker's bridge.
    let netns = TestNetns::new(&[[198, 51, 100]]);
    let outside = netns.listener();
    outside.set_nonblocking(true).expect("non-blocking");
    let port = outside.local_addr().expect("bound").port();
    let as_number = u32::from(Ipv4Addr::new(198, 51, 100, 2)).to_string();
    for host in ["198.51.100.2", as_number.as_str(), "172.17.0.1"] {
        let mut client = fixture.stream(fixture.open(forward(host, port))).await;
        assert_eq!(
            client.next().await,
            Some(Frame::Error(format!(
                "only destinations inside the container (localhost) can be forwarded, not {host}"
            )))
        );
        assert_eq!(client.next().await, None);
    }
    assert_eq!(
        outside.accept().map(|(_, peer)| peer).map_err(|e| e.kind()),
        Err(std::io::ErrorKind::WouldBlock),
        "a refused destination was connected to"
    );
}

#[tokio::test]
async fn wrong_tokens_and_other_owners_are_refused() {
    let fixture = Fixture::start().await;
    for (token, path, status) in [
        (Some("not-the-token"), "/v1/streams", 401),
        (None, "/v1/streams", 401),
        (Some(GATEWAY_TOKEN), "/v1/other", 404),
    ] {
        match fixture.connect_with(token, path).await {
            Err(tungstenite::Error::Http(response)) => assert_eq!(response.status(), status),
            Err(e) => panic!("expected HTTP {status}, got {e}"),
            Ok(_) => panic!("{token:?} on {path} was accepted"),
        }
    }

    let refused = |open: StreamOpen, expected: String| {
        let fixture = &fixture;
        async move {
            let mut client = fixture.stream(open).await;
            assert_eq!(client.next().await, Some(Frame::Error(expected)));
            assert_eq!(client.next().await, None);
        }
    };
    let shell = StreamKind::Shell { pty: None };
    let mallory = StreamOpen {
        owner: Dn::parse("/DC=org/DC=example/CN=Mallory").expect("DN"),
        ..fixture.open(shell.clone())
    };
    refused(mallory, "session train1 belongs to another user".to_owned()).await;

    // A session of another node on the same Docker daemon is not this agent's.
    let other = TestNode::new().await;
    let foreign = other.session();
    let mut reconciler = other.reconciler();
    reconciler
        .converge(std::slice::from_ref(&foreign))
        .await
        .expect("converged");
    let open = StreamOpen {
        session_id: foreign.session_id,
        owner: foreign.owner.clone(),
        ..fixture.open(shell.clone())
    };
    refused(
        open,
        format!(
            "session {} is not on this node (it may have ended or moved): connect again",
            foreign.session_id
        ),
    )
    .await;

    // A stopped session.
    docker(&[
        "stop",
        "-t",
        "0",
        &fixture.session.session_id.container_name(),
    ]);
    refused(
        fixture.open(shell),
        "session train1 is not running (its container is stopped): see `devctl session show train1`"
            .to_owned(),
    )
    .await;
}
