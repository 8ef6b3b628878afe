//! A session's web apps in the browser: JupyterLab, and any web server the user starts on a
//! port of the session (TensorBoard, a Gradio demo). This module decides who reaches what; the
//! dashboard (`crate::dashboard::apps`) carries the HTTP and WebSocket bytes.
//!
//! - Only the session's owner reaches it, and only while it runs: a held, pending or ended
//!   session is refused with what to do ([`WebApps::target`]).
//! - The bytes go through the agent's stream endpoint, as an SSH port forward's do: one
//!   `DirectTcpip` stream to `127.0.0.1:<port>` inside the container per connection. No
//!   listener on the node, no port published by Docker. The manager presents the site's
//!   gateway token (`gateway_token_file`), which the agents already trust for streams.
//! - JupyterLab is started on demand inside the session, as the session's user, by the dev
//!   image's launcher (`ongrid-jupyter start`, run through an `Exec` stream): bound to the
//!   container's loopback, with a token of its own that the manager keeps in memory and sends
//!   as `Authorization: token ...`; the browser never sees it. A manager that restarted, or
//!   another replica, asks the launcher again, which answers with the running server.
//! - A browser counts as a connection, as SSH does (`ConnectionEvent`s with institute
//!   [`BROWSER_INSTITUTE`]): what the browser sends through a WebSocket (a cell run, a
//!   terminal's keys) and requests that change something (a notebook saved) are activity;
//!   an open tab whose page only polls is not, so it never keeps a GPU by itself.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ongrid_core::api::{ConnectionEvent, ConnectionEventKind};
use ongrid_core::network::InstituteName;
use ongrid_core::stream::{StreamKind, StreamOpen};
use ongrid_core::{SessionId, SessionName, SessionState};
use ongrid_service::agent_stream::{AgentBytes, AgentConnector, AgentError, Finished};
use serde::Deserialize;

use super::caller::CurrentUser;
use super::lookup::{self, Lookup};
use super::{ApiError, AppState, Effect};
use crate::domain::sessions::SessionRecord;

/// The institute a browser's connections are recorded under in the audit log.
pub const BROWSER_INSTITUTE: &str = "browser";
/// What stands for a key's fingerprint in a browser connection's audit record.
pub const BROWSER_FINGERPRINT: &str = "dashboard login";
/// How often an open browser connection reports its traffic (as the gateway's default).
pub const ACTIVITY_REPORT: Duration = Duration::from_secs(60);
/// How long JupyterLab may take to start (the launcher waits up to 90 s itself).
pub const JUPYTER_START: Duration = Duration::from_secs(120);
/// The launcher's exit code when the session's image has no JupyterLab.
const NO_JUPYTER: u32 = 127;

/// Which web app of a session.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WebApp {
    /// JupyterLab, started on demand; its path prefix is its base URL.
    Jupyter,
    /// Whatever listens on this port of the session's loopback; the prefix is taken off.
    Port(u16),
}

impl WebApp {
    /// The app's path on the manager, with the trailing slash.
    pub fn base_path(self, session: &SessionName) -> String {
        match self {
            Self::Jupyter => format!("/dashboard/sessions/{session}/apps/jupyter/"),
            Self::Port(port) => format!("/dashboard/sessions/{session}/apps/port/{port}/"),
        }
    }
}

/// Where one request of a web app goes.
#[derive(Debug, Clone)]
pub struct WebTarget {
    pub session: SessionRecord,
    pub app: WebApp,
    /// The agent's stream endpoint of the session's node.
    pub agent_url: String,
    /// The port inside the session.
    pub port: u16,
    /// JupyterLab's own token, for the `Authorization` header the proxy adds.
    pub token: Option<String>,
}

