//! The accept loop: for every TCP connection, the PROXY protocol header when the peer is a
//! trusted load balancer, then the allowlist check on the client's address, then the cap on
//! connections not logged in yet (`startups.rs`; a refused connection is closed before the
//! gateway sends a single SSH byte, and logged with the address), then the SSH connection
//! (`connection.rs`) in its own tracked task.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use ongrid_core::normalize_ip;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};
use tokio_util::task::TaskTracker;

use crate::allowlist::Verdict;
use crate::connection::{self, Peer};
use crate::metrics::{self, Refused};
use crate::proxy_protocol::{self, Header, SignatureGuard};
use crate::services::Services;

/// How long a trusted load balancer has to send its PROXY header.
pub const PROXY_HEADER_TIMEOUT: Duration = Duration::from_secs(5);

/// Accepts connections until `shutdown`; each one runs in a task of `tracker`.
pub async fn serve(
    listener: TcpListener,
    services: Arc<Services>,
    tracker: TaskTracker,
    shutdown: CancellationToken,
) {
    loop {
        let accepted = tokio::select! {
            () = shutdown.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((tcp, peer)) => {
                tracker.spawn(accept(tcp, peer, services.clone(), shutdown.clone()));
            }
            Err(error) => {
                // Out of file descriptors and the like: pause instead of spinning.
                tracing::warn!(%error, "Accepting a connection failed.");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

async fn accept(
    mut tcp: TcpStream,
    peer: SocketAddr,
    services: Arc<Services>,
    shutdown: CancellationToken,
) {
    let _ = tcp.set_nodelay(true);
    let peer = SocketAddr::new(normalize_ip(peer.ip()), peer.port());
    let balancer = services
        .proxy_protocol
        .as_ref()
        .is_some_and(|proxy| proxy.trusts(peer.ip()));
    // The client's address, and whether to check it now (not for a balancer's health check).
    let (source, check_now) = if balancer {
        match tokio::time::timeout(PROXY_HEADER_TIMEOUT, proxy_protocol::read_header(&mut tcp))
            .await
        {
            Ok(Ok(Header::Proxy { source, .. })) => (
                SocketAddr::new(normalize_ip(source.ip()), source.port()),
                true,
            ),
            Ok(Ok(Header::Local)) => (peer, false),
            Ok(Err(error)) => {
                tracing::warn!(balancer = %peer, error = format!("{:#}", anyhow::Error::from(error)), "Connection refused: a trusted load balancer must send a PROXY protocol v2 header.");
                metrics::events().refused(Refused::ProxyProtocol);
                return;
            }
            Err(_) => {
                tracing::warn!(balancer = %peer, "Connection refused: the load balancer sent no PROXY protocol header in time.");
                metrics::events().refused(Refused::ProxyProtocol);
                return;
            }
        }
    } else {
        (peer, true)
    };
    if check_now {
        match services.allowlist.check(source.ip()) {
            Verdict::Allowed(_) => {}
            Verdict::Refused => {
                tracing::warn!(source = %source.ip(), port = source.port(), via = ?balancer.then_some(peer), "Connection refused: the address is in no institute's allowlist.");
                metrics::events().refused(Refused::Allowlist);
                return;
            }
            Verdict::NotLoaded => {
                tracing::warn!(source = %source.ip(), port = source.port(), "Connection refused: no allowlist fetched from the manager yet.");
                metrics::events().refused(Refused::Allowlist);
                return;
            }
        }
    }
    let startup = match services.startups.admit(source.ip()) {
        Ok(permit) => permit,
        Err(refusal) => {
            tracing::warn!(source = %source.ip(), port = source.port(), %refusal, "Connection refused: too many connections not logged in yet.");
            metrics::events().refused(Refused::Startups);
            return;
        }
    };
    let kill = CancellationToken::new();
    let proxy_header_seen = Arc::new(AtomicBool::new(false));
    let stream = ClientStream::new(
        tcp,
        (!balancer).then(SignatureGuard::default),
        proxy_header_seen.clone(),
        kill.clone(),
    );
    let open = metrics::events().connection();
    connection::serve(stream, Peer { source }, startup, kill, services, shutdown).await;
    drop(open);
    if proxy_header_seen.load(Ordering::Relaxed) {
        tracing::warn!(source = %source.ip(), "Connection refused: it sent a PROXY protocol header but is not a trusted load balancer.");
        metrics::events().refused(Refused::ProxyProtocol);
    }
}

/// The client's TCP stream as russh sees it: reads fail once `kill` is cancelled (so a stuck
/// session can always be cut), and, for peers not trusted to send one, a PROXY protocol
/// signature at the start fails the stream instead of being taken for SSH.
pub struct ClientStream {
    tcp: TcpStream,
    guard: Option<SignatureGuard>,
    proxy_header_seen: Arc<AtomicBool>,
    killed: Pin<Box<WaitForCancellationFutureOwned>>,
}

impl ClientStream {
    pub fn new(
        tcp: TcpStream,
        guard: Option<SignatureGuard>,
        proxy_header_seen: Arc<AtomicBool>,
        kill: CancellationToken,
    ) -> Self {
        Self {
            tcp,
            guard,
            proxy_header_seen,
            killed: Box::pin(kill.cancelled_owned()),
        }
    }
}

impl ClientStream {
    /// An error once the gateway cut this connection (and a wake-up when it does).
    fn check_killed(&mut self, cx: &mut Context<'_>) -> io::Result<()> {
        if self.killed.as_mut().poll(cx).is_ready() {
            return Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "connection closed by the gateway",
            ));
        }
        Ok(())
    }
}

impl AsyncRead for ClientStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        this.check_killed(cx)?;
        let before = buf.filled().len();
        ready!(Pin::new(&mut this.tcp).poll_read(cx, buf))?;
        if let Some(guard) = &mut this.guard {
            match guard.feed(&buf.filled()[before..]) {
                Some(true) => {
                    this.proxy_header_seen.store(true, Ordering::Relaxed);
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        "PROXY protocol header from a peer that is not a trusted load balancer",
                    )));
                }
                Some(false) => this.guard = None,
                None => {}
            }
        }
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for ClientStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        this.check_killed(cx)?;
        Pin::new(&mut this.tcp).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        this.check_killed(cx)?;
        Pin::new(&mut this.tcp).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().tcp).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        this.check_killed(cx)?;
        Pin::new(&mut this.tcp).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.tcp.is_write_vectored()
    }
}
