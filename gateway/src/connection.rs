//! One SSH connection: the russh [`Handler`] and the task that owns the connection's state.
//!
//! The handler only forwards. Authentication callbacks must return russh's decision, so they
//! ask the [`Authenticator`] (a cached manager lookup with a short timeout, in its own task);
//! that only ever holds up this not-yet-authenticated connection. Channel opens become
//! [`Event`]s for the connection task, which decides and spawns one task per channel
//! (`channel.rs`). Channel requests are answered by the handler as they arrive (`requests.rs`:
//! the only moment russh knows whether the client wants a reply), and the granted ones, data,
//! EOF and close go straight to the channel's own input queue (`input.rs`, where the handler
//! waits when a channel is too far behind, and why that wait never deadlocks). The connection task never waits on the SSH session, so it can always
//! take the handler's next event.
//!
//! How refusals reach the user: SSH has no text on an authentication failure. When the manager
//! refused a key with a message (unknown, expired, removed key; throttled; address not allowed),
//! the rejection also offers `keyboard-interactive`; if the client tries it, the gateway answers
//! with an info request of zero prompts whose instruction is that message (OpenSSH prints it, at
//! its default log level, before `Permission denied`), then rejects. OpenSSH in `BatchMode`
//! never tries keyboard-interactive, so there (and with `LogLevel` above INFO) the user sees only
//! `Permission denied`. An authentication banner cannot carry the reason: russh asks for it
//! once, before the user name and key are known. Every refusal is also logged with the address. A routing refusal (no such session, HELD, PENDING, ...) is written
//! on the session channel's stderr, followed by exit status 1.
//!
//! Once routed, the connection task reports the connection to the manager (`open`, then
//! `activity` every `activity_report`, then `close`: `audit.rs`) and keeps the session's
//! deadlines the manager answers in a watch channel that its interactive shells read for their
//! banner and hold warning (`deadlines.rs`).
//!
//! A logged-in connection's key is watched (`revocations.rs`): when the manager says it was
//! removed or expired, the connection task writes the manager's message on the stderr of each
//! of its session channels and closes them (exit status 255), disconnects with the same message
//! once they are closed (OpenSSH drops output it has not written yet when the connection goes
//! first), and reports the close with it as the reason (the audit log keeps it).

use std::borrow::Cow;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use ongrid_core::api::{
    ConnectionEvent, ConnectionEventKind, HeldKey, RevokedKey, Route, RouteRequest,
};
use ongrid_core::normalize_ip;
use russh::server::{
    Auth, ChannelOpenHandle, Handle, Handler, Msg, PublicKeyOffer, Session, VerifiedPublicKey,
};
use russh::{
    Channel, ChannelId, ChannelOpenFailure, ChannelWriteHalf, Disconnect, MethodKind, MethodSet,
    Pty, Sig,
};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::auth::{Identity, Refusal, RefusalKind};
use crate::channel::{self, ChannelContext, ChannelEnds, Traffic};
use crate::deadlines::{DeadlinesReceiver, DeadlinesSender, DeadlinesState};
use crate::input::{signal_name, ChannelInput, ChannelTable, Input, PushError};
use crate::requests::{Answer, ChannelKind, Request};
use crate::revocations::Registration;
use crate::services::Services;
use crate::startups::StartupPermit;

/// An unauthenticated connection is closed after this long (like sshd's `LoginGraceTime`); until
/// then it holds one of the slots of `startups.rs`.
pub const LOGIN_GRACE: Duration = Duration::from_secs(120);
/// The longest the manager may take to route a connection.
pub const ROUTE_TIMEOUT: Duration = Duration::from_secs(10);
/// Channels open (or waiting for the route) on one connection at most.
pub const MAX_CHANNELS: usize = 128;
/// How long a connection being closed by the gateway has to go before its socket is cut.
const DISCONNECT_GRACE: Duration = Duration::from_secs(5);
/// How long the session channels of a connection whose key was revoked have to close (so the
/// client shows their last stderr: OpenSSH drops what it has not written yet when the connection
/// is cut) before the connection is disconnected.
const REVOKED_GRACE: Duration = Duration::from_secs(1);
/// How long channel tasks have to finish once their connection ended.
const CHANNEL_GRACE: Duration = Duration::from_secs(5);
/// Messages from the handler to the connection task waiting at most.
const EVENT_QUEUE: usize = 64;
/// Distinct refusal messages kept to show the user.
const MAX_MESSAGES: usize = 3;

/// Where a TCP connection came from, after any PROXY protocol header.
#[derive(Debug, Clone)]
pub struct Peer {
    /// The client's address (normalised).
    pub source: SocketAddr,
}