impl WebTarget {
    /// A name for pooled connections to this target: one pool per session, node and port.
    pub fn pool_key(&self) -> String {
        let node = self.session.node.as_ref().map_or("", |node| node.as_str());
        let digest = crate::app::logins::digest(&format!("{}\n{node}", self.agent_url));
        format!(
            "p{}-{}-{}",
            self.port,
            self.session.id.0.simple(),
            &digest[..12]
        )
    }

    fn open(&self) -> StreamOpen {
        stream_open(
            &self.session,
            StreamKind::DirectTcpip {
                host: "127.0.0.1".to_owned(),
                port: self.port,
            },
        )
    }
}

/// A JupyterLab server running in a session, as its launcher reported it.
#[derive(Clone, PartialEq, Eq, Deserialize)]
struct JupyterServer {
    port: u16,
    token: String,
    base_url: String,
}

impl std::fmt::Debug for JupyterServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JupyterServer")
            .field("port", &self.port)
            .field("base_url", &self.base_url)
            .finish_non_exhaustive()
    }
}

type JupyterSlot = Arc<tokio::sync::Mutex<Option<JupyterServer>>>;

/// What the manager keeps for web apps: the agent stream client, the JupyterLab servers it
/// knows, and the traffic of open browser connections.
pub struct WebApps {
    /// `None` when the manager has no `gateway_token_file`: web apps are then refused.
    streams: Option<AgentConnector>,
    jupyter: Mutex<HashMap<SessionId, JupyterSlot>>,
    /// Requests that changed something, counted towards a session's open browser connection.
    changes: Mutex<HashMap<SessionId, Arc<AtomicU64>>>,
}

impl std::fmt::Debug for WebApps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WebApps")
            .field("streams", &self.streams.is_some())
            .finish_non_exhaustive()
    }
}

impl WebApps {
    pub fn new(streams: Option<AgentConnector>) -> Self {
        Self {
            streams,
            jupyter: Mutex::new(HashMap::new()),
            changes: Mutex::new(HashMap::new()),
        }
    }

    fn streams(&self) -> Result<&AgentConnector, ApiError> {
        self.streams.as_ref().ok_or_else(|| {
            ApiError::unavailable(
                "this manager cannot reach sessions' web apps: its config has no \
                 gateway_token_file (the token the agents trust for streams); ask the site's \
                 admins to set it",
            )
        })
    }

    /// Where `app` of the caller's session `name` is, after checking that the session is the
    /// caller's own and running; JupyterLab is started when it does not run yet.
    pub async fn target(
        &self,
        state: &AppState,
        caller: &CurrentUser,
        name: &str,
        app: WebApp,
    ) -> Result<WebTarget, ApiError> {
        let session = lookup::find_session(state, caller, name, None, Lookup::NotEnded).await?;
        let agent_url = match running_agent(state, &session).await {
            Ok(agent_url) => agent_url,
            Err(refusal) => {
                self.forget(session.id);
                return Err(refusal);
            }
        };
        let streams = self.streams()?;
        let (port, token) = match app {
            WebApp::Port(port) => (port, None),
            WebApp::Jupyter => {
                let server = self.jupyter(streams, &agent_url, &session, false).await?;
                (server.port, Some(server.token))
            }
        };
        Ok(WebTarget {
            session,
            app,
            agent_url,
            port,
            token,
        })
    }

    /// Opens one connection to the target's port inside the session. When JupyterLab's port
    /// refuses (its server ended), the launcher is asked again once.
    pub async fn connect(&self, target: &mut WebTarget) -> Result<AgentBytes, ApiError> {
        let streams = self.streams()?;
        match streams.open(&target.agent_url, &target.open()).await {
            Ok(stream) => Ok(stream.into_bytes()),
            Err(AgentError::Refused(_)) if target.app == WebApp::Jupyter => {
                let server = self
                    .jupyter(streams, &target.agent_url, &target.session, true)
                    .await?;
                target.port = server.port;
                target.token = Some(server.token);
                let stream = streams
                    .open(&target.agent_url, &target.open())
                    .await
                    .map_err(|error| unreachable_port(&target.session.name, target.port, &error))?;
                Ok(stream.into_bytes())
            }
            Err(error) => Err(unreachable_port(&target.session.name, target.port, &error)),
        }
    }

