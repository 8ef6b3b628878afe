//! One task per SSH channel, each with its own WebSocket stream to the node agent running the
//! session (`agent.rs`), so a slow or stalled channel never holds up another's output.
//!
//! A channel's task takes what the client sends on it from its [`ChannelInput`] queue, which
//! the russh handler fills from its callbacks (`input.rs` explains the bounds): requests
//! (`pty-req`, `env`, `shell`, `exec`, `subsystem`, `window-change`, `signal`), data, EOF and
//! close, in the order the client sent them. The handler has already answered every request
//! (`requests.rs`) and queued only those it granted. When the agent cannot start the program,
//! the reason goes on stderr with exit status 1, as from a login shell that fails.
//!
//! Output goes to the client through the channel's `ChannelWriteHalf`, which waits for this
//! channel's SSH window before queueing each packet: a client that stops reading one channel
//! stalls only that channel's task (and, through the WebSocket, the process), never another
//! channel's output. Ordering at the end is data, then `exit-status` (or `exit-signal`), then
//! EOF, then close, all queued by this one task in that order.
//!
//! An interactive shell (`shell` with a PTY) gets, on stderr, a banner with the session's
//! deadlines before its first output, and a warning once a planned hold comes within
//! `warn_before` (`deadlines.rs`). Nothing else is ever added to an exec or subsystem channel,
//! except at its end: when a process did not exit cleanly, the manager is asked (route lookup,
//! at most two seconds) whether its session stopped, and if so its message (FAILED or HELD with
//! the reason, e.g. a GPU that fell off the bus) goes on stderr before the channel closes.

use std::convert::Infallible;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::FutureExt;
use ongrid_core::api::{Route, RouteRequest};
use ongrid_core::stream::{
    data_message, output_of, ExitStatus, Frame, Output, Pty, StreamKind, StreamOpen,
    MAX_FRAME_PAYLOAD,
};
use ongrid_core::Dn;
use ongrid_service::websocket::{Incoming, MessageError, MessageReader, MessageWriter};
use russh::server::{ChannelOpenHandle, Handle, Msg};
use russh::{ChannelId, ChannelOpenFailure, ChannelWriteHalf, Sig};

use crate::deadlines::{
    banner, warning, warning_text, DeadlinesReceiver, DeadlinesState, WarnOnce, Warning,
};
use crate::input::{ChannelInput, Input, HARD_LIMIT, STALL_AFTER};
use crate::manager::GatewayRoutes;
use crate::requests::Request;
use ongrid_service::agent_stream::{
    frame_name, AgentConnection, AgentConnector, AgentError, AgentStream,
};

/// How long closing the agent's WebSocket may take once the channel is done.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(2);
/// How long an interactive shell waits for the manager's first answer to show its banner; the
/// answer to the connection's `open` usually came while the shell was being started.
const BANNER_WAIT: Duration = Duration::from_secs(2);
/// How long a session channel whose process did not exit cleanly waits for the manager to say
/// whether (and why) its session stopped, before closing.
const SESSION_STATE_WAIT: Duration = Duration::from_secs(2);

/// Bytes carried by one connection, over all its channels.
#[derive(Debug, Default)]
pub struct Traffic {
    /// From the client to the container (`bytes_in`).
    pub to_container: AtomicU64,
    /// From the container to the client, stdout and stderr (`bytes_out`).
    pub to_client: AtomicU64,
}

impl Traffic {
    fn count_in(&self, bytes: usize) {
        self.to_container.fetch_add(bytes as u64, Ordering::Relaxed);
        crate::metrics::events().to_container(bytes);
    }

    fn count_out(&self, bytes: usize) {
        self.to_client.fetch_add(bytes as u64, Ordering::Relaxed);
        crate::metrics::events().to_client(bytes);
    }
}

/// What a channel's task needs to know about its connection.
#[derive(Clone)]
pub struct ChannelContext {
    pub connection_id: uuid::Uuid,
    pub route: Arc<Route>,
    pub owner: Dn,
    pub agents: AgentConnector,
    /// Asked why the session stopped when a channel's process ends without a clean exit.
    pub manager: GatewayRoutes,
    pub traffic: Arc<Traffic>,
    pub handle: Handle,
    /// The session's deadlines as the manager last answered (banner, hold warning).
    pub deadlines: DeadlinesReceiver,
    /// How long before a planned hold interactive shells are warned.
    pub warn_before: Duration,
}

