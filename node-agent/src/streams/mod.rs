//! The stream endpoint of the SSH gateway (protocol: `ongrid_core::stream`). For each SSH
//! channel the gateway opens one WebSocket over TLS here, and the agent runs what the channel
//! asks for in the session's dev container: a shell or command ([`exec`]), the sftp subsystem
//! ([`exec`]), or a TCP connection to the container's loopback ([`tcp`]).
//!
//! A connection goes TCP → TLS ([`tls`], the agent's certificate) → WebSocket upgrade at
//! `/v1/streams` with the gateway's bearer token ([`auth::check_request`]) → one text message,
//! the JSON `StreamOpen` → checks ([`auth::check_open`]: this node's container of the session,
//! the same owner, running) → binary frames until the stream ends, then a close.
//!
//! Every connection is a task of the agent's `TaskTracker`. Frames go through bounded queues of
//! [`QUEUE_FRAMES`] both ways, each frame at most `MAX_FRAME_PAYLOAD` bytes, so one stream holds
//! at most a few MiB whatever its peers do: a slow gateway stops the process's output (it blocks
//! writing), a process that does not read its stdin stops the gateway's sending (TCP flow control
//! of this stream's own connection), and no stream waits for another.

pub mod auth;
pub mod exec;
pub mod host;
pub mod tcp;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use ongrid_core::stream::{Frame, StreamKind, StreamOpen, MAX_FRAME_PAYLOAD, TLS_READ_BUFFER};
use ongrid_core::NodeName;
use ongrid_service::websocket::{self, Incoming, MessageReader, MessageWriter, Side};
use tokio::io::{AsyncRead, AsyncWrite, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::TlsAcceptor;
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, info, warn};

use crate::config::{StreamsConfig, Token};
use crate::runtime::inject::SftpInjector;
use crate::runtime::{error_chain, ContainerRuntime};

/// Frames queued per direction and stream.
pub const QUEUE_FRAMES: usize = 32;
/// How long TLS, the WebSocket upgrade and the `StreamOpen` may take together.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a stream may take to close once the agent stops.
const CLOSE_GRACE: Duration = Duration::from_secs(2);
/// The largest WebSocket message accepted: a tag byte and a payload, or the `StreamOpen` JSON.
const MAX_MESSAGE: usize = MAX_FRAME_PAYLOAD + 1;
/// One stream's frames: what the gateway sent, and where to put what goes to it. When
/// `incoming` ends the gateway is gone; when sending fails, nobody reads any more.
#[derive(Debug)]
pub struct FrameChannel {
    pub incoming: mpsc::Receiver<Frame>,
    pub outgoing: mpsc::Sender<Frame>,
}

/// The stream endpoint of one node.
pub struct StreamServer {
    node: NodeName,
    runtime: Arc<dyn ContainerRuntime>,
    /// Lends the node's sftp-server to images without one, once per container.
    sftp: Arc<SftpInjector>,
    acceptor: TlsAcceptor,
    gateway_token: Token,
}

impl StreamServer {
    pub fn new(node: NodeName, runtime: Arc<dyn ContainerRuntime>, config: &StreamsConfig) -> Self {
        Self {
            node,
            runtime,
            sftp: Arc::new(SftpInjector::default()),
            acceptor: TlsAcceptor::from(config.tls.clone()),
            gateway_token: config.gateway_token.clone(),
        }
    }

    /// The URL the gateway reaches a listener on: `url` from the config, else
    /// `wss://<bound address>`.
    pub fn url(config: &StreamsConfig, bound: SocketAddr) -> String {
        match &config.url {
            Some(url) => url.as_str().trim_end_matches('/').to_owned(),
            None => format!("wss://{bound}"),
        }
    }

