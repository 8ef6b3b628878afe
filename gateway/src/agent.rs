//! The gateway's side of the stream protocol (`core/src/stream.rs`): one WebSocket over TLS to
//! the node agent per SSH channel. [`AgentConnector::open`] dials `wss://<agent>/v1/streams`
//! with the gateway's token, sends the [`StreamOpen`] and waits for the agent's
//! [`Frame::Ready`]; an agent's [`Frame::Error`] comes back as [`AgentError::Refused`], whose
//! text is for the user.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use ongrid_core::stream::{Frame, StreamOpen, MAX_FRAME_PAYLOAD, STREAM_PATH, TLS_READ_BUFFER};
use ongrid_service::websocket::{self, Incoming, MessageError, MessageReader, MessageWriter, Side};
use rustls::pki_types::ServerName;
use tokio::io::BufReader;
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_rustls::TlsConnector;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::http::header::AUTHORIZATION;
use tokio_tungstenite::tungstenite::http::HeaderValue;
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use url::Url;

use crate::config::Token;

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

/// Opens streams to agents: TLS trusting the `ca_dir` CAs, the gateway's token as Bearer.
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
                return Err(AgentError::ClosedEarly { address: address() })
            }
            Err(e) => return Err(broken(e)),
            Ok(Incoming::Text(_)) => {
                return Err(AgentError::Protocol {
                    address: address(),
                    detail: "a text message instead of Ready".to_owned(),
                })
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