/// One channel's two ends inside the gateway: what the client sends, and the way back.
pub struct ChannelEnds {
    pub input: Arc<ChannelInput>,
    pub writer: ChannelWriteHalf<Msg>,
}

impl ChannelEnds {
    fn id(&self) -> ChannelId {
        self.writer.id()
    }

    /// Runs `send` (anything queued towards the client); once it has waited [`STALL_AFTER`],
    /// this channel's output counts as stalled until it completes (see `input.rs`).
    async fn paced<F: Future>(&self, send: F) -> F::Output {
        tokio::pin!(send);
        match tokio::time::timeout(STALL_AFTER, &mut send).await {
            Ok(output) => output,
            Err(_) => {
                let _stalled = self.input.stalled();
                send.await
            }
        }
    }

    /// Writes stdout (`ext` `None`) or stderr (`Some(1)`), waiting for this channel's window.
    async fn write(&self, ext: Option<u32>, data: impl Into<Bytes>) -> Result<(), ()> {
        let result = match ext {
            None => self.paced(self.writer.data_bytes(data)).await,
            Some(ext) => self.paced(self.writer.extended_data_bytes(ext, data)).await,
        };
        result.map_err(drop)
    }

    /// A line on the client's stderr; with a PTY the terminal is raw, so it ends in CR LF.
    async fn say(&self, text: &str, with_pty: bool) {
        let _ = self.write(Some(1), line(text, with_pty)).await;
    }

    async fn eof(&self) -> Result<(), ()> {
        self.paced(self.writer.eof()).await.map_err(drop)
    }

    async fn close(&self) {
        let _ = self.paced(self.writer.close()).await;
    }

    /// Ends a session channel: the exit status (or signal), then EOF, then close.
    async fn exit(&self, handle: &Handle, exit: Option<ExitStatus>) {
        match exit {
            Some(ExitStatus::Code { code }) => {
                let _ = self.paced(self.writer.exit_status(code)).await;
            }
            Some(ExitStatus::Signal {
                signal,
                core_dumped,
            }) => {
                let _ = self
                    .paced(handle.exit_signal_request(
                        self.id(),
                        sig_from_name(&signal),
                        core_dumped,
                        String::new(),
                        String::new(),
                    ))
                    .await;
            }
            None => {}
        }
        let _ = self.eof().await;
        self.close().await;
    }
}

/// A `session` channel: waits for `shell`, `exec` or `subsystem sftp` (taking `pty-req` and
/// allowed `env` before it), starts it on the agent, then relays until it ends.
pub async fn session(ends: ChannelEnds, context: ChannelContext) {
    run_session(&ends, &context).await;
    ends.input.close();
}

async fn run_session(ends: &ChannelEnds, context: &ChannelContext) {
    let Some(start) = wait_for_start(ends, context).await else {
        return;
    };
    let Some(stream) = start_on_agent(ends, context, &start).await else {
        return;
    };
    run_started(ends, context, &start, stream).await;
}

/// What a session channel's client asked for before its program started.
struct Start {
    kind: StreamKind,
    env: Vec<(String, String)>,
    /// The client sent EOF before the program existed: passed on once it does.
    eof_before_start: bool,
}

impl Start {
    fn with_pty(&self) -> bool {
        match &self.kind {
            StreamKind::Shell { pty } | StreamKind::Exec { pty, .. } => pty.is_some(),
            _ => false,
        }
    }

    /// A shell with a terminal: it gets the banner and the hold warning.
    fn interactive(&self) -> bool {
        matches!(&self.kind, StreamKind::Shell { pty: Some(_) })
    }
}