    /// The session's JupyterLab: the one this manager knows, else what the launcher says
    /// (starting it when none runs). One launch at a time per session.
    async fn jupyter(
        &self,
        streams: &AgentConnector,
        agent_url: &str,
        session: &SessionRecord,
        again: bool,
    ) -> Result<JupyterServer, ApiError> {
        let slot = locked(&self.jupyter).entry(session.id).or_default().clone();
        let mut known = slot.lock().await;
        let base_url = WebApp::Jupyter.base_path(&session.name);
        if let Some(server) = known.as_ref() {
            if !again && server.base_url == base_url {
                return Ok(server.clone());
            }
        }
        let server = launch_jupyter(streams, agent_url, session, &base_url).await?;
        *known = Some(server.clone());
        Ok(server)
    }

    /// Forgets what this manager keeps of a session that is not running (its JupyterLab
    /// stopped with its container).
    fn forget(&self, session: SessionId) {
        locked(&self.jupyter).remove(&session);
        locked(&self.changes).remove(&session);
    }

    /// What a page of the session's web apps shows above itself: nothing, or the warning of a
    /// hold due within the site's `warn_before` (as the gateway warns an SSH terminal), or why
    /// the session cannot be reached now.
    pub async fn warning(
        &self,
        state: &AppState,
        caller: &CurrentUser,
        name: &str,
    ) -> Result<Option<String>, ApiError> {
        let session = lookup::find_session(state, caller, name, None, Lookup::Any).await?;
        if let Err(refusal) = running_agent(state, &session).await {
            return Ok(Some(refusal.message().to_owned()));
        }
        let deadlines = super::views::deadlines_view(state, &session).await?;
        let now = state.clock.now();
        let Some(hold) = deadlines.next_hold else {
            return Ok(None);
        };
        let left = (hold.at - now).max(chrono::TimeDelta::zero());
        let warn_before = chrono::TimeDelta::from_std(state.config.lifecycle.warn_before)
            .unwrap_or(chrono::TimeDelta::MAX);
        if left > warn_before {
            return Ok(None);
        }
        let name = &session.name;
        Ok(Some(format!(
            "Session {name} will be put on hold in {} ({}): its container stops and its GPUs \
             are freed. Use it, or keep it alive with `devctl session keep {name}` or the \
             dashboard's Keep button.",
            in_words(left),
            hold.reason
        )))
    }

    /// The TCP ports programs of the caller's running session `name` listen on (read from the
    /// session's own `/proc/net/tcp` and `tcp6`, by a command run in it as its user).
    pub async fn listening_ports(
        &self,
        state: &AppState,
        caller: &CurrentUser,
        name: &str,
    ) -> Result<SessionPorts, ApiError> {
        let session = lookup::find_session(state, caller, name, None, Lookup::NotEnded).await?;
        let agent_url = running_agent(state, &session).await?;
        let streams = self.streams()?;
        let command = "cat /proc/net/tcp /proc/net/tcp6 2>/dev/null";
        let finished = run_in_session(streams, &agent_url, &session, command, PORTS_TIMEOUT)
            .await
            .map_err(|failure| match failure {
                RunFailure::Timeout => ApiError::gateway_timeout(format!(
                    "session {} did not list its ports within {} s: reload",
                    session.name,
                    PORTS_TIMEOUT.as_secs()
                )),
                RunFailure::Agent(error) => ApiError::bad_gateway(format!(
                    "the ports of session {} could not be listed: {error}",
                    session.name
                )),
            })?;
        let jupyter = {
            let slot = locked(&self.jupyter).get(&session.id).cloned();
            match slot {
                Some(slot) => slot.lock().await.as_ref().map(|server| server.port),
                None => None,
            }
        };
        let mut ports = listening(&String::from_utf8_lossy(&finished.stdout));
        for port in &mut ports {
            port.jupyter = Some(port.port) == jupyter;
        }
        Ok(SessionPorts {
            session: session.name,
            ports,
        })
    }