    /// Accepts connections on `listener` until `shutdown`; each is a task of `tracker`, and ends
    /// its stream (with an error frame) on shutdown too.
    pub async fn serve(
        self: Arc<Self>,
        listener: TcpListener,
        tracker: TaskTracker,
        shutdown: CancellationToken,
    ) {
        let address = listener.local_addr().ok();
        info!(node = %self.node, address = ?address, "Stream endpoint listening.");
        loop {
            let accepted = tokio::select! {
                accepted = listener.accept() => accepted,
                () = shutdown.cancelled() => break,
            };
            match accepted {
                Ok((tcp, peer)) => {
                    let server = self.clone();
                    let shutdown = shutdown.clone();
                    tracker.spawn(async move { server.connection(tcp, peer, shutdown).await });
                }
                Err(e) => {
                    // Out of file descriptors and the like: pause rather than spin.
                    warn!(error = %e, "Cannot accept a stream connection.");
                    tokio::select! {
                        () = tokio::time::sleep(Duration::from_millis(100)) => {}
                        () = shutdown.cancelled() => break,
                    }
                }
            }
        }
        info!(node = %self.node, "Stream endpoint stopped.");
    }

    async fn connection(&self, tcp: TcpStream, peer: SocketAddr, shutdown: CancellationToken) {
        let _ = tcp.set_nodelay(true);
        let handshake = self.handshake(tcp);
        let ((source, sink), open) = match tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake).await
        {
            Ok(Ok(opened)) => opened,
            Ok(Err(e)) => {
                info!(%peer, error = %e, "Stream connection refused.");
                return;
            }
            Err(_) => {
                info!(%peer, "Stream connection refused: no stream opened within 10 s.");
                return;
            }
        };
        let (outgoing, outgoing_queue) = mpsc::channel(QUEUE_FRAMES);
        let (incoming_queue, incoming) = mpsc::channel(QUEUE_FRAMES);
        let reader = tokio::spawn(read_frames(source, incoming_queue));
        let channel = FrameChannel { incoming, outgoing };
        let stopping = shutdown.clone();
        let stream = async move {
            match open {
                Ok(open) => {
                    let runtime = self.runtime.clone();
                    serve_stream(runtime, self.sftp.clone(), open, channel, shutdown).await;
                }
                Err(message) => {
                    let _ = channel.outgoing.send(Frame::Error(message)).await;
                }
            }
        };
        // The writer ends once the stream has dropped its sender and every frame is sent. When
        // the agent stops, a gateway that does not read its last frames is not waited for long.
        let both = async { tokio::join!(stream, write_frames(sink, outgoing_queue)) };
        tokio::select! {
            _ = both => {}
            () = async {
                stopping.cancelled().await;
                tokio::time::sleep(CLOSE_GRACE).await;
            } => debug!(%peer, "Dropped a stream that did not close in time."),
        }
        // Our close is sent: wait (briefly) for the gateway's, reading what it still sends.
        let reader_abort = reader.abort_handle();
        if tokio::time::timeout(CLOSE_GRACE, reader).await.is_err() {
            reader_abort.abort();
            debug!(%peer, "The gateway did not close the stream in time.");
        }
    }

    /// TLS, the authenticated upgrade, and the first message: the stream connection's halves
    /// and the `StreamOpen`, or the message to send the gateway instead.
    async fn handshake(
        &self,
        tcp: TcpStream,
    ) -> Result<
        (
            Halves<impl AsyncRead + AsyncWrite>,
            Result<StreamOpen, String>,
        ),
        String,
    > {
        let tls = self
            .acceptor
            .accept(BufReader::with_capacity(TLS_READ_BUFFER, tcp))
            .await
            .map_err(|e| format!("TLS handshake failed: {e}"))?;
        let token = &self.gateway_token;
        let config = WebSocketConfig::default()
            .max_message_size(Some(MAX_MESSAGE))
            .max_frame_size(Some(MAX_MESSAGE));
        #[allow(clippy::result_large_err)] // the callback's type is tungstenite's
        let check = |request: &_, response| auth::check_request(request, token).map(|()| response);
        let ws = tokio_tungstenite::accept_hdr_async_with_config(tls, check, Some(config))
            .await
            .map_err(|e| format!("WebSocket upgrade refused: {e}"))?;
        // The gateway sends nothing before our `101`, so tungstenite holds nothing unread.
        let (mut source, sink) = websocket::split(ws.into_inner(), Side::Server, MAX_MESSAGE);
        let open = match source.next().await {
            Ok(Incoming::Text(text)) => serde_json::from_str::<StreamOpen>(&text)
                .map_err(|e| format!("the stream's first message is not a StreamOpen: {e}")),
            Ok(Incoming::Binary(_)) => {
                Err("the stream's first message must be the StreamOpen (text)".into())
            }
            Ok(Incoming::Close) => return Err("the gateway closed before opening a stream".into()),
            Err(e) => return Err(format!("reading the StreamOpen: {e}")),
        };
        Ok(((source, sink), open))
    }
}