/// Takes the granted `pty-req` and `env` requests until `shell`, `exec` or `subsystem`; `None`
/// when the channel ends first (or the command cannot be run, which the client is told).
async fn wait_for_start(ends: &ChannelEnds, context: &ChannelContext) -> Option<Start> {
    let mut pty: Option<Pty> = None;
    let mut env: Vec<(String, String)> = Vec::new();
    let mut eof_before_start = false;
    loop {
        let request = match ends.input.recv().await? {
            Input::Request(request) => request,
            Input::Eof => {
                eof_before_start = true;
                continue;
            }
            Input::Close => return None,
            Input::Overflowed => {
                overflowed(ends, context, pty.is_some()).await;
                return None;
            }
            // Data before a process exists has nowhere to go.
            Input::Data(_) => continue,
        };
        let kind = match request {
            Request::Pty { term, cols, rows } => {
                pty = Some(Pty { term, cols, rows });
                continue;
            }
            Request::Env { name, value } => {
                env.push((name, value));
                continue;
            }
            Request::WindowChange { cols, rows } => {
                if let Some(pty) = &mut pty {
                    pty.cols = cols;
                    pty.rows = rows;
                }
                continue;
            }
            Request::Signal(_) | Request::X11 => continue,
            Request::Shell => StreamKind::Shell { pty },
            Request::Subsystem(name) => StreamKind::Subsystem { name },
            Request::Exec(command) => match String::from_utf8(command) {
                Ok(command) => StreamKind::Exec { command, pty },
                Err(_) => {
                    let with_pty = pty.is_some();
                    ends.say("ongrid: the command is not valid UTF-8", with_pty)
                        .await;
                    ends.exit(&context.handle, Some(ExitStatus::Code { code: 1 }))
                        .await;
                    return None;
                }
            },
        };
        return Some(Start {
            kind,
            env,
            eof_before_start,
        });
    }
}

/// Opens the agent stream that runs `start`'s program; `None` when the agent cannot, after
/// telling the client why (stderr, exit status 1).
async fn start_on_agent(
    ends: &ChannelEnds,
    context: &ChannelContext,
    start: &Start,
) -> Option<AgentStream> {
    let id = ends.id();
    let description = describe(&start.kind);
    if let StreamKind::Exec { command, .. } = &start.kind {
        tracing::debug!(connection = %context.connection_id, channel = id.number(), ?command, "exec requested.");
    }
    let open = StreamOpen {
        session_id: context.route.session_id,
        owner: context.owner.clone(),
        kind: start.kind.clone(),
        env: start.env.clone(),
    };
    match context.agents.open(&context.route.agent_url, &open).await {
        Ok(stream) => {
            tracing::info!(connection = %context.connection_id, channel = id.number(), what = ?description, "Channel started.");
            crate::metrics::events().channel(&start.kind);
            Some(stream)
        }
        Err(error) => {
            let message = user_message(&error, &context.route);
            tracing::warn!(connection = %context.connection_id, channel = id.number(), what = %description, node = %context.route.node, error = format!("{:#}", anyhow::Error::from(error)), "Starting a process on the agent failed.");
            ends.say(&message, start.with_pty()).await;
            ends.exit(&context.handle, Some(ExitStatus::Code { code: 1 }))
                .await;
            None
        }
    }
}

/// Relays a started program until it ends, then ends the channel accordingly.
async fn run_started(
    ends: &ChannelEnds,
    context: &ChannelContext,
    start: &Start,
    stream: AgentStream,
) {
    let id = ends.id();
    let (with_pty, interactive) = (start.with_pty(), start.interactive());
    if interactive {
        show_banner(ends, context).await;
    }
    let relay_of = Relay {
        ends,
        stream,
        context,
        session: true,
        with_pty,
        interactive,
    };
    let (end, agent) = relay(relay_of, start.eof_before_start).await;
    match end {
        RelayEnd::ClientClosed => {
            tracing::info!(connection = %context.connection_id, channel = id.number(), "Channel closed by the client.");
        }
        RelayEnd::Overflowed => overflowed(ends, context, with_pty).await,
        RelayEnd::Finished { exit, error } => {
            if let Some(text) = &error {
                ends.say(&format!("ongrid: {text}"), with_pty).await;
            }
            if !clean_exit(exit.as_ref()) {
                if let Some(text) = session_ended_why(context).await {
                    ends.say(&format!("ongrid: {text}"), with_pty).await;
                }
            }
            tracing::info!(connection = %context.connection_id, channel = id.number(), exit = ?exit, error = ?error, "Channel ended.");
            ends.exit(&context.handle, exit).await;
        }
    }
    agent.close().await;
}