    /// Counts a request that changed something in a session's web app (a save, a new kernel)
    /// as the browser's activity, reported with its next connection report.
    pub fn note_change(&self, session: SessionId, bytes: u64) {
        self.change_counter(session)
            .fetch_add(bytes.max(1), Ordering::Relaxed);
    }

    fn change_counter(&self, session: SessionId) -> Arc<AtomicU64> {
        locked(&self.changes).entry(session).or_default().clone()
    }
}

/// The map behind `mutex`, also after a panic while another held it (what it holds stays valid).
fn locked<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A time left, as a person reads it: "1 h 59 min", "8 min", "less than a minute".
fn in_words(left: chrono::TimeDelta) -> String {
    let minutes = left.num_minutes();
    match (minutes / 60, minutes % 60) {
        (0, 0) => "less than a minute".to_owned(),
        (0, m) => format!("{m} min"),
        (h, 0) => format!("{h} h"),
        (h, m) => format!("{h} h {m} min"),
    }
}

/// How long listing a session's ports may take.
const PORTS_TIMEOUT: Duration = Duration::from_secs(15);

/// What a session listens on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionPorts {
    pub session: SessionName,
    pub ports: Vec<ListeningPort>,
}

/// One listening TCP port of a session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListeningPort {
    pub port: u16,
    /// `127.0.0.1`, `0.0.0.0`, `::1`, `::` or another address of the session's.
    pub address: String,
    /// The session's JupyterLab, as this manager knows it.
    pub jupyter: bool,
}

/// The listening sockets of `/proc/net/tcp` and `/proc/net/tcp6` text (state `0A`), one per
/// port (the first address seen), by port.
fn listening(text: &str) -> Vec<ListeningPort> {
    let mut ports: Vec<ListeningPort> = Vec::new();
    for line in text.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let (Some(local), Some(&"0A")) = (fields.get(1), fields.get(3)) else {
            continue;
        };
        let Some((address, port)) = local.split_once(':') else {
            continue;
        };
        let Ok(port) = u16::from_str_radix(port, 16) else {
            continue;
        };
        let Some(address) = proc_address(address) else {
            continue;
        };
        if port == 0 || ports.iter().any(|known| known.port == port) {
            continue;
        }
        ports.push(ListeningPort {
            port,
            address,
            jupyter: false,
        });
    }
    ports.sort_by_key(|known| known.port);
    ports
}

/// An address as `/proc/net/tcp*` writes it: 32-bit words in hex, each in the host's byte
/// order (little-endian on every platform ongrid runs on).
fn proc_address(hex: &str) -> Option<String> {
    let words = (0..hex.len() / 8)
        .map(|i| u32::from_str_radix(hex.get(i * 8..i * 8 + 8)?, 16).ok())
        .collect::<Option<Vec<u32>>>()?;
    let bytes: Vec<u8> = words.iter().flat_map(|word| word.to_le_bytes()).collect();
    match bytes.len() {
        4 => Some(std::net::Ipv4Addr::new(bytes[0], bytes[1], bytes[2], bytes[3]).to_string()),
        16 => {
            let octets: [u8; 16] = bytes.try_into().ok()?;
            let v6 = std::net::Ipv6Addr::from(octets);
            Some(
                v6.to_ipv4_mapped()
                    .map_or_else(|| v6.to_string(), |v4| v4.to_string()),
            )
        }
        _ => None,
    }
}