/// What the handler tells the connection task.
pub enum Event {
    Authenticated(Identity),
    ChannelOpen {
        channel: Channel<Msg>,
        reply: ChannelOpenHandle,
        kind: OpenKind,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OpenKind {
    Session,
    DirectTcpip { host: String, port: u16 },
}

/// Serves one client connection (already through the allowlist) until it ends; `kill` cuts the
/// socket (the stream must end its reads when it is cancelled).
pub async fn serve<S>(
    stream: S,
    peer: Peer,
    startup: StartupPermit,
    kill: CancellationToken,
    services: Arc<Services>,
    shutdown: CancellationToken,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let connection_id = uuid::Uuid::new_v4();
    let (events_tx, events_rx) = mpsc::channel(EVENT_QUEUE);
    let table = Arc::new(ChannelTable::default());
    let handler = GatewayHandler {
        connection_id,
        source: peer.source.ip(),
        services: services.clone(),
        events: events_tx,
        progress: AuthProgress::default(),
        channels: table.clone(),
        startup: Some(startup),
    };
    tracing::debug!(connection = %connection_id, source = %peer.source, "Connection accepted.");
    // run_stream sends our version and reads the client's before returning.
    let session = match tokio::time::timeout(
        LOGIN_GRACE,
        russh::server::run_stream(services.ssh_config.clone(), stream, handler),
    )
    .await
    {
        Ok(Ok(session)) => session,
        Ok(Err(error)) => {
            tracing::debug!(connection = %connection_id, source = %peer.source, %error, "SSH version exchange failed.");
            return;
        }
        Err(_) => {
            tracing::info!(connection = %connection_id, source = %peer.source, "Client sent no SSH version in time; closed.");
            return;
        }
    };
    let (deadlines, deadlines_seen) = watch::channel(DeadlinesState::Pending);
    let connection = Connection {
        id: connection_id,
        peer,
        handle: session.handle(),
        services,
        identity: None,
        route: RouteState::Unknown,
        pending: Vec::new(),
        table,
        channels: JoinSet::new(),
        traffic: Arc::new(Traffic::default()),
        opened: None,
        deadlines,
        deadlines_seen,
        next_activity: None,
        key_watch: None,
        revoked: None,
        session_channels: std::collections::HashSet::new(),
        close_reason: None,
        disconnect_at: None,
    };
    connection.run(session, events_rx, kill, shutdown).await;
}

/// Per-connection authentication progress, kept by the handler.
#[derive(Debug, Default)]
struct AuthProgress {
    /// A refused key offer was counted against the throttle (once per connection).
    offer_failure_counted: bool,
    /// Refusal messages to show the user through keyboard-interactive.
    messages: Vec<String>,
    /// The messages were shown: keyboard-interactive is not offered again.
    shown: bool,
}

/// The russh handler: authentication through the [`Authenticator`], channel opens forwarded.
///
/// [`Authenticator`]: crate::auth::Authenticator
pub struct GatewayHandler {
    connection_id: uuid::Uuid,
    source: IpAddr,
    services: Arc<Services>,
    events: mpsc::Sender<Event>,
    progress: AuthProgress,
    channels: Arc<ChannelTable>,
    /// This connection's slot among those not logged in yet; freed at authentication.
    startup: Option<StartupPermit>,
}

/// Which phase of public-key authentication a key is checked in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// The client offers a key (no signature yet): never authenticates.
    Offer,
    /// russh verified the client's signature with the key.
    Signed,
}

impl GatewayHandler {
    /// A rejection that offers keyboard-interactive only while there is a message to show.
    fn reject(&self) -> Auth {
        let mut methods = MethodSet::from(&[MethodKind::PublicKey][..]);
        if !self.progress.messages.is_empty() && !self.progress.shown {
            methods.push(MethodKind::KeyboardInteractive);
        }
        Auth::Reject {
            proceed_with_methods: Some(methods),
            partial_success: false,
        }
    }

    fn remember(&mut self, refusal: &Refusal) {
        let messages = &mut self.progress.messages;
        if messages.len() < MAX_MESSAGES && !messages.contains(&refusal.message) {
            messages.push(refusal.message.clone());
        }
    }

    /// Handles a refusal in `phase`: remembered for the user, counted when it is the key's fault.
    fn refused(&mut self, login: &str, refusal: &Refusal, phase: Phase) -> Auth {
        crate::metrics::events().refused(crate::metrics::Refused::Auth(refusal.kind));
        self.remember(refusal);
        if refusal.kind == RefusalKind::Key {
            let count = match phase {
                Phase::Signed => true,
                // Agents offer every key they hold: count one refused offer per connection.
                Phase::Offer => !std::mem::replace(&mut self.progress.offer_failure_counted, true),
            };
            if count {
                self.services.auth.failure(self.source, login);
            }
        }
        self.reject()
    }

