//! The accept loop: TCP → TLS (rustls) → peer certificate → [`Peer`] → HTTP/1.1 or HTTP/2
//! (hyper-util's auto builder) serving the axum router. The shape follows axum's
//! `low-level-rustls` example, with the peer's identity added to every request.
//!
//! Every connection runs in a task of the [`TaskTracker`]; when the [`CancellationToken`] fires,
//! the loop stops accepting and each connection finishes its in-flight requests and closes.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::Request;
use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use rustls::pki_types::UnixTime;
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tower::ServiceExt;

use crate::grid_identity::ClientAuthenticator;
use crate::grid_identity::Peer;

/// A client that has not finished the TLS handshake by then is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(15);

/// Everything a connection task needs.
#[derive(Clone)]
pub struct Server {
    pub acceptor: TlsAcceptor,
    pub authenticator: Arc<dyn ClientAuthenticator>,
    pub router: Router,
}

impl Server {
    /// Accepts connections until `shutdown`; connection tasks go into `tracker`.
    pub async fn serve(
        self,
        listener: TcpListener,
        tracker: TaskTracker,
        shutdown: CancellationToken,
    ) {
        loop {
            let accepted = tokio::select! {
                () = shutdown.cancelled() => break,
                accepted = listener.accept() => accepted,
            };
            match accepted {
                Ok((tcp, addr)) => {
                    let server = self.clone();
                    tracker.spawn(server.connection(tcp, addr, shutdown.clone()));
                }
                Err(error) => {
                    // Usually out of file descriptors: give the running connections a moment.
                    tracing::warn!(%error, "Accepting a connection failed.");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    }

    async fn connection(self, tcp: TcpStream, addr: SocketAddr, shutdown: CancellationToken) {
        let stream = match tokio::time::timeout(HANDSHAKE_TIMEOUT, self.acceptor.accept(tcp)).await
        {
            Ok(Ok(stream)) => stream,
            Ok(Err(error)) => {
                tracing::debug!(peer = %addr, %error, "TLS handshake failed.");
                return;
            }
            Err(_) => {
                tracing::debug!(peer = %addr, "TLS handshake timed out.");
                return;
            }
        };
        let identity = match stream.get_ref().1.peer_certificates() {
            None | Some([]) => None,
            // The verifier accepted this chain during the handshake; this names its subject.
            Some(chain) => match self.authenticator.authenticate(chain, UnixTime::now()) {
                Ok(identity) => Some(identity),
                Err(error) => {
                    tracing::debug!(peer = %addr, %error, "Client certificate refused after the handshake.");
                    return;
                }
            },
        };
        let peer = Peer { addr, identity };
        let router = self.router;
        let service = hyper::service::service_fn(move |mut request: Request<Incoming>| {
            request.extensions_mut().insert(peer.clone());
            router.clone().oneshot(request)
        });
        let builder = auto::Builder::new(TokioExecutor::new());
        // With upgrades: sessions' web apps relay WebSockets (`dashboard::apps`).
        let connection = builder.serve_connection_with_upgrades(TokioIo::new(stream), service);
        tokio::pin!(connection);
        let result = tokio::select! {
            result = connection.as_mut() => result,
            () = shutdown.cancelled() => {
                connection.as_mut().graceful_shutdown();
                connection.as_mut().await
            }
        };
        if let Err(error) = result {
            tracing::debug!(peer = %addr, %error, "Connection ended with an error.");
        }
    }
}