/// The agent URL of a running session's node, or why the session cannot be reached now.
async fn running_agent(state: &AppState, session: &SessionRecord) -> Result<String, ApiError> {
    let name = &session.name;
    match session.state {
        SessionState::Waiting | SessionState::Connected | SessionState::Idle => {}
        SessionState::Held => {
            // The advice first: a WebSocket's close carries only the first 123 bytes.
            return Err(ApiError::conflict(format!(
                "session {name} is HELD: release it with `devctl session release {name}` or the \
                 dashboard's Release button, then reload (its container is stopped, its files \
                 are kept; {})",
                session.reason
            )));
        }
        SessionState::Pending | SessionState::Starting => {
            return Err(ApiError::conflict(format!(
                "session {name} is {} ({}): it is not running yet; this page works once it is \
                 (`devctl session new --wait` waits for it)",
                session.state, session.reason
            )));
        }
        SessionState::Failed => {
            return Err(ApiError::conflict(format!(
                "session {name} FAILED ({}): remove it with `devctl session rm {name}` and \
                 start a new one",
                session.reason
            )));
        }
        SessionState::Ended => {
            return Err(ApiError::not_found(format!(
                "session {name} has ended: start a new one with `devctl session new`"
            )));
        }
    }
    let node = session.node.as_ref().ok_or_else(|| {
        ApiError::conflict(format!("session {name} has no node yet: try again shortly"))
    })?;
    let stream_url = lookup::stream_url(state, node).await?;
    stream_url.ok_or_else(|| {
        ApiError::unavailable(format!(
            "the agent of node {node} (session {name}) has no stream endpoint: ask the site's \
             admins to set [streams] in its config"
        ))
    })
}

/// What a stream to the session's container opens.
fn stream_open(session: &SessionRecord, kind: StreamKind) -> StreamOpen {
    StreamOpen {
        session_id: session.id,
        owner: session.owner.clone(),
        kind,
        env: vec![],
    }
}

/// Why a command run in a session did not finish.
enum RunFailure {
    Agent(AgentError),
    Timeout,
}

/// Runs `command` in the session as its user (through the user's shell), with nothing on its
/// input, to its end within `within`.
async fn run_in_session(
    streams: &AgentConnector,
    agent_url: &str,
    session: &SessionRecord,
    command: &str,
    within: Duration,
) -> Result<Finished, RunFailure> {
    let open = stream_open(
        session,
        StreamKind::Exec {
            command: command.to_owned(),
            pty: None,
        },
    );
    let run = async { streams.open(agent_url, &open).await?.run_to_exit().await };
    match tokio::time::timeout(within, run).await {
        Ok(finished) => finished.map_err(RunFailure::Agent),
        Err(_) => Err(RunFailure::Timeout),
    }
}

/// Runs the launcher in the session and reads its answer.
async fn launch_jupyter(
    streams: &AgentConnector,
    agent_url: &str,
    session: &SessionRecord,
    base_url: &str,
) -> Result<JupyterServer, ApiError> {
    let name = &session.name;
    let command = format!("ongrid-jupyter start --base-url {base_url}");
    let finished = match run_in_session(streams, agent_url, session, &command, JUPYTER_START).await
    {
        Ok(finished) => finished,
        Err(RunFailure::Agent(error)) => {
            tracing::warn!(session = %name, %error, "Starting JupyterLab failed.");
            return Err(ApiError::bad_gateway(format!(
                "JupyterLab of session {name} could not be started: {error}"
            )));
        }
        Err(RunFailure::Timeout) => {
            return Err(ApiError::gateway_timeout(format!(
                "JupyterLab of session {name} did not start within {} s: see \
                 ~/.local/state/ongrid-jupyter/jupyter.log in the session",
                JUPYTER_START.as_secs()
            )));
        }
    };
    let stderr = String::from_utf8_lossy(&finished.stderr).trim().to_owned();
    match finished.code() {
        Some(0) => {}
        Some(NO_JUPYTER) => {
            return Err(ApiError::conflict(format!(
                "session {name} cannot run JupyterLab: {}",
                if stderr.is_empty() {
                    "its image has no ongrid-jupyter launcher; use the ongrid dev image".to_owned()
                } else {
                    stderr
                }
            )));
        }
        code => {
            tracing::warn!(session = %name, ?code, %stderr, "The JupyterLab launcher failed.");
            return Err(ApiError::bad_gateway(format!(
                "JupyterLab of session {name} did not start: {stderr}"
            )));
        }
    }
    let line = String::from_utf8_lossy(&finished.stdout);
    let server: JupyterServer = line
        .lines()
        .rev()
        .find_map(|line| serde_json::from_str(line.trim()).ok())
        .ok_or_else(|| {
            ApiError::bad_gateway(format!(
                "the JupyterLab launcher of session {name} answered something else than its \
                 JSON line: is /usr/local/bin/ongrid-jupyter the dev image's?"
            ))
        })?;
    if server.base_url != base_url {
        return Err(ApiError::bad_gateway(format!(
            "JupyterLab of session {name} runs under {} instead of {base_url}: run \
             `ongrid-jupyter stop` in the session and open the page again",
            server.base_url
        )));
    }
    tracing::info!(session = %name, port = server.port, "JupyterLab of the session is up.");
    Ok(server)
}