    async fn check(&mut self, login: &str, key: &russh::keys::PublicKey, phase: Phase) -> Auth {
        let asked = std::time::Instant::now();
        let owner = self.services.auth.key_owner(self.source, login, key).await;
        crate::metrics::events().authenticated_in(asked.elapsed());
        match owner {
            Ok(owner) if phase == Phase::Offer => {
                tracing::debug!(connection = %self.connection_id, owner = %owner.owner, "Key offer accepted; waiting for the signature.");
                Auth::Accept
            }
            Ok(owner) => {
                let institute = match self.services.auth.institute_of(self.source, login) {
                    Ok(institute) => institute,
                    Err(refusal) => return self.refused(login, &refusal, phase),
                };
                if self.progress.offer_failure_counted {
                    self.services.auth.refund(self.source, login);
                }
                self.startup = None;
                tracing::info!(
                    connection = %self.connection_id,
                    source = %self.source,
                    login,
                    owner = %owner.owner,
                    fingerprint = %owner.fingerprint,
                    %institute,
                    "Authenticated."
                );
                let identity = Identity {
                    owner: owner.owner,
                    user_name: owner.user_name,
                    fingerprint: owner.fingerprint,
                    login: login.to_owned(),
                    institute,
                };
                if self
                    .events
                    .send(Event::Authenticated(identity))
                    .await
                    .is_err()
                {
                    return Auth::reject();
                }
                Auth::Accept
            }
            Err(refusal) => self.refused(login, &refusal, phase),
        }
    }

    async fn forward_open(&self, channel: Channel<Msg>, reply: ChannelOpenHandle, kind: OpenKind) {
        // If the connection task is gone, dropping the reply rejects the channel.
        let _ = self
            .events
            .send(Event::ChannelOpen {
                channel,
                reply,
                kind,
            })
            .await;
    }

    /// Queues data, EOF or close the client sent on `channel` for the channel's task.
    async fn forward_input(&mut self, channel: ChannelId, input: Input) {
        let Some(queue) = self.channels.get(channel) else {
            return;
        };
        if queue.push(input).await.is_err() {
            self.channels.remove(channel, &queue);
        }
    }

    /// Answers `request` now (see `requests.rs` for why now) and queues it for the channel's
    /// task when granted. russh sends the reply only if this request wanted one.
    async fn forward_request(
        &mut self,
        channel: ChannelId,
        request: Request,
        session: &mut Session,
    ) -> Result<(), russh::Error> {
        let Some(queue) = self.channels.get(channel) else {
            return session.channel_failure(channel);
        };
        let answer = queue.answer(&request);
        if let Answer::Refuse(why) = answer {
            tracing::debug!(connection = %self.connection_id, channel = channel.number(), request = request.name(), ?why, "Channel request refused.");
            return session.channel_failure(channel);
        }
        let queued = match queue.push(Input::Request(request)).await {
            Ok(()) => true,
            Err(PushError::Gone) | Err(PushError::Overflow) => {
                self.channels.remove(channel, &queue);
                false
            }
        };
        match (answer, queued) {
            (Answer::NoReply, _) => Ok(()),
            (_, true) => session.channel_success(channel),
            (_, false) => session.channel_failure(channel),
        }
    }

    async fn refuse_open(&self, reply: ChannelOpenHandle, what: &str) {
        tracing::info!(connection = %self.connection_id, what, "Channel type refused.");
        reply
            .reject(ChannelOpenFailure::Other {
                code: ChannelOpenFailure::AdministrativelyProhibited.code(),
                reason: format!("{what} is not supported by the ongrid gateway"),
            })
            .await;
    }
}

impl Handler for GatewayHandler {
    type Error = russh::Error;

    async fn auth_none(&mut self, _user: &str) -> Result<Auth, Self::Error> {
        Ok(self.reject())
    }

    async fn auth_password(&mut self, _user: &str, _password: &str) -> Result<Auth, Self::Error> {
        Ok(self.reject())
    }

    async fn auth_publickey_offered(
        &mut self,
        user: &str,
        offer: PublicKeyOffer<'_>,
    ) -> Result<Auth, Self::Error> {
        Ok(self.check(user, offer.public_key, Phase::Offer).await)
    }

    async fn auth_publickey(
        &mut self,
        user: &str,
        key: VerifiedPublicKey<'_>,
    ) -> Result<Auth, Self::Error> {
        Ok(self.check(user, key.public_key, Phase::Signed).await)
    }

    async fn auth_openssh_certificate(
        &mut self,
        user: &str,
        _certificate: &russh::keys::Certificate,
    ) -> Result<Auth, Self::Error> {
        tracing::info!(connection = %self.connection_id, source = %self.source, login = user, "SSH certificate refused.");
        self.remember(&Refusal {
            kind: RefusalKind::Key,
            message:
                "SSH certificates are not accepted: use the plain key you added with devctl key add"
                    .to_owned(),
        });
        Ok(self.reject())
    }

    async fn auth_keyboard_interactive<'a>(
        &'a mut self,
        _user: &str,
        _submethods: &str,
        response: Option<russh::server::Response<'a>>,
    ) -> Result<Auth, Self::Error> {
        if response.is_none() && !self.progress.messages.is_empty() && !self.progress.shown {
            self.progress.shown = true;
            let instructions = self.progress.messages.join("\n");
            return Ok(Auth::Partial {
                name: Cow::Borrowed("ongrid"),
                instructions: Cow::Owned(instructions),
                prompts: Cow::Owned(Vec::new()),
            });
        }
        Ok(self.reject())
    }