/// A process that exited with status 0: it ended on its own, so the session is not asked about.
fn clean_exit(exit: Option<&ExitStatus>) -> bool {
    matches!(exit, Some(ExitStatus::Code { code: 0 }))
}

/// Why the session stopped under a channel whose process did not exit cleanly: the manager's
/// message when the session is no longer running (FAILED or HELD with the stored reason,
/// ENDED), asked with the route lookup; `None` while it runs, or when the manager does not
/// answer within [`SESSION_STATE_WAIT`] (the channel's close never waits longer).
async fn session_ended_why(context: &ChannelContext) -> Option<String> {
    let name = &context.route.session_name;
    let request = RouteRequest {
        owner: context.owner.clone(),
        target: name.to_string(),
    };
    let answer = tokio::time::timeout(SESSION_STATE_WAIT, context.manager.route(&request)).await;
    match answer {
        Ok(Ok(_running)) => None,
        // Only a message about this session: a refusal of another kind (say, it was removed
        // meanwhile, so the owner has several sessions or none) says nothing about this end.
        Ok(Err(error)) => match error.refusal() {
            Some(message) if message.starts_with(&format!("session {name} ")) => {
                Some(message.to_owned())
            }
            Some(_) => None,
            None => {
                tracing::warn!(connection = %context.connection_id, session = %name, %error, "Cannot ask the manager why a channel's process ended.");
                None
            }
        },
        Err(_) => {
            tracing::warn!(connection = %context.connection_id, session = %name, "The manager did not say in time why a channel's process ended.");
            None
        }
    }
}

/// The client sent far more than the process took while not reading the output: say so and
/// close the channel rather than buffer without bound.
async fn overflowed(ends: &ChannelEnds, context: &ChannelContext, with_pty: bool) {
    tracing::warn!(connection = %context.connection_id, channel = ends.id().number(), limit = HARD_LIMIT, "Channel closed: the client kept sending without reading the output.");
    let message = format!(
        "ongrid: closing this channel: more than {} MiB of input arrived ahead of the process while its output was not being read",
        HARD_LIMIT / (1024 * 1024)
    );
    ends.say(&message, with_pty).await;
    let _ = ends.eof().await;
    ends.close().await;
}

/// A `direct-tcpip` channel (`ssh -L`, `-D`, `-W`, VS Code's forwarded ports): the agent
/// connects inside the container; the channel is confirmed once it did, refused with its
/// message otherwise.
pub async fn direct_tcpip(
    ends: ChannelEnds,
    open_reply: ChannelOpenHandle,
    host: String,
    port: u16,
    context: ChannelContext,
) {
    run_direct_tcpip(&ends, open_reply, host, port, &context).await;
    ends.input.close();
}

async fn run_direct_tcpip(
    ends: &ChannelEnds,
    open_reply: ChannelOpenHandle,
    host: String,
    port: u16,
    context: &ChannelContext,
) {
    let id = ends.id();
    let open = StreamOpen {
        session_id: context.route.session_id,
        owner: context.owner.clone(),
        kind: StreamKind::DirectTcpip {
            host: host.clone(),
            port,
        },
        env: Vec::new(),
    };
    let stream = match context.agents.open(&context.route.agent_url, &open).await {
        Ok(stream) => stream,
        Err(error) => {
            let message = user_message(&error, &context.route);
            forwarding_refused(
                context.connection_id,
                &host,
                port,
                &anyhow::Error::from(error),
            );
            open_reply
                .reject(ChannelOpenFailure::Other {
                    code: ChannelOpenFailure::ConnectFailed.code(),
                    reason: message,
                })
                .await;
            return;
        }
    };
    open_reply.accept().await;
    tracing::info!(connection = %context.connection_id, channel = id.number(), ?host, port, "Forwarding started.");
    crate::metrics::events().channel(&open.kind);
    let (end, agent) = relay(
        Relay {
            ends,
            stream,
            context,
            session: false,
            with_pty: false,
            interactive: false,
        },
        false,
    )
    .await;
    match end {
        RelayEnd::ClientClosed => {}
        RelayEnd::Overflowed => overflowed(ends, context, false).await,
        RelayEnd::Finished { error, .. } => {
            if let Some(error) = error {
                tracing::info!(connection = %context.connection_id, channel = id.number(), %error, "Forwarding ended by the agent.");
            }
            let _ = ends.eof().await;
            ends.close().await;
        }
    }
    agent.close().await;
    tracing::debug!(connection = %context.connection_id, channel = id.number(), ?host, port, "Forwarding ended.");
}