/// The refusal of a port nothing answers on.
fn unreachable_port(session: &SessionName, port: u16, error: &AgentError) -> ApiError {
    match error {
        AgentError::Refused(text) => ApiError::bad_gateway(format!(
            "nothing answers on port {port} of session {session} ({text}): start your web \
             server there, listening on 127.0.0.1:{port} or 0.0.0.0:{port}, then reload"
        )),
        other => {
            tracing::warn!(%session, port, error = %other, "The session's agent could not be reached.");
            ApiError::bad_gateway(format!(
                "the node of session {session} could not be reached ({other}): try again; if \
                 it lasts, see `devctl session show {session}`"
            ))
        }
    }
}

/// One browser connection to a session (a WebSocket through the proxy), as the audit log and
/// the hold policy see it.
#[derive(Debug)]
pub struct BrowserConnection {
    opened: ConnectionEvent,
    /// What the browser sent (activity).
    pub bytes_in: AtomicU64,
    /// What the session sent back.
    pub bytes_out: AtomicU64,
    /// The session's count of changing requests ([`WebApps::note_change`]), and its value at
    /// the open: what came after is this connection's activity too.
    changes: Arc<AtomicU64>,
    changes_at_open: u64,
}

impl BrowserConnection {
    fn event(&self, kind: ConnectionEventKind, state: &AppState) -> ConnectionEvent {
        let changes = self
            .changes
            .load(Ordering::Relaxed)
            .saturating_sub(self.changes_at_open);
        ConnectionEvent {
            event: kind,
            at: state.clock.now(),
            bytes_in: self.bytes_in.load(Ordering::Relaxed) + changes,
            bytes_out: self.bytes_out.load(Ordering::Relaxed),
            ..self.opened.clone()
        }
    }
}

/// The target's session as it is now (`None`: gone).
pub async fn session_now(
    state: &AppState,
    target: &WebTarget,
) -> Result<Option<SessionRecord>, ApiError> {
    Ok(state.store.session(target.session.id).await?)
}

