//! The client side of the stream protocol (`core/src/stream.rs`): one WebSocket over TLS to
//! the node agent per stream — per SSH channel for the gateway, per proxied connection for the
//! manager's web apps. [`AgentConnector::open`] dials `wss://<agent>/v1/streams`
//! with the gateway's token, sends the [`StreamOpen`] and waits for the agent's
//! [`Frame::Ready`]; an agent's [`Frame::Error`] comes back as [`AgentError::Refused`], whose
//! text is for the user.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use crate::websocket::{self, Incoming, MessageError, MessageReader, MessageWriter, Side};
use ongrid_core::stream::{
    data_message, output_of, ExitStatus, Frame, Output, StreamOpen, MAX_FRAME_PAYLOAD, STREAM_PATH,
    TLS_READ_BUFFER,
};
use rustls::pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_rustls::TlsConnector;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::http::header::AUTHORIZATION;
use tokio_tungstenite::tungstenite::http::HeaderValue;
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_util::sync::CancellationToken;
use url::Url;

use crate::secret::Token;

/// Everything from the TCP connect to the agent's `Ready`: dial, TLS, upgrade, process start.
pub const OPEN_TIMEOUT: Duration = Duration::from_secs(15);

/// The connection of a stream to an agent.
pub type AgentConnection = TlsStream<BufReader<TcpStream>>;

/// The largest message read from an agent.
const MAX_MESSAGE: usize = 4 * MAX_FRAME_PAYLOAD;

/// An open stream to an agent, after its `Ready`: its halves.
pub struct AgentStream {
    pub source: MessageReader<AgentConnection>,
    pub sink: MessageWriter<AgentConnection>,
}

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("agent URL {0:?} is not a wss:// URL with a host")]
    BadUrl(String),
    #[error("cannot connect to the agent at {address}")]
    Connect {
        address: String,
        #[source]
        source: std::io::Error,
    },
    #[error("TLS with the agent at {address} failed")]
    Tls {
        address: String,
        #[source]
        source: std::io::Error,
    },
    #[error("the agent at {address} refused the stream")]
    Handshake {
        address: String,
        #[source]
        source: Box<tokio_tungstenite::tungstenite::Error>,
    },
    #[error("the stream to the agent at {address} broke before it started")]
    Broken {
        address: String,
        #[source]
        source: MessageError,
    },
    /// The agent's own words (its `Error` frame), for the user.
    #[error("{0}")]
    Refused(String),
    #[error("the agent at {address} closed the stream before starting it")]
    ClosedEarly { address: String },
    #[error("the agent at {address} broke the stream protocol: {detail}")]
    Protocol { address: String, detail: String },
    #[error("the agent at {address} did not start the stream within {} s", OPEN_TIMEOUT.as_secs())]
    Timeout { address: String },
}

/// Opens streams to agents: TLS trusting the `ca_dir` CAs, the site's gateway token as Bearer
/// (the token the agents' `[streams] gateway_token_file` holds).
#[derive(Clone)]
pub struct AgentConnector {
    tls: TlsConnector,
    token: Token,
}

impl std::fmt::Debug for AgentConnector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentConnector").finish_non_exhaustive()
    }
}

impl AgentConnector {
    pub fn new(tls: Arc<rustls::ClientConfig>, token: Token) -> Self {
        Self {
            tls: TlsConnector::from(tls),
            token,
        }
    }

    /// Opens one stream at the agent whose stream endpoint base is `agent_url` (from the
    /// manager's route), and waits for it to be ready, within [`OPEN_TIMEOUT`].
    pub async fn open(
        &self,
        agent_url: &str,
        open: &StreamOpen,
    ) -> Result<AgentStream, AgentError> {
        let target = Target::parse(agent_url)?;
        match tokio::time::timeout(OPEN_TIMEOUT, self.open_within(&target, open)).await {
            Ok(result) => result,
            Err(_) => Err(AgentError::Timeout {
                address: target.display,
            }),
        }
    }