/// A `session` channel of a connection whose routing the manager refused: like a login shell
/// of `nologin`, it takes the requests, then prints the manager's message on stderr and exits 1.
pub async fn refused_session(ends: ChannelEnds, handle: Handle, message: String) {
    let mut with_pty = false;
    while let Some(input) = ends.input.recv().await {
        match input {
            Input::Request(Request::Pty { .. }) => with_pty = true,
            Input::Request(Request::Shell | Request::Exec(_) | Request::Subsystem(_)) => {
                ends.say(&message, with_pty).await;
                ends.exit(&handle, Some(ExitStatus::Code { code: 1 })).await;
                break;
            }
            Input::Close | Input::Overflowed => break,
            _ => {}
        }
    }
    ends.input.close();
}

/// How a relay ended.
enum RelayEnd {
    /// The client closed the channel (or the connection went away): nothing more to send.
    ClientClosed,
    /// The client sent too much ahead of the process (see `input.rs`).
    Overflowed,
    /// The agent's side ended: with the process's exit, and/or an error for the user.
    Finished {
        exit: Option<ExitStatus>,
        error: Option<String>,
    },
}

struct Relay<'a> {
    ends: &'a ChannelEnds,
    stream: AgentStream,
    context: &'a ChannelContext,
    /// A session channel (stderr, exit status, signals) rather than a TCP forward.
    session: bool,
    with_pty: bool,
    /// An interactive shell: it gets the hold warning.
    interactive: bool,
}

type AgentSink = MessageWriter<AgentConnection>;
type AgentSource = MessageReader<AgentConnection>;

/// Both halves of an agent stream, for a proper WebSocket close once the channel is done.
struct AgentHalves {
    sink: AgentSink,
    source: AgentSource,
}

impl AgentHalves {
    /// Sends a close and reads what the agent still sends until it closes too (bounded), so
    /// neither side resets the connection under data in flight.
    async fn close(mut self) {
        let _ = tokio::time::timeout(CLOSE_TIMEOUT, async {
            // A frame cut off when the relay ended leaves nothing to close cleanly: the
            // connection is dropped, and the agent sees it end.
            if self.sink.close().await.is_ok() {
                while let Ok(Incoming::Binary(_) | Incoming::Text(_)) = self.source.next().await {}
            }
        })
        .await;
    }
}

/// Relays both ways at once until one side ends: client → agent (`upstream`) and agent →
/// client (`downstream`), each waiting only on its own peer.
async fn relay(relay: Relay<'_>, eof_before_start: bool) -> (RelayEnd, AgentHalves) {
    let Relay {
        ends,
        stream,
        context,
        session,
        with_pty,
        interactive,
    } = relay;
    let AgentStream {
        mut sink,
        mut source,
    } = stream;
    if eof_before_start && send_frame(&mut sink, &Frame::Eof).await.is_err() {
        let end = RelayEnd::Finished {
            exit: None,
            error: Some("the node agent closed the stream".to_owned()),
        };
        return (end, AgentHalves { sink, source });
    }
    let end = {
        let upstream = upstream(ends, &mut sink, context, session, with_pty);
        let downstream = downstream(ends, &mut source, context, session);
        let warnings = warn_before_holds(ends, context, interactive);
        tokio::pin!(upstream);
        tokio::pin!(downstream);
        tokio::select! {
            up = &mut upstream => match up {
                Upstream::ClientClosed => RelayEnd::ClientClosed,
                Upstream::Overflowed => RelayEnd::Overflowed,
                // The agent stopped taking input: its side decides how this ends.
                Upstream::AgentGone => downstream.await,
            },
            down = &mut downstream => down,
            never = warnings => match never {},
        }
    };
    (end, AgentHalves { sink, source })
}

enum Upstream {
    ClientClosed,
    Overflowed,
    AgentGone,
}