    async fn channel_open_session(
        &mut self,
        channel: Channel<Msg>,
        reply: ChannelOpenHandle,
        _session: &mut Session,
    ) -> Result<(), Self::Error> {
        self.forward_open(channel, reply, OpenKind::Session).await;
        Ok(())
    }

    async fn channel_open_direct_tcpip(
        &mut self,
        channel: Channel<Msg>,
        host_to_connect: &str,
        port_to_connect: u32,
        _originator_address: &str,
        _originator_port: u32,
        reply: ChannelOpenHandle,
        _session: &mut Session,
    ) -> Result<(), Self::Error> {
        let Ok(port) = u16::try_from(port_to_connect) else {
            reply
                .reject(ChannelOpenFailure::Other {
                    code: ChannelOpenFailure::ConnectFailed.code(),
                    reason: format!("port {port_to_connect} does not exist"),
                })
                .await;
            return Ok(());
        };
        let kind = OpenKind::DirectTcpip {
            host: host_to_connect.to_owned(),
            port,
        };
        self.forward_open(channel, reply, kind).await;
        Ok(())
    }

    async fn channel_open_x11(
        &mut self,
        _channel: Channel<Msg>,
        _originator_address: &str,
        _originator_port: u32,
        reply: ChannelOpenHandle,
        _session: &mut Session,
    ) -> Result<(), Self::Error> {
        self.refuse_open(reply, "X11 forwarding").await;
        Ok(())
    }

    async fn channel_open_forwarded_tcpip(
        &mut self,
        _channel: Channel<Msg>,
        _host_to_connect: &str,
        _port_to_connect: u32,
        _originator_address: &str,
        _originator_port: u32,
        reply: ChannelOpenHandle,
        _session: &mut Session,
    ) -> Result<(), Self::Error> {
        self.refuse_open(reply, "forwarded-tcpip").await;
        Ok(())
    }

    async fn channel_open_direct_streamlocal(
        &mut self,
        _channel: Channel<Msg>,
        _socket_path: &str,
        reply: ChannelOpenHandle,
        _session: &mut Session,
    ) -> Result<(), Self::Error> {
        self.refuse_open(reply, "Unix socket forwarding (direct-streamlocal)")
            .await;
        Ok(())
    }

    async fn data(
        &mut self,
        channel: ChannelId,
        data: &[u8],
        _session: &mut Session,
    ) -> Result<(), Self::Error> {
        self.forward_input(channel, Input::Data(data.to_vec()))
            .await;
        Ok(())
    }

    async fn extended_data(
        &mut self,
        _channel: ChannelId,
        _code: u32,
        _data: &[u8],
        _session: &mut Session,
    ) -> Result<(), Self::Error> {
        // A client's "stderr" has no meaning for a process's stdin: dropped, as sshd does.
        Ok(())
    }

    async fn channel_eof(
        &mut self,
        channel: ChannelId,
        _session: &mut Session,
    ) -> Result<(), Self::Error> {
        self.forward_input(channel, Input::Eof).await;
        Ok(())
    }

    async fn channel_close(
        &mut self,
        channel: ChannelId,
        _session: &mut Session,
    ) -> Result<(), Self::Error> {
        self.forward_input(channel, Input::Close).await;
        if let Some(queue) = self.channels.get(channel) {
            self.channels.remove(channel, &queue);
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)] // russh's signature
    async fn pty_request(
        &mut self,
        channel: ChannelId,
        term: &str,
        col_width: u32,
        row_height: u32,
        _pix_width: u32,
        _pix_height: u32,
        _modes: &[(Pty, u32)],
        session: &mut Session,
    ) -> Result<(), Self::Error> {
        let request = Request::Pty {
            term: term.to_owned(),
            cols: col_width,
            rows: row_height,
        };
        self.forward_request(channel, request, session).await
    }

    async fn env_request(
        &mut self,
        channel: ChannelId,
        variable_name: &str,
        variable_value: &str,
        session: &mut Session,
    ) -> Result<(), Self::Error> {
        let request = Request::Env {
            name: variable_name.to_owned(),
            value: variable_value.to_owned(),
        };
        self.forward_request(channel, request, session).await
    }

    async fn shell_request(
        &mut self,
        channel: ChannelId,
        session: &mut Session,
    ) -> Result<(), Self::Error> {
        self.forward_request(channel, Request::Shell, session).await
    }

    async fn exec_request(
        &mut self,
        channel: ChannelId,
        data: &[u8],
        session: &mut Session,
    ) -> Result<(), Self::Error> {
        let request = Request::Exec(data.to_vec());
        self.forward_request(channel, request, session).await
    }

    async fn subsystem_request(
        &mut self,
        channel: ChannelId,
        name: &str,
        session: &mut Session,
    ) -> Result<(), Self::Error> {
        let request = Request::Subsystem(name.to_owned());
        self.forward_request(channel, request, session).await
    }