    async fn open_within(
        &self,
        target: &Target,
        open: &StreamOpen,
    ) -> Result<AgentStream, AgentError> {
        let address = || target.display.clone();
        let tcp = match target.socket {
            Some(socket) => TcpStream::connect(socket).await,
            None => TcpStream::connect((target.host.as_str(), target.port)).await,
        }
        .map_err(|source| AgentError::Connect {
            address: address(),
            source,
        })?;
        let _ = tcp.set_nodelay(true);
        let tls = self
            .tls
            .connect(
                target.server_name.clone(),
                BufReader::with_capacity(TLS_READ_BUFFER, tcp),
            )
            .await
            .map_err(|source| AgentError::Tls {
                address: address(),
                source,
            })?;
        let mut request = target
            .url
            .as_str()
            .into_client_request()
            .map_err(|source| AgentError::Handshake {
                address: address(),
                source: Box::new(source),
            })?;
        let bearer =
            HeaderValue::from_str(&format!("Bearer {}", self.token.expose())).map_err(|_| {
                AgentError::Protocol {
                    address: address(),
                    detail: "the gateway token is not a valid header value".to_owned(),
                }
            })?;
        request.headers_mut().insert(AUTHORIZATION, bearer);
        let (ws, _response) =
            tokio_tungstenite::client_async_with_config(request, tls, Some(websocket_config()))
                .await
                .map_err(|source| AgentError::Handshake {
                    address: address(),
                    source: Box::new(source),
                })?;
        // The agent sends nothing before our `StreamOpen`, so tungstenite holds nothing unread.
        let (mut source, mut sink) = websocket::split(ws.into_inner(), Side::Client, MAX_MESSAGE);
        let broken = |source| AgentError::Broken {
            address: address(),
            source,
        };
        let json = serde_json::to_string(open).map_err(|e| AgentError::Protocol {
            address: address(),
            detail: e.to_string(),
        })?;
        sink.text(json).await.map_err(broken)?;
        sink.flush().await.map_err(broken)?;
        let bytes = match source.next().await {
            Ok(Incoming::Binary(bytes)) => bytes,
            Ok(Incoming::Close) | Err(MessageError::Ended) => {
                return Err(AgentError::ClosedEarly { address: address() });
            }
            Err(e) => return Err(broken(e)),
            Ok(Incoming::Text(_)) => {
                return Err(AgentError::Protocol {
                    address: address(),
                    detail: "a text message instead of Ready".to_owned(),
                });
            }
        };
        match Frame::decode(&bytes) {
            Ok(Frame::Ready) => Ok(AgentStream { source, sink }),
            Ok(Frame::Error(text)) => Err(AgentError::Refused(text)),
            Ok(other) => Err(AgentError::Protocol {
                address: address(),
                detail: format!("expected Ready, got {}", frame_name(&other)),
            }),
            Err(error) => Err(AgentError::Protocol {
                address: address(),
                detail: error.to_string(),
            }),
        }
    }
}

/// What a byte stream over an agent stream buffers each way ([`AgentStream::into_bytes`]).
pub const BYTE_BUFFER: usize = 64 * 1024;

/// What [`AgentStream::run_to_exit`] keeps of each output; the rest is dropped.
pub const OUTPUT_LIMIT: usize = 64 * 1024;

/// A finished command: its outputs (each cut at [`OUTPUT_LIMIT`]) and how it ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finished {
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub status: ExitStatus,
}

impl Finished {
    /// The exit code; `None` when a signal ended the command.
    pub fn code(&self) -> Option<u32> {
        match self.status {
            ExitStatus::Code { code } => Some(code),
            ExitStatus::Signal { .. } => None,
        }
    }
}