/// Both halves of a stream connection after its upgrade.
type Halves<S> = (MessageReader<S>, MessageWriter<S>);

/// Checks a stream's `StreamOpen` against the container and serves it to its end.
pub async fn serve_stream(
    runtime: Arc<dyn ContainerRuntime>,
    sftp: Arc<SftpInjector>,
    open: StreamOpen,
    channel: FrameChannel,
    shutdown: CancellationToken,
) {
    let session = open.session_id;
    let found = match runtime.session_container(session).await {
        Ok(found) => found,
        Err(e) => {
            warn!(%session, error = %error_chain(&e), "Cannot look up a session's container for a stream.");
            let message =
                "the node agent cannot reach Docker on this node right now: try again in a minute";
            let _ = channel
                .outgoing
                .send(Frame::Error(message.to_owned()))
                .await;
            return;
        }
    };
    let container = match auth::check_open(found, &open) {
        Ok(container) => container,
        Err(refusal) => {
            info!(%session, owner = %open.owner, %refusal, "Stream refused.");
            let _ = channel
                .outgoing
                .send(Frame::Error(refusal.to_string()))
                .await;
            return;
        }
    };
    debug!(%session, kind = ?open.kind, "Stream opened.");
    match open.kind {
        StreamKind::DirectTcpip { host, port } => {
            tcp::serve(container, host, port, channel, shutdown).await;
        }
        StreamKind::Shell { .. } | StreamKind::Exec { .. } | StreamKind::Subsystem { .. } => {
            exec::serve(runtime, &sftp, container, open, channel, shutdown).await;
        }
    }
}

/// Sends `bytes` as frames of at most `MAX_FRAME_PAYLOAD`; `Err` when nobody reads any more.
pub async fn send_chunked(
    outgoing: &mpsc::Sender<Frame>,
    bytes: &[u8],
    frame: fn(Vec<u8>) -> Frame,
) -> Result<(), mpsc::error::SendError<Frame>> {
    for chunk in bytes.chunks(MAX_FRAME_PAYLOAD) {
        outgoing.send(frame(chunk.to_vec())).await?;
    }
    Ok(())
}

/// Like [`send_chunked`] for bytes the caller owns: a piece that fits one frame goes as it is,
/// without a copy (a process's output usually comes in such pieces).
pub async fn send_owned(
    outgoing: &mpsc::Sender<Frame>,
    bytes: Vec<u8>,
    frame: fn(Vec<u8>) -> Frame,
) -> Result<(), mpsc::error::SendError<Frame>> {
    if bytes.len() <= MAX_FRAME_PAYLOAD {
        outgoing.send(frame(bytes)).await
    } else {
        send_chunked(outgoing, &bytes, frame).await
    }
}

/// Decodes the gateway's binary messages into `incoming` until the gateway closes; a malformed
/// frame ends the stream as if the gateway had gone.
async fn read_frames<S: AsyncRead + AsyncWrite>(
    mut source: MessageReader<S>,
    incoming: mpsc::Sender<Frame>,
) {
    loop {
        match source.next().await {
            Ok(Incoming::Binary(bytes)) => match Frame::decode(&bytes) {
                Ok(frame) => {
                    // Once the stream has ended nobody takes frames any more; keep reading
                    // (and dropping) them until the gateway's close, so the connection ends
                    // with a clean close instead of a reset that could lose our last frames.
                    if !incoming.is_closed() {
                        let _ = incoming.send(frame).await;
                    }
                }
                Err(e) => {
                    warn!(error = %e, "The gateway sent a malformed stream frame; ending the stream.");
                    return;
                }
            },
            Ok(Incoming::Close) => return,
            Ok(Incoming::Text(_)) => {
                warn!("The gateway sent text after the StreamOpen; ending the stream.");
                return;
            }
            Err(e) => {
                debug!(error = %e, "The stream connection broke.");
                return;
            }
        }
    }
}