    async fn x11_request(
        &mut self,
        channel: ChannelId,
        _single_connection: bool,
        _x11_auth_protocol: &str,
        _x11_auth_cookie: &str,
        _x11_screen_number: u32,
        session: &mut Session,
    ) -> Result<(), Self::Error> {
        self.forward_request(channel, Request::X11, session).await
    }

    async fn window_change_request(
        &mut self,
        channel: ChannelId,
        col_width: u32,
        row_height: u32,
        _pix_width: u32,
        _pix_height: u32,
        session: &mut Session,
    ) -> Result<(), Self::Error> {
        let request = Request::WindowChange {
            cols: col_width,
            rows: row_height,
        };
        self.forward_request(channel, request, session).await
    }

    async fn signal(
        &mut self,
        channel: ChannelId,
        signal: Sig,
        session: &mut Session,
    ) -> Result<(), Self::Error> {
        let request = Request::Signal(signal_name(&signal));
        self.forward_request(channel, request, session).await
    }

    async fn agent_request(
        &mut self,
        channel: ChannelId,
        _session: &mut Session,
    ) -> Result<bool, Self::Error> {
        tracing::debug!(connection = %self.connection_id, channel = channel.number(), "Agent forwarding refused.");
        Ok(false)
    }

    async fn tcpip_forward(
        &mut self,
        address: &str,
        port: &mut u32,
        _session: &mut Session,
    ) -> Result<bool, Self::Error> {
        tracing::info!(connection = %self.connection_id, address, port = *port, "Remote forwarding (ssh -R) refused.");
        Ok(false)
    }

    async fn streamlocal_forward(
        &mut self,
        socket_path: &str,
        _session: &mut Session,
    ) -> Result<bool, Self::Error> {
        tracing::info!(connection = %self.connection_id, socket_path, "Remote Unix socket forwarding refused.");
        Ok(false)
    }
}

/// Where routing stands.
enum RouteState {
    /// Not authenticated yet.
    Unknown,
    /// Asking the manager.
    Looking,
    Ready(Arc<Route>),
    /// The manager's message (or ours) for the user.
    Refused(String),
}

type RouteLookup = Pin<Box<dyn Future<Output = Result<Route, String>> + Send>>;

/// A channel open waiting for the route.
struct PendingOpen {
    /// russh's own queue of the channel is dropped at once: everything arrives through the
    /// handler's callbacks instead (see `input.rs`).
    writer: ChannelWriteHalf<Msg>,
    reply: ChannelOpenHandle,
    kind: OpenKind,
}

/// What the close event needs from the open one.
struct Opened {
    event: ConnectionEvent,
}

/// The task that owns one connection's state.
struct Connection {
    id: uuid::Uuid,
    peer: Peer,
    handle: Handle,
    services: Arc<Services>,
    identity: Option<Identity>,
    route: RouteState,
    pending: Vec<PendingOpen>,
    table: Arc<ChannelTable>,
    /// Channel tasks; each returns its channel and queue for the table.
    channels: JoinSet<(ChannelId, Arc<ChannelInput>)>,
    traffic: Arc<Traffic>,
    opened: Option<Opened>,
    /// The session's deadlines, as the manager answered the last `open` or `activity` event.
    deadlines: DeadlinesSender,
    deadlines_seen: DeadlinesReceiver,
    /// When the next `activity` event is due (once routed).
    next_activity: Option<tokio::time::Instant>,
    /// This connection's key among those checked again every second (once authenticated).
    key_watch: Option<Registration>,
    /// Where the revocation of the key comes, if it does.
    revoked: Option<oneshot::Receiver<RevokedKey>>,
    /// Session channels open, which a revocation's message is written to.
    session_channels: std::collections::HashSet<ChannelId>,
    /// Why the gateway closed the connection itself, for the close event and the disconnect.
    close_reason: Option<String>,
    /// When the gateway disconnects a connection whose key was revoked (sooner once its
    /// session channels are closed).
    disconnect_at: Option<tokio::time::Instant>,
}