/// Client → agent. Data already queued behind the first piece is taken along into the same
/// frame, up to [`MAX_FRAME_PAYLOAD`], and frames are flushed to the agent only once nothing
/// more is queued: a bulk upload goes in few large frames and few TLS writes, while a single
/// keystroke still goes out at once.
async fn upstream(
    ends: &ChannelEnds,
    sink: &mut AgentSink,
    context: &ChannelContext,
    session: bool,
    with_pty: bool,
) -> Upstream {
    let mut eof_sent = false;
    // An input taken while gathering data that is not data: the next to handle.
    let mut ahead: Option<Option<Input>> = None;
    let mut unflushed = false;
    loop {
        let input = match ahead.take() {
            Some(input) => input,
            None => match ends.input.recv().now_or_never() {
                Some(input) => input,
                None => {
                    if unflushed {
                        if sink.flush().await.is_err() {
                            return Upstream::AgentGone;
                        }
                        unflushed = false;
                    }
                    ends.input.recv().await
                }
            },
        };
        let message = match input {
            None | Some(Input::Close) => {
                // What the client sent before closing still reaches the process.
                if unflushed {
                    let _ = sink.flush().await;
                }
                return Upstream::ClientClosed;
            }
            Some(Input::Overflowed) => return Upstream::Overflowed,
            Some(Input::Data(data)) => {
                context.traffic.count_in(data.len());
                let mut parts = vec![data];
                let mut gathered = parts[0].len();
                while gathered < MAX_FRAME_PAYLOAD {
                    match ends.input.recv().now_or_never() {
                        Some(Some(Input::Data(more))) => {
                            context.traffic.count_in(more.len());
                            gathered += more.len();
                            parts.push(more);
                        }
                        Some(other) => {
                            ahead = Some(other);
                            break;
                        }
                        None => break,
                    }
                }
                if feed_data(sink, &parts).await.is_err() {
                    return Upstream::AgentGone;
                }
                unflushed = true;
                continue;
            }
            Some(Input::Eof) if !eof_sent => {
                eof_sent = true;
                Frame::Eof.encode()
            }
            Some(Input::Eof) => continue,
            Some(Input::Request(Request::WindowChange { cols, rows })) if with_pty => {
                Frame::Resize { cols, rows }.encode()
            }
            Some(Input::Request(Request::Signal(name))) if session => Frame::Signal(name).encode(),
            // Nothing else is granted once started (`requests.rs`).
            Some(Input::Request(_)) => continue,
        };
        if sink.binary(message).await.is_err() {
            return Upstream::AgentGone;
        }
        unflushed = true;
    }
}

/// Queues `parts` (in order) as `Data` frames of at most [`MAX_FRAME_PAYLOAD`], unflushed.
async fn feed_data(sink: &mut AgentSink, parts: &[Vec<u8>]) -> Result<(), ()> {
    let mut frame: Vec<&[u8]> = Vec::with_capacity(parts.len());
    let mut size = 0;
    for part in parts {
        for piece in part.chunks(MAX_FRAME_PAYLOAD) {
            if size + piece.len() > MAX_FRAME_PAYLOAD {
                sink.binary(data_message(&frame)).await.map_err(drop)?;
                frame.clear();
                size = 0;
            }
            frame.push(piece);
            size += piece.len();
        }
    }
    if !frame.is_empty() {
        sink.binary(data_message(&frame)).await.map_err(drop)?;
    }
    Ok(())
}