impl AgentStream {
    /// Runs an `Exec` stream to its end with nothing on its input: its outputs and exit.
    pub async fn run_to_exit(mut self) -> Result<Finished, AgentError> {
        let broken = |source| AgentError::Broken {
            address: "the agent".to_owned(),
            source,
        };
        self.sink
            .binary(Frame::Eof.encode())
            .await
            .map_err(broken)?;
        self.sink.flush().await.map_err(broken)?;
        let (mut stdout, mut stderr) = (Vec::new(), Vec::new());
        let keep = |into: &mut Vec<u8>, bytes: &[u8]| {
            let room = OUTPUT_LIMIT.saturating_sub(into.len());
            into.extend_from_slice(&bytes[..bytes.len().min(room)]);
        };
        loop {
            let message = match self.source.next().await {
                Ok(Incoming::Binary(message)) => message,
                Ok(Incoming::Text(_)) => continue,
                Ok(Incoming::Close) | Err(MessageError::Ended) => {
                    return Err(AgentError::ClosedEarly {
                        address: "the agent".to_owned(),
                    });
                }
                Err(error) => return Err(broken(error)),
            };
            match output_of(&message) {
                Some(Output::Stdout) => keep(&mut stdout, &message[1..]),
                Some(Output::Stderr) => keep(&mut stderr, &message[1..]),
                None => match Frame::decode(&message) {
                    Ok(Frame::Exit(status)) => {
                        let _ = self.sink.close().await;
                        return Ok(Finished {
                            stdout,
                            stderr,
                            status,
                        });
                    }
                    Ok(Frame::Error(text)) => return Err(AgentError::Refused(text)),
                    Ok(_) => {}
                    Err(error) => {
                        return Err(AgentError::Protocol {
                            address: "the agent".to_owned(),
                            detail: error.to_string(),
                        });
                    }
                },
            }
        }
    }

    /// The bytes of a `DirectTcpip` stream as one byte stream, for code that speaks a protocol
    /// over it (HTTP, WebSocket). Two tasks carry the bytes between the returned end and the
    /// agent through buffers of [`BYTE_BUFFER`] each way, so a fast sender waits for a slow
    /// receiver instead of filling memory. A shutdown of the returned end's writing sends the
    /// agent `Eof`; the agent's `Eof` (or a close) is the end of what it reads. Dropping it
    /// ends both tasks and the stream.
    pub fn into_bytes(self) -> AgentBytes {
        let (ours, theirs) = tokio::io::duplex(BYTE_BUFFER);
        let (mut from_local, mut to_local) = tokio::io::split(theirs);
        let AgentStream {
            mut source,
            mut sink,
        } = self;
        let dropped = CancellationToken::new();
        let inbound = async move {
            loop {
                let message = match source.next().await {
                    Ok(Incoming::Binary(message)) => message,
                    Ok(Incoming::Text(_)) => continue,
                    Ok(Incoming::Close) | Err(_) => break,
                };
                match output_of(&message) {
                    Some(Output::Stdout) => {
                        if to_local.write_all(&message[1..]).await.is_err() {
                            break;
                        }
                    }
                    Some(Output::Stderr) => {}
                    None => match Frame::decode(&message) {
                        Ok(Frame::Eof | Frame::Exit(_)) => break,
                        Ok(Frame::Error(text)) => {
                            tracing::debug!(%text, "The agent ended a byte stream.");
                            break;
                        }
                        _ => {}
                    },
                }
            }
            let _ = to_local.shutdown().await;
        };
        let outbound = async move {
            let mut buffer = vec![0u8; MAX_FRAME_PAYLOAD];
            loop {
                let read = match from_local.read(&mut buffer).await {
                    Ok(0) | Err(_) => break,
                    Ok(read) => read,
                };
                let message = data_message(&[&buffer[..read]]);
                if sink.binary(message).await.is_err() || sink.flush().await.is_err() {
                    return;
                }
            }
            let _ = sink.binary(Frame::Eof.encode()).await;
            let _ = sink.flush().await;
            // Wait for the agent to close (or the end to be dropped) with the sink held, so
            // the connection stays up while the peer's last bytes come in.
            std::future::pending::<()>().await;
        };
        let token = dropped.clone();
        tokio::spawn(async move {
            tokio::select! {
                () = token.cancelled() => {}
                () = async { tokio::join!(inbound, outbound); } => {}
            }
        });
        AgentBytes {
            inner: ours,
            _dropped: dropped.drop_guard(),
        }
    }
}

/// The byte stream of [`AgentStream::into_bytes`].
pub struct AgentBytes {
    inner: tokio::io::DuplexStream,
    _dropped: tokio_util::sync::DropGuard,
}