impl Connection {
    async fn run<F>(
        mut self,
        session: F,
        mut events: mpsc::Receiver<Event>,
        kill: CancellationToken,
        shutdown: CancellationToken,
    ) where
        F: Future<Output = Result<(), russh::Error>>,
    {
        tokio::pin!(session);
        let login_deadline = tokio::time::Instant::now() + LOGIN_GRACE;
        let mut lookup: Option<RouteLookup> = None;
        let mut events_open = true;
        let mut cut_at: Option<tokio::time::Instant> = None;
        let result = loop {
            tokio::select! {
                result = &mut session => break result,
                event = events.recv(), if events_open => match event {
                    Some(event) => {
                        if let Some(started) = self.on_event(event).await {
                            lookup = Some(started);
                        }
                    }
                    None => events_open = false,
                },
                routed = poll_lookup(&mut lookup), if lookup.is_some() => {
                    lookup = None;
                    self.on_route(routed).await;
                }
                Some(done) = self.channels.join_next(), if !self.channels.is_empty() => {
                    if let Ok((channel, input)) = done {
                        self.table.remove(channel, &input);
                        self.session_channels.remove(&channel);
                        if self.session_channels.is_empty() && self.disconnect_at.is_some() {
                            self.disconnect_at = Some(tokio::time::Instant::now());
                        }
                    }
                }
                revoked = poll_revoked(&mut self.revoked), if self.revoked.is_some() => {
                    self.revoked = None;
                    if let Ok(revoked) = revoked {
                        if cut_at.is_none() {
                            self.close_revoked(revoked).await;
                        }
                    }
                }
                () = sleep_until_some(self.disconnect_at), if self.disconnect_at.is_some() && cut_at.is_none() => {
                    self.disconnect_at = None;
                    let message = self.close_reason.clone().unwrap_or_default();
                    let _ = tokio::time::timeout(
                        Duration::from_secs(1),
                        self.handle.disconnect(Disconnect::ByApplication, message, String::new()),
                    )
                    .await;
                    cut_at = Some(tokio::time::Instant::now() + DISCONNECT_GRACE);
                }
                () = sleep_until_some(self.next_activity), if self.next_activity.is_some() => {
                    self.report_activity();
                }
                () = tokio::time::sleep_until(login_deadline), if self.identity.is_none() && cut_at.is_none() => {
                    tracing::info!(connection = %self.id, source = %self.peer.source, "Not authenticated within the login grace time; closed.");
                    kill.cancel();
                    cut_at = Some(tokio::time::Instant::now() + DISCONNECT_GRACE);
                }
                () = shutdown.cancelled(), if cut_at.is_none() => {
                    let _ = tokio::time::timeout(
                        Duration::from_secs(1),
                        self.handle.disconnect(Disconnect::ByApplication, "the gateway is shutting down".to_owned(), String::new()),
                    ).await;
                    cut_at = Some(tokio::time::Instant::now() + DISCONNECT_GRACE);
                }
                () = sleep_until_some(cut_at), if cut_at.is_some() && !kill.is_cancelled() => {
                    kill.cancel();
                }
            }
        };
        match &result {
            Ok(()) => {
                tracing::debug!(connection = %self.id, "SSH session ended.");
            }
            Err(error) => {
                tracing::debug!(connection = %self.id, %error, "SSH session ended with an error.");
            }
        }
        // Pending opens are rejected by dropping their replies; channel tasks see their input
        // end and close their streams.
        self.pending.clear();
        self.table.finish_all();
        let channels = std::mem::take(&mut self.channels);
        finish_channels(channels).await;
        self.report_close();
    }

    /// Handles one event; returns a route lookup to start after authentication.
    async fn on_event(&mut self, event: Event) -> Option<RouteLookup> {
        match event {
            Event::Authenticated(identity) => {
                let request = RouteRequest {
                    owner: identity.owner.clone(),
                    target: identity.login.clone(),
                };
                let (registration, revoked) = self.services.open_keys.register(
                    self.id,
                    HeldKey {
                        fingerprint: identity.fingerprint.clone(),
                        owner: identity.owner.clone(),
                    },
                );
                self.key_watch = Some(registration);
                self.revoked = Some(revoked);
                self.identity = Some(identity);
                self.route = RouteState::Looking;
                let manager = self.services.manager.clone();
                let id = self.id;
                Some(Box::pin(async move {
                    match tokio::time::timeout(ROUTE_TIMEOUT, manager.route(&request)).await {
                        Ok(Ok(route)) => Ok(route),
                        Ok(Err(error)) => match error.refusal() {
                            Some(message) => Err(message.to_owned()),
                            None => {
                                tracing::error!(connection = %id, error = format!("{:#}", anyhow::Error::from(error)), "Cannot route a connection: the manager failed.");
                                Err(format!(
                                    "the gateway cannot ask the ongrid manager where session {:?} runs: try again in a minute",
                                    request.target
                                ))
                            }
                        },
                        Err(_) => {
                            tracing::error!(connection = %id, "Cannot route a connection: the manager did not answer in time.");
                            Err(
                                "the ongrid manager did not answer in time: try again in a minute"
                                    .to_owned(),
                            )
                        }
                    }
                }))
            }
            Event::ChannelOpen {
                channel,
                reply,
                kind,
            } => {
                if self.channels.len() + self.pending.len() >= MAX_CHANNELS {
                    tracing::warn!(connection = %self.id, limit = MAX_CHANNELS, "Channel refused: too many on one connection.");
                    reply
                        .reject(ChannelOpenFailure::Other {
                            code: ChannelOpenFailure::ResourceShortage.code(),
                            reason: format!(
                                "at most {MAX_CHANNELS} channels per connection: open another connection"
                            ),
                        })
                        .await;
                    return None;
                }
                let (reader, writer) = channel.split();
                drop(reader);
                let open = PendingOpen {
                    writer,
                    reply,
                    kind,
                };
                match &self.route {
                    RouteState::Ready(route) => {
                        let route = route.clone();
                        self.start(open, route).await;
                    }
                    RouteState::Refused(message) => {
                        let message = message.clone();
                        self.refuse(open, message).await;
                    }
                    RouteState::Unknown | RouteState::Looking => self.pending.push(open),
                }
                None
            }
        }
    }