async fn downstream(
    ends: &ChannelEnds,
    source: &mut AgentSource,
    context: &ChannelContext,
    session: bool,
) -> RelayEnd {
    let mut eof_sent = false;
    loop {
        let bytes = match source.next().await {
            Ok(Incoming::Close) | Err(MessageError::Ended) => {
                let error = session.then(|| {
                    "the process's stream ended without an exit status (the node agent may have restarted)"
                        .to_owned()
                });
                return RelayEnd::Finished { exit: None, error };
            }
            Err(error) => {
                return RelayEnd::Finished {
                    exit: None,
                    error: Some(format!("lost the connection to the node agent: {error}")),
                };
            }
            Ok(Incoming::Text(_)) => {
                tracing::warn!(connection = %context.connection_id, node = %context.route.node, "The agent sent a text message on a stream; ignored.");
                continue;
            }
            Ok(Incoming::Binary(bytes)) => bytes,
        };
        // Output, the bulk of a stream, goes on as a slice of the message, without a copy.
        let ext = match output_of(&bytes) {
            Some(Output::Stdout) => Some(None),
            Some(Output::Stderr) if session => Some(Some(1)),
            _ => None,
        };
        if let Some(ext) = ext {
            let data = bytes.slice(1..);
            context.traffic.count_out(data.len());
            if ends.write(ext, data).await.is_err() {
                return RelayEnd::ClientClosed;
            }
            continue;
        }
        let frame = match Frame::decode(&bytes) {
            Ok(frame) => frame,
            Err(error) => {
                tracing::warn!(connection = %context.connection_id, node = %context.route.node, %error, "The agent broke the stream protocol.");
                return RelayEnd::Finished {
                    exit: None,
                    error: Some(format!("the node agent broke the stream protocol: {error}")),
                };
            }
        };
        match frame {
            // A forward's peer stopped sending: half-close towards the client at once. A
            // process's stdout ending waits for its exit status (data, exit, EOF, close).
            Frame::Eof if !session && !eof_sent => {
                eof_sent = true;
                if ends.eof().await.is_err() {
                    return RelayEnd::ClientClosed;
                }
            }
            Frame::Eof => {}
            Frame::Exit(status) => {
                return RelayEnd::Finished {
                    exit: session.then_some(status),
                    error: None,
                };
            }
            Frame::Error(text) => {
                return RelayEnd::Finished {
                    exit: None,
                    error: Some(text),
                };
            }
            other => {
                tracing::warn!(connection = %context.connection_id, node = %context.route.node, frame = frame_name(&other), "Unexpected frame from the agent; ignored.");
            }
        }
    }
}

/// Writes the banner of an interactive shell once the manager answered the connection's `open`
/// (waiting at most [`BANNER_WAIT`]); nothing when it gave no deadlines.
async fn show_banner(ends: &ChannelEnds, context: &ChannelContext) {
    let mut deadlines = context.deadlines.clone();
    let known = tokio::time::timeout(
        BANNER_WAIT,
        deadlines.wait_for(|state| *state != DeadlinesState::Pending),
    )
    .await
    // Cloned out: the watch must not stay locked while the client's window is awaited.
    .map(|state| state.map(|state| state.clone()));
    let state = match known {
        Ok(Ok(state)) => state,
        _ => {
            tracing::debug!(connection = %context.connection_id, "No deadlines from the manager in time; shell started without the banner.");
            return;
        }
    };
    if let DeadlinesState::Known(deadlines) = state {
        let text = banner(
            &context.route.session_name,
            &context.route.node,
            &deadlines,
            chrono::Utc::now(),
        );
        ends.say(&text, true).await;
    }
}

/// For an interactive shell: writes the warning of each planned hold once, when it comes within
/// `warn_before` (whether by a new answer of the manager or by the time passing). Never ends;
/// for other channels it does nothing.
async fn warn_before_holds(
    ends: &ChannelEnds,
    context: &ChannelContext,
    interactive: bool,
) -> Infallible {
    if !interactive {
        return std::future::pending().await;
    }
    let mut deadlines = context.deadlines.clone();
    let mut once = WarnOnce::default();
    loop {
        let state = deadlines.borrow_and_update().clone();
        let mut wake = None;
        if let DeadlinesState::Known(deadlines) = &state {
            let now = chrono::Utc::now();
            let due = warning(deadlines, now, context.warn_before);
            if let Some(hold) = once.check(&due) {
                tracing::info!(connection = %context.connection_id, channel = ends.id().number(), reason = ?hold.reason, at = %hold.at, "Warned of a planned hold.");
                let text = warning_text(&context.route.session_name, &hold, now);
                ends.say(&text, true).await;
            }
            if let Warning::At(start) = due {
                let after = (start - now).to_std().unwrap_or_default();
                wake = Some(tokio::time::Instant::now() + after);
            }
        }
        tokio::select! {
            changed = deadlines.changed() => {
                if changed.is_err() {
                    // The connection is ending: nothing more will come.
                    return std::future::pending().await;
                }
            }
            () = sleep_until(wake) => {}
        }
    }
}