/// Sends the queued frames until the stream drops its sender, then closes the WebSocket. Each
/// frame goes to TLS as it is taken; the flush waits until nothing more is queued.
async fn write_frames<S: AsyncRead + AsyncWrite>(
    mut sink: MessageWriter<S>,
    mut outgoing: mpsc::Receiver<Frame>,
) {
    while let Some(frame) = outgoing.recv().await {
        if sink.binary(frame.into_encoded()).await.is_err() {
            return;
        }
        while let Ok(frame) = outgoing.try_recv() {
            if sink.binary(frame.into_encoded()).await.is_err() {
                return;
            }
        }
        if sink.flush().await.is_err() {
            return;
        }
    }
    let _ = sink.close().await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::fake::FakeRuntime;
    use crate::runtime::{SessionContainer, TtySize};
    use ongrid_core::stream::{ExitStatus, Pty};
    use ongrid_core::{Dn, SessionId};

    const OWNER: &str = "/DC=org/DC=example/CN=Alice Smith";

    fn fake_with_session() -> (Arc<FakeRuntime>, SessionId) {
        let runtime = Arc::new(FakeRuntime::new());
        let session_id = SessionId::new_random();
        runtime.insert_session_container(SessionContainer {
            id: "c1".into(),
            session_id,
            session_name: "train1".into(),
            owner: OWNER.into(),
            login: "alice-smith".into(),
            user: "20001:20001".into(),
            running: true,
            pid: None,
        });
        (runtime, session_id)
    }

    fn open(session_id: SessionId, kind: StreamKind) -> StreamOpen {
        StreamOpen {
            session_id,
            owner: Dn::parse(OWNER).unwrap(),
            kind,
            env: vec![("LANG".into(), "de_DE.UTF-8".into())],
        }
    }

    fn exec(command: &str) -> StreamKind {
        StreamKind::Exec {
            command: command.into(),
            pty: None,
        }
    }

    /// The gateway's side of one stream served by [`serve_stream`].
    struct Gateway {
        to_agent: Option<mpsc::Sender<Frame>>,
        from_agent: mpsc::Receiver<Frame>,
        task: tokio::task::JoinHandle<()>,
    }

    /// An injector that finds no sftp-server on the node.
    fn nothing_to_lend() -> Arc<SftpInjector> {
        Arc::new(SftpInjector::new(
            vec!["/nonexistent/sftp-server".into()],
            1 << 20,
        ))
    }

    impl Gateway {
        fn open(
            runtime: &Arc<FakeRuntime>,
            open: StreamOpen,
            shutdown: &CancellationToken,
        ) -> Self {
            Self::open_lending(runtime, &nothing_to_lend(), open, shutdown)
        }

        fn open_lending(
            runtime: &Arc<FakeRuntime>,
            sftp: &Arc<SftpInjector>,
            open: StreamOpen,
            shutdown: &CancellationToken,
        ) -> Self {
            let (to_agent, incoming) = mpsc::channel(QUEUE_FRAMES);
            let (outgoing, from_agent) = mpsc::channel(QUEUE_FRAMES);
            let channel = FrameChannel { incoming, outgoing };
            let task = tokio::spawn(serve_stream(
                runtime.clone(),
                sftp.clone(),
                open,
                channel,
                shutdown.clone(),
            ));
            Self {
                to_agent: Some(to_agent),
                from_agent,
                task,
            }
        }

        async fn send(&self, frame: Frame) {
            self.to_agent.as_ref().unwrap().send(frame).await.unwrap();
        }

        /// The next frame; `None` once the agent has closed the stream.
        async fn next(&mut self) -> Option<Frame> {
            tokio::time::timeout(Duration::from_secs(10), self.from_agent.recv())
                .await
                .expect("the agent answers within 10 s")
        }

        /// Every frame until the agent closes the stream.
        async fn rest(&mut self) -> Vec<Frame> {
            let mut frames = Vec::new();
            while let Some(frame) = self.next().await {
                frames.push(frame);
            }
            frames
        }
    }

    #[tokio::test]
    async fn a_command_gets_stdin_until_eof_and_answers_in_order() {
        let (runtime, session_id) = fake_with_session();
        runtime.set_exec_result(3, b"warning\n");
        let shutdown = CancellationToken::new();
        let mut gateway = Gateway::open(&runtime, open(session_id, exec("cat")), &shutdown);
        assert_eq!(gateway.next().await, Some(Frame::Ready));
        assert_eq!(
            gateway.next().await,
            Some(Frame::Stderr(b"warning\n".to_vec()))
        );
        gateway.send(Frame::Data(b"hello ".to_vec())).await;
        gateway.send(Frame::Data(b"world".to_vec())).await;
        gateway.send(Frame::Eof).await;
        let mut stdout = Vec::new();
        let mut rest = Vec::new();
        for frame in gateway.rest().await {
            match frame {
                Frame::Data(bytes) if rest.is_empty() => stdout.extend(bytes),
                other => rest.push(other),
            }
        }
        assert_eq!(stdout, b"hello world");
        assert_eq!(
            rest,
            [Frame::Eof, Frame::Exit(ExitStatus::Code { code: 3 })],
            "EOF, then the exit status, then the close"
        );
        gateway.task.await.unwrap();

        let execs = runtime.execs();
        let spec = &execs.values().next().unwrap().spec;
        assert_eq!(spec.user, "20001:20001");
        assert_eq!(spec.working_dir, "/home/alice-smith");
        assert_eq!(spec.command.last().map(String::as_str), Some("cat"));
        assert!(spec.env.contains(&("LANG".into(), "de_DE.UTF-8".into())));
        assert_eq!(spec.tty, None);
    }

    #[tokio::test]
    async fn large_output_is_split_into_frames_of_at_most_the_maximum() {
        let (runtime, session_id) = fake_with_session();
        let shutdown = CancellationToken::new();
        let mut gateway = Gateway::open(&runtime, open(session_id, exec("cat")), &shutdown);
        assert_eq!(gateway.next().await, Some(Frame::Ready));
        let input: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        let sender = gateway.to_agent.take().unwrap();
        let feed = tokio::spawn({
            let input = input.clone();
            async move {
                for chunk in input.chunks(MAX_FRAME_PAYLOAD) {
                    sender.send(Frame::Data(chunk.to_vec())).await.unwrap();
                }
                sender.send(Frame::Eof).await.unwrap();
                sender
            }
        });
        let mut output = Vec::new();
        let mut last = Vec::new();
        for frame in gateway.rest().await {
            match frame {
                Frame::Data(bytes) => {
                    assert!(bytes.len() <= MAX_FRAME_PAYLOAD);
                    output.extend(bytes);
                }
                other => last.push(other),
            }
        }
        assert_eq!(output, input);
        assert_eq!(
            last,
            [Frame::Eof, Frame::Exit(ExitStatus::Code { code: 0 })]
        );
        drop(feed.await.unwrap());
    }

    #[tokio::test]
    async fn a_terminal_gets_its_size_and_resizes_and_ignores_eof() {
        let (runtime, session_id) = fake_with_session();
        let shutdown = CancellationToken::new();
        let pty = Pty {
            term: "xterm-256color".into(),
            cols: 120,
            rows: 40,
        };
        let kind = StreamKind::Shell { pty: Some(pty) };
        let mut gateway = Gateway::open(&runtime, open(session_id, kind), &shutdown);
        assert_eq!(gateway.next().await, Some(Frame::Ready));
        gateway
            .send(Frame::Resize {
                cols: 100,
                rows: 30,
            })
            .await;
        gateway.send(Frame::Eof).await;
        gateway.send(Frame::Data(b"still open\n".to_vec())).await;
        assert_eq!(
            gateway.next().await,
            Some(Frame::Data(b"still open\n".to_vec())),
            "EOF does not close a terminal's input"
        );
        let exec = runtime.execs().into_values().next().unwrap();
        assert_eq!(
            exec.spec.tty,
            Some(TtySize {
                cols: 120,
                rows: 40
            })
        );
        assert!(exec
            .spec
            .env
            .contains(&("TERM".into(), "xterm-256color".into())));
        assert_eq!(
            exec.resizes,
            [
                TtySize {
                    cols: 120,
                    rows: 40
                },
                TtySize {
                    cols: 100,
                    rows: 30
                }
            ]
        );
        // The gateway goes away: the stream ends without an exit status.
        drop(gateway.to_agent.take());
        assert_eq!(gateway.rest().await, []);
        gateway.task.await.unwrap();
    }

    #[tokio::test]
    async fn refusals_are_one_error_frame_then_the_close() {
        let (runtime, session_id) = fake_with_session();
        let shutdown = CancellationToken::new();
        let cases = [
            (
                open(SessionId::new_random(), exec("true")),
                "is not on this node",
            ),
            (
                StreamOpen {
                    owner: Dn::parse("/DC=org/DC=example/CN=Mallory").unwrap(),
                    ..open(session_id, exec("true"))
                },
                "session train1 belongs to another user",
            ),
            (
                open(
                    session_id,
                    StreamKind::Subsystem {
                        name: "netconf".into(),
                    },
                ),
                "subsystem \"netconf\" is not supported",
            ),
            (
                open(
                    session_id,
                    StreamKind::DirectTcpip {
                        host: "10.0.0.1".into(),
                        port: 22,
                    },
                ),
                "only destinations inside the container (localhost) can be forwarded",
            ),
        ];
        for (open, expected) in cases {
            let mut gateway = Gateway::open(&runtime, open, &shutdown);
            let frames = gateway.rest().await;
            assert!(
                matches!(frames.as_slice(), [Frame::Error(message)] if message.contains(expected)),
                "{frames:?} should be one error containing {expected:?}"
            );
        }
        assert!(runtime.execs().is_empty(), "nothing was started");
    }

    #[tokio::test]
    async fn an_image_without_sftp_server_is_told_what_to_install() {
        let (runtime, session_id) = fake_with_session();
        let shutdown = CancellationToken::new();
        let kind = StreamKind::Subsystem {
            name: "sftp".into(),
        };
        let mut gateway = Gateway::open(&runtime, open(session_id, kind), &shutdown);
        let frames = gateway.rest().await;
        assert_eq!(
            frames,
            [Frame::Error(
                "the image of session train1 has no sftp-server, and this node has none to lend \
                 it: install openssh-sftp-server in the image or on the node (scp -O and rsync \
                 work without it)"
                    .to_owned()
            )]
        );
        let execs = runtime.execs();
        assert_eq!(execs.len(), 1, "only the probe ran: {execs:?}");
        let probe = execs.into_values().next().unwrap().spec;
        assert_eq!(probe.tty, None);
        assert_eq!(probe.user, "20001:20001");
        assert!(probe
            .command
            .contains(&"/usr/lib/openssh/sftp-server".to_owned()));
        assert!(runtime.files("c1").is_empty(), "nothing was copied");
    }

    /// The node's server (here any dynamically linked program of the node) is copied once,
    /// read-only and root's, however many streams ask for it at the same time.
    #[tokio::test]
    async fn an_image_without_sftp_server_gets_the_nodes_once() {
        use crate::runtime::inject::{SFTP_COMMAND_FILE, SFTP_LIB_DIR, SFTP_SERVER};
        let (runtime, session_id) = fake_with_session();
        let sftp = Arc::new(SftpInjector::new(
            vec!["/nonexistent/sftp-server".into(), "/bin/true".into()],
            32 << 20,
        ));
        let shutdown = CancellationToken::new();
        let kind = || StreamKind::Subsystem {
            name: "sftp".into(),
        };
        let mut gateways: Vec<Gateway> = (0..3)
            .map(|_| Gateway::open_lending(&runtime, &sftp, open(session_id, kind()), &shutdown))
            .collect();
        for gateway in &mut gateways {
            assert_eq!(gateway.next().await, Some(Frame::Ready));
            gateway.send(Frame::Data(b"init".to_vec())).await;
            assert_eq!(gateway.next().await, Some(Frame::Data(b"init".to_vec())));
        }
        let uploads = |calls: &[String]| calls.iter().filter(|c| c.starts_with("upload")).count();
        assert_eq!(
            uploads(&runtime.take_calls()),
            1,
            "one upload for three streams"
        );

        let files = runtime.files("c1");
        assert!(
            files.values().all(|f| (f.uid, f.gid) == (0, 0)),
            "{files:?}"
        );
        assert!(files["/run/ongrid/sftp/lib"].directory);
        assert_eq!(files["/run/ongrid/sftp/lib"].mode, 0o755);
        assert_eq!(files[SFTP_SERVER].mode, 0o555);
        assert_eq!(
            files[SFTP_SERVER].bytes,
            std::fs::read("/bin/true").unwrap()
        );
        let command = String::from_utf8(files[SFTP_COMMAND_FILE].bytes.clone()).unwrap();
        let command: Vec<&str> = command.lines().collect();
        assert_eq!(command[1..], ["--library-path", SFTP_LIB_DIR, SFTP_SERVER]);
        assert_eq!(files[command[0]].mode, 0o555, "the loader is in the bundle");
        let servers: Vec<Vec<String>> = runtime
            .execs()
            .into_values()
            .map(|exec| exec.spec.command)
            .filter(|c| c.first().map(String::as_str) == Some(command[0]))
            .collect();
        assert_eq!(servers.len(), 3, "each stream runs the injected server");
        assert!(servers.iter().all(|c| *c == command), "{servers:?}");

        // Later streams find it in the container and copy nothing.
        let mut later = Gateway::open_lending(&runtime, &sftp, open(session_id, kind()), &shutdown);
        assert_eq!(later.next().await, Some(Frame::Ready));
        assert_eq!(uploads(&runtime.take_calls()), 0);
        for mut gateway in gateways.into_iter().chain([later]) {
            gateway.send(Frame::Eof).await;
            assert_eq!(
                gateway.rest().await,
                [Frame::Eof, Frame::Exit(ExitStatus::Code { code: 0 })]
            );
        }
    }

    #[tokio::test]
    async fn a_failed_copy_is_reported_with_its_cause() {
        let (runtime, session_id) = fake_with_session();
        runtime.fail("upload");
        let sftp = Arc::new(SftpInjector::new(vec!["/bin/true".into()], 32 << 20));
        let shutdown = CancellationToken::new();
        let kind = StreamKind::Subsystem {
            name: "sftp".into(),
        };
        let mut gateway = Gateway::open_lending(&runtime, &sftp, open(session_id, kind), &shutdown);
        let frames = gateway.rest().await;
        assert!(
            matches!(frames.as_slice(), [Frame::Error(m)]
                if m.starts_with("cannot start sftp in session train1: its image has no \
                                  sftp-server and the node agent could not copy the node's \
                                  into it: upload c1 /: the fake was told to fail")),
            "{frames:?}"
        );
    }

    #[tokio::test]
    async fn stopping_the_agent_ends_open_streams_with_an_error() {
        let (runtime, session_id) = fake_with_session();
        let shutdown = CancellationToken::new();
        let mut gateway = Gateway::open(&runtime, open(session_id, exec("cat")), &shutdown);
        assert_eq!(gateway.next().await, Some(Frame::Ready));
        shutdown.cancel();
        assert_eq!(
            gateway.rest().await,
            [Frame::Error(exec::SHUTTING_DOWN.to_owned())]
        );
    }

    /// A gateway that stops reading: the agent's queues fill and then the gateway's sends block,
    /// after a bounded number of frames; meanwhile another stream works normally.
    #[tokio::test]
    async fn a_stalled_stream_is_bounded_and_does_not_stall_others() {
        let (runtime, session_id) = fake_with_session();
        let shutdown = CancellationToken::new();
        let mut stalled = Gateway::open(&runtime, open(session_id, exec("cat")), &shutdown);
        assert_eq!(stalled.next().await, Some(Frame::Ready));
        let sender = stalled.to_agent.take().unwrap();
        let mut accepted = 0usize;
        'fill: loop {
            for _ in 0..1000 {
                if sender.try_send(Frame::Data(vec![b'x'; 1024])).is_ok() {
                    accepted += 1;
                    continue 'fill;
                }
                tokio::task::yield_now().await;
            }
            break;
        }
        // Queues: incoming, stdin and outgoing (32 frames each) and the fake's 1 KiB pipe.
        eprintln!("{accepted} frames accepted before the stalled stream pushed back");
        assert!(
            accepted <= 4 * QUEUE_FRAMES,
            "{accepted} frames of 1 KiB accepted by a stream nobody reads"
        );
        assert!(accepted >= 2 * QUEUE_FRAMES, "only {accepted} accepted");

        let mut other = Gateway::open(&runtime, open(session_id, exec("cat")), &shutdown);
        assert_eq!(other.next().await, Some(Frame::Ready));
        other.send(Frame::Data(b"ping".to_vec())).await;
        other.send(Frame::Eof).await;
        assert_eq!(
            other.rest().await,
            [
                Frame::Data(b"ping".to_vec()),
                Frame::Eof,
                Frame::Exit(ExitStatus::Code { code: 0 })
            ]
        );
        drop(sender);
    }
}