impl std::fmt::Debug for AgentBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentBytes").finish_non_exhaustive()
    }
}

/// A connection of hyper-util's pooled client (the manager's web apps).
impl hyper_util::client::legacy::connect::Connection for AgentBytes {
    fn connected(&self) -> hyper_util::client::legacy::connect::Connected {
        hyper_util::client::legacy::connect::Connected::new()
    }
}

impl AsyncRead for AgentBytes {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for AgentBytes {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Limits for the upgrade: a frame is at most one tag byte and [`MAX_FRAME_PAYLOAD`].
fn websocket_config() -> WebSocketConfig {
    WebSocketConfig::default()
        .max_message_size(Some(MAX_MESSAGE))
        .max_frame_size(Some(MAX_MESSAGE))
}

/// A frame's name for logs and protocol errors (never its payload).
pub fn frame_name(frame: &Frame) -> &'static str {
    match frame {
        Frame::Ready => "Ready",
        Frame::Data(_) => "Data",
        Frame::Stderr(_) => "Stderr",
        Frame::Eof => "Eof",
        Frame::Resize { .. } => "Resize",
        Frame::Signal(_) => "Signal",
        Frame::Exit(_) => "Exit",
        Frame::Error(_) => "Error",
    }
}

/// Where a stream goes: the endpoint URL, the TCP address and the TLS name.
#[derive(Debug, Clone)]
struct Target {
    url: Url,
    host: String,
    port: u16,
    socket: Option<SocketAddr>,
    server_name: ServerName<'static>,
    display: String,
}

impl Target {
    fn parse(agent_url: &str) -> Result<Self, AgentError> {
        let bad = || AgentError::BadUrl(agent_url.to_owned());
        let base = Url::parse(agent_url).map_err(|_| bad())?;
        if base.scheme() != "wss" {
            return Err(bad());
        }
        let port = base.port_or_known_default().ok_or_else(bad)?;
        let (host, socket, server_name) = match base.host().ok_or_else(bad)? {
            url::Host::Domain(domain) => {
                let name = ServerName::try_from(domain.to_owned()).map_err(|_| bad())?;
                (domain.to_owned(), None, name)
            }
            url::Host::Ipv4(ip) => (
                ip.to_string(),
                Some(SocketAddr::new(ip.into(), port)),
                ServerName::IpAddress(std::net::IpAddr::from(ip).into()),
            ),
            url::Host::Ipv6(ip) => (
                ip.to_string(),
                Some(SocketAddr::new(ip.into(), port)),
                ServerName::IpAddress(std::net::IpAddr::from(ip).into()),
            ),
        };
        let path = format!("{}{}", base.path().trim_end_matches('/'), STREAM_PATH);
        let mut url = base.clone();
        url.set_path(&path);
        url.set_query(None);
        url.set_fragment(None);
        Ok(Self {
            display: format!("{}:{port}", base.host_str().unwrap_or(&host)),
            url,
            host,
            port,
            socket,
            server_name,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_urls() {
        let target = Target::parse("wss://node1.example.org:8444").unwrap();
        assert_eq!(
            target.url.as_str(),
            "wss://node1.example.org:8444/v1/streams"
        );
        assert_eq!(target.port, 8444);
        assert!(target.socket.is_none());
        let target = Target::parse("wss://127.0.0.1:9000/").unwrap();
        assert_eq!(target.url.as_str(), "wss://127.0.0.1:9000/v1/streams");
        assert_eq!(target.socket, Some("127.0.0.1:9000".parse().unwrap()));
        let target = Target::parse("wss://[::1]").unwrap();
        assert_eq!(target.port, 443);
        assert_eq!(target.socket, Some("[::1]:443".parse().unwrap()));
        assert_eq!(target.display, "[::1]:443");
        for bad in ["ws://node1:8444", "https://node1", "node1:8444", "wss://"] {
            assert!(
                matches!(Target::parse(bad), Err(AgentError::BadUrl(_))),
                "{bad}"
            );
        }
    }
}