async fn sleep_until(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

async fn send_frame(sink: &mut AgentSink, frame: &Frame) -> Result<(), ()> {
    sink.binary(frame.encode()).await.map_err(drop)?;
    sink.flush().await.map_err(drop)
}

/// A line for the client's stderr; with a PTY the terminal is raw, so it needs a carriage return.
fn line(text: &str, with_pty: bool) -> Vec<u8> {
    let end = if with_pty { "\r\n" } else { "\n" };
    format!("{text}{end}").into_bytes()
}

/// What to tell the user when a stream could not be started.
fn user_message(error: &AgentError, route: &Route) -> String {
    match error {
        AgentError::Refused(text) => text.clone(),
        AgentError::Timeout { .. } => format!(
            "node {} did not start your process in session {} in time: try again, and tell your site's admins if it keeps happening",
            route.node, route.session_name
        ),
        _ => format!(
            "the gateway cannot reach node {} of session {}: try again in a minute, and tell your site's admins if it keeps happening",
            route.node, route.session_name
        ),
    }
}

fn describe(kind: &StreamKind) -> String {
    match kind {
        StreamKind::Shell { pty: Some(_) } => "shell with a terminal".to_owned(),
        StreamKind::Shell { pty: None } => "shell".to_owned(),
        StreamKind::Exec { pty: Some(_), .. } => "exec with a terminal".to_owned(),
        StreamKind::Exec { pty: None, .. } => "exec".to_owned(),
        StreamKind::Subsystem { name } => format!("subsystem {name}"),
        StreamKind::DirectTcpip { host, port } => format!("direct-tcpip {host}:{port}"),
    }
}

/// Logs a `direct-tcpip` request the agent refused. The host is the client's string: logged
/// escaped (`?`), so a newline, a carriage return or an ESC in it cannot forge a line.
fn forwarding_refused(connection: uuid::Uuid, host: &str, port: u16, error: &anyhow::Error) {
    tracing::info!(%connection, ?host, port, error = format!("{error:#}"), "Forwarding refused.");
}

/// The russh signal for a name from the stream protocol (`TERM`, `KILL`, `USR2`, ...).
pub fn sig_from_name(name: &str) -> Sig {
    match name.strip_prefix("SIG").unwrap_or(name) {
        "ABRT" => Sig::ABRT,
        "ALRM" => Sig::ALRM,
        "FPE" => Sig::FPE,
        "HUP" => Sig::HUP,
        "ILL" => Sig::ILL,
        "INT" => Sig::INT,
        "KILL" => Sig::KILL,
        "PIPE" => Sig::PIPE,
        "QUIT" => Sig::QUIT,
        "SEGV" => Sig::SEGV,
        "TERM" => Sig::TERM,
        "USR1" => Sig::USR1,
        other => Sig::Custom(other.to_owned()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::input::signal_name;

    /// A `direct-tcpip` host that tries to end the line and forge another is logged escaped,
    /// on one line.
    #[test]
    fn a_forged_forwarding_host_is_logged_escaped() {
        let host = "db\n2026-11-28T00:00:00Z  INFO ongrid_gateway: Authenticated.\r\u{1b}[2K";
        let text = crate::test_log::captured(|| {
            forwarding_refused(
                uuid::Uuid::nil(),
                host,
                5432,
                &anyhow::anyhow!("refused by the agent"),
            );
        });
        assert_eq!(text.lines().count(), 1, "{text}");
        assert!(!text.contains('\r') && !text.contains('\u{1b}'), "{text:?}");
        assert!(
            text.contains(r#"host="db\n2026-11-28T00:00:00Z  INFO ongrid_gateway: Authenticated.\r\u{1b}[2K" port=5432"#),
            "{text}"
        );
    }

    #[test]
    fn signal_names_roundtrip() {
        for name in [
            "ABRT", "ALRM", "FPE", "HUP", "ILL", "INT", "KILL", "PIPE", "QUIT", "SEGV", "TERM",
            "USR1", "USR2", "WINCH",
        ] {
            assert_eq!(signal_name(&sig_from_name(name)), name);
        }
        assert_eq!(signal_name(&sig_from_name("SIGTERM")), "TERM");
    }

    #[test]
    fn stderr_lines_suit_the_terminal() {
        assert_eq!(line("no", false), b"no\n");
        assert_eq!(line("no", true), b"no\r\n");
    }
}