/// Records the open of a browser connection to the target's session.
pub async fn browser_opened(
    state: &AppState,
    target: &WebTarget,
    source: IpAddr,
) -> Result<Arc<BrowserConnection>, ApiError> {
    let institute = InstituteName::parse(BROWSER_INSTITUTE)
        .map_err(|error| ApiError::internal(format!("the browser institute name: {error}")))?;
    let changes = state.web_apps.change_counter(target.session.id);
    let connection = Arc::new(BrowserConnection {
        opened: ConnectionEvent {
            connection_id: uuid::Uuid::new_v4(),
            event: ConnectionEventKind::Open,
            at: state.clock.now(),
            owner: target.session.owner.clone(),
            fingerprint: BROWSER_FINGERPRINT.to_owned(),
            source,
            institute,
            session_id: target.session.id,
            bytes_in: 0,
            bytes_out: 0,
            close_reason: None,
        },
        bytes_in: AtomicU64::new(0),
        bytes_out: AtomicU64::new(0),
        changes_at_open: changes.load(Ordering::Relaxed),
        changes,
    });
    let opened = &connection.opened;
    state
        .store
        .record_connection(opened, state.clock.now())
        .await?;
    tracing::info!(connection = %opened.connection_id, session = %target.session.name,
        %source, app = ?target.app, "Browser connection to a session's web app.");
    // The session may be CONNECTED now, as with an SSH connection (`gateway::connection_event`).
    state.committed(&[Effect::People]);
    Ok(connection)
}

/// Reports an open browser connection's traffic so far (its activity).
pub async fn browser_activity(state: &AppState, connection: &BrowserConnection) {
    let event = connection.event(ConnectionEventKind::Activity, state);
    match state
        .store
        .record_connection(&event, state.clock.now())
        .await
    {
        // Back from IDLE (or first traffic): as with an SSH connection's activity.
        Ok(recorded) if recorded.transition.is_some() => state.committed(&[Effect::People]),
        Ok(_) => {}
        Err(error) => {
            tracing::warn!(connection = %event.connection_id, %error, "Recording a browser connection's activity failed.");
        }
    }
}

/// Records the close of a browser connection.
pub async fn browser_closed(state: &AppState, connection: &BrowserConnection) {
    let event = connection.event(ConnectionEventKind::Close, state);
    match state
        .store
        .record_connection(&event, state.clock.now())
        .await
    {
        Ok(_) => {
            tracing::info!(connection = %event.connection_id, bytes_in = event.bytes_in,
                bytes_out = event.bytes_out, "Browser connection closed.");
            state.committed(&[Effect::People]);
        }
        Err(error) => tracing::warn!(connection = %event.connection_id, %error,
            "Recording the close of a browser connection failed."),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listening_ports_come_from_proc_net_tcp() {
        let text = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:22B8 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 1 1 0 100 0 0 10 0
   1: 00000000:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 2 1 0 100 0 0 10 0
   2: 0100007F:22B8 0100007F:C350 01 00000000:00000000 00:00000000 00000000  1000        0 3 1 0 20 4 30 10 -1
  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000000000000000000001000000:1776 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 4 1 0 100 0 0 10 0
   1: 00000000000000000000000000000000:1F90 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 5 1 0 100 0 0 10 0
";
        let ports = listening(text);
        let seen: Vec<(u16, &str)> = ports.iter().map(|p| (p.port, p.address.as_str())).collect();
        assert_eq!(
            seen,
            vec![(6006, "::1"), (8080, "0.0.0.0"), (8888, "127.0.0.1")],
            "an established connection (state 01) is no listener; a port seen twice is listed once"
        );
        assert!(listening("garbage\n 0: zz:zz 0 0A\n").is_empty());
    }

    #[test]
    fn times_left_in_words() {
        let minutes = chrono::TimeDelta::minutes;
        assert_eq!(
            in_words(chrono::TimeDelta::seconds(59)),
            "less than a minute"
        );
        assert_eq!(in_words(minutes(8)), "8 min");
        assert_eq!(in_words(minutes(120)), "2 h");
        assert_eq!(in_words(minutes(119)), "1 h 59 min");
    }

    #[test]
    fn apps_have_their_own_paths() {
        let name = SessionName::parse("train1").unwrap();
        assert_eq!(
            WebApp::Jupyter.base_path(&name),
            "/dashboard/sessions/train1/apps/jupyter/"
        );
        assert_eq!(
            WebApp::Port(6006).base_path(&name),
            "/dashboard/sessions/train1/apps/port/6006/"
        );
    }
}