    async fn on_route(&mut self, routed: Result<Route, String>) {
        let Some(identity) = &self.identity else {
            return;
        };
        match routed {
            Ok(route) => {
                tracing::info!(
                    connection = %self.id,
                    source = %self.peer.source,
                    owner = %identity.owner,
                    session = %route.session_name,
                    session_id = %route.session_id,
                    node = %route.node,
                    "Connection routed."
                );
                let event = ConnectionEvent {
                    connection_id: self.id,
                    event: ConnectionEventKind::Open,
                    at: chrono::Utc::now(),
                    owner: identity.owner.clone(),
                    fingerprint: identity.fingerprint.clone(),
                    source: normalize_ip(self.peer.source.ip()),
                    institute: identity.institute.clone(),
                    session_id: route.session_id,
                    bytes_in: 0,
                    bytes_out: 0,
                    close_reason: None,
                };
                self.services
                    .audit
                    .send_for_deadlines(event.clone(), self.deadlines.clone());
                self.opened = Some(Opened { event });
                self.next_activity =
                    Some(tokio::time::Instant::now() + self.services.activity_report);
                let route = Arc::new(route);
                self.route = RouteState::Ready(route.clone());
                for open in std::mem::take(&mut self.pending) {
                    self.start(open, route.clone()).await;
                }
            }
            Err(message) => {
                routing_refused(self.id, self.peer.source, identity, &message);
                self.route = RouteState::Refused(message.clone());
                for open in std::mem::take(&mut self.pending) {
                    self.refuse(open, message.clone()).await;
                }
            }
        }
    }

    async fn start(&mut self, open: PendingOpen, route: Arc<Route>) {
        let Some(identity) = &self.identity else {
            return;
        };
        let context = ChannelContext {
            connection_id: self.id,
            route,
            owner: identity.owner.clone(),
            agents: self.services.agents.clone(),
            manager: self.services.manager.clone(),
            traffic: self.traffic.clone(),
            handle: self.handle.clone(),
            deadlines: self.deadlines_seen.clone(),
            warn_before: self.services.warn_before,
        };
        let id = open.writer.id();
        let kind = match open.kind {
            OpenKind::Session => ChannelKind::Session,
            OpenKind::DirectTcpip { .. } => ChannelKind::DirectTcpip,
        };
        let input = self.table.register(id, kind);
        let ends = ChannelEnds {
            input: input.clone(),
            writer: open.writer,
        };
        match open.kind {
            OpenKind::Session => {
                open.reply.accept().await;
                self.session_channels.insert(id);
                self.channels.spawn(async move {
                    channel::session(ends, context).await;
                    (id, input)
                });
            }
            OpenKind::DirectTcpip { host, port } => {
                self.channels.spawn(async move {
                    channel::direct_tcpip(ends, open.reply, host, port, context).await;
                    (id, input)
                });
            }
        }
    }

    async fn refuse(&mut self, open: PendingOpen, message: String) {
        match open.kind {
            OpenKind::Session => {
                let id = open.writer.id();
                let input = self.table.register(id, ChannelKind::Session);
                let ends = ChannelEnds {
                    input: input.clone(),
                    writer: open.writer,
                };
                open.reply.accept().await;
                let handle = self.handle.clone();
                self.channels.spawn(async move {
                    channel::refused_session(ends, handle, message).await;
                    (id, input)
                });
            }
            OpenKind::DirectTcpip { .. } => {
                open.reply
                    .reject(ChannelOpenFailure::Other {
                        code: ChannelOpenFailure::AdministrativelyProhibited.code(),
                        reason: message,
                    })
                    .await;
            }
        }
    }

    /// The connection's key was removed or expired: the manager's message on every session
    /// channel's stderr, then exit status 255, EOF and close on it; the disconnect (with the
    /// message too) follows once those channels are closed or [`REVOKED_GRACE`] passed, and the
    /// socket is cut if the client does not go.
    async fn close_revoked(&mut self, revoked: RevokedKey) {
        self.key_watch = None;
        tracing::info!(
            connection = %self.id,
            source = %self.peer.source,
            owner = %revoked.key.owner,
            fingerprint = ?revoked.key.fingerprint,
            why = ?revoked.why,
            at = %revoked.at,
            channels = self.session_channels.len(),
            "Closing a connection: its key is no longer valid."
        );
        let line = format!("\r\nongrid: {}\r\n", revoked.message);
        let handle = &self.handle;
        for &channel in &self.session_channels {
            let _ = tokio::time::timeout(Duration::from_secs(1), async {
                let _ = handle
                    .extended_data(channel, 1, line.clone().into_bytes())
                    .await;
                let _ = handle.exit_status_request(channel, 255).await;
                let _ = handle.eof(channel).await;
                let _ = handle.close(channel).await;
            })
            .await;
        }
        let now = tokio::time::Instant::now();
        self.disconnect_at = Some(if self.session_channels.is_empty() {
            now
        } else {
            now + REVOKED_GRACE
        });
        self.close_reason = Some(revoked.message);
    }

    /// The byte totals so far: (to the container, to the client).
    fn bytes(&self) -> (u64, u64) {
        let read = |counter: &std::sync::atomic::AtomicU64| {
            counter.load(std::sync::atomic::Ordering::Relaxed)
        };
        (
            read(&self.traffic.to_container),
            read(&self.traffic.to_client),
        )
    }

    /// Tells the manager the connection is still open, with its byte totals; its answer
    /// refreshes the deadlines. Due again one `activity_report` later.
    fn report_activity(&mut self) {
        self.next_activity = Some(tokio::time::Instant::now() + self.services.activity_report);
        let Some(opened) = &self.opened else {
            return;
        };
        let (bytes_in, bytes_out) = self.bytes();
        let event = ConnectionEvent {
            event: ConnectionEventKind::Activity,
            at: chrono::Utc::now(),
            bytes_in,
            bytes_out,
            ..opened.event.clone()
        };
        self.services
            .audit
            .send_for_deadlines(event, self.deadlines.clone());
    }

    fn report_close(&self) {
        let (bytes_in, bytes_out) = self.bytes();
        let Some(opened) = &self.opened else {
            tracing::debug!(connection = %self.id, source = %self.peer.source, "Connection closed before it was routed.");
            return;
        };
        tracing::info!(
            connection = %self.id,
            source = %self.peer.source,
            owner = %opened.event.owner,
            session_id = %opened.event.session_id,
            bytes_in,
            bytes_out,
            close_reason = self.close_reason.as_deref(),
            "Connection closed."
        );
        self.services.audit.send(ConnectionEvent {
            event: ConnectionEventKind::Close,
            at: chrono::Utc::now(),
            bytes_in,
            bytes_out,
            close_reason: self.close_reason.clone(),
            ..opened.event.clone()
        });
    }
}

async fn poll_lookup(lookup: &mut Option<RouteLookup>) -> Result<Route, String> {
    match lookup.as_mut() {
        Some(lookup) => lookup.await,
        None => std::future::pending().await,
    }
}

async fn poll_revoked(
    revoked: &mut Option<oneshot::Receiver<RevokedKey>>,
) -> Result<RevokedKey, oneshot::error::RecvError> {
    match revoked.as_mut() {
        Some(receiver) => receiver.await,
        None => std::future::pending().await,
    }
}

async fn sleep_until_some(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

/// Lets channel tasks finish on their own for a moment (they see their channel end), then
/// aborts the rest.
async fn finish_channels(mut channels: JoinSet<(ChannelId, Arc<ChannelInput>)>) {
    let drained = tokio::time::timeout(CHANNEL_GRACE, async {
        while channels.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        tracing::debug!(
            left = channels.len(),
            "Aborting channel tasks that did not end."
        );
        channels.shutdown().await;
    }
}

/// Logs the manager's refusal to route a connection. The login is the client's string, and the
/// reason names the session it asked for, so both are logged escaped (`?`): a login holding a
/// newline, a carriage return or an ESC cannot write a line of its own into the log.
fn routing_refused(id: uuid::Uuid, source: SocketAddr, identity: &Identity, reason: &str) {
    tracing::info!(connection = %id, %source, owner = %identity.owner, login = ?identity.login, ?reason, "Routing refused.");
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A login that tries to end the log line and write one of its own, with a carriage return
    /// and a terminal escape: logged as one escaped field of one line.
    #[test]
    fn a_forged_login_is_logged_escaped() {
        let login = "x\n2026-11-28T00:00:00Z  INFO ongrid_gateway: key accepted\r\u{1b}[2K";
        let identity = Identity {
            owner: ongrid_core::Dn::parse("/DC=org/CN=Alice").unwrap(),
            user_name: ongrid_core::UserName::parse("alice").unwrap(),
            fingerprint: "SHA256:x".to_owned(),
            login: login.to_owned(),
            institute: ongrid_core::InstituteName::parse("lab").unwrap(),
        };
        let text = crate::test_log::captured(|| {
            routing_refused(
                uuid::Uuid::nil(),
                "192.0.2.1:4000".parse().unwrap(),
                &identity,
                &format!("no session named {login}"),
            );
        });
        assert_eq!(text.lines().count(), 1, "{text}");
        assert!(!text.contains('\r') && !text.contains('\u{1b}'), "{text:?}");
        assert!(
            text.contains(
                r#"login="x\n2026-11-28T00:00:00Z  INFO ongrid_gateway: key accepted\r\u{1b}[2K""#
            ),
            "{text}"
        );
    }
}
