//! `direct-tcpip`: a TCP connection to a server listening inside the session's container, on
//! its own loopback (`ssh -L 8888:localhost:8888`, VS Code's forwarded ports). Only loopback
//! destinations are allowed; the connection is made from inside the container's network
//! namespace ([`host::connect_in_netns`]), so it reaches exactly what the container's own
//! processes reach at `localhost`, and nothing of the node or the site's network.
//!
//! Frames: `Ready` once connected; then `Data` both ways; the gateway's `Eof` half-closes the
//! connection; the agent sends `Eof` when the server closes its side. The stream closes once both
//! sides have sent EOF, or with an `Error` when the connection breaks. There is no `Exit`.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::time::Duration;

use ongrid_core::network::normalize_ip;
use ongrid_core::stream::Frame;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info};

use super::exec::SHUTTING_DOWN;
use super::{host, send_chunked, FrameChannel};
use crate::runtime::SessionContainer;

/// How long connecting inside the container may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Bytes read from the server at a time.
const READ_BUFFER: usize = 32 * 1024;

/// The addresses a forwarding destination stands for, or why it is refused: only the
/// container's loopback (`localhost`, 127.0.0.0/8, ::1) can be reached.
pub fn destination(host: &str) -> Result<Vec<IpAddr>, String> {
    let refused = || {
        format!("only destinations inside the container (localhost) can be forwarded, not {host}")
    };
    if host.eq_ignore_ascii_case("localhost") {
        return Ok(vec![
            IpAddr::V4(Ipv4Addr::LOCALHOST),
            IpAddr::V6(Ipv6Addr::LOCALHOST),
        ]);
    }
    let bare = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    let address: IpAddr = bare.parse().map_err(|_| refused())?;
    match normalize_ip(address) {
        IpAddr::V4(v4) if v4.is_loopback() => Ok(vec![IpAddr::V4(v4)]),
        IpAddr::V6(v6) if v6 == Ipv6Addr::LOCALHOST => Ok(vec![IpAddr::V6(v6)]),
        _ => Err(refused()),
    }
}

/// Serves a `DirectTcpip` stream to its end.
pub async fn serve(
    container: SessionContainer,
    host: String,
    port: u16,
    channel: FrameChannel,
    shutdown: CancellationToken,
) {
    let FrameChannel { incoming, outgoing } = channel;
    let session = &container.session_name;
    let addresses = match destination(&host) {
        Ok(addresses) => addresses,
        Err(message) => {
            let _ = outgoing.send(Frame::Error(message)).await;
            return;
        }
    };
    let Some(pid) = container.pid else {
        let message = format!("session {session} is not running: its container has no process");
        let _ = outgoing.send(Frame::Error(message)).await;
        return;
    };
    let connect = host::connect_in_netns(pid, addresses, port, CONNECT_TIMEOUT);
    let stream = tokio::select! {
        stream = connect => stream,
        () = shutdown.cancelled() => {
            let _ = outgoing.send(Frame::Error(SHUTTING_DOWN.to_owned())).await;
            return;
        }
    };
    let stream = match stream {
        Ok(stream) => stream,
        Err(e) => {
            let message = match e.kind() {
                std::io::ErrorKind::ConnectionRefused => {
                    format!("nothing listens on {host}:{port} inside session {session}")
                }
                std::io::ErrorKind::TimedOut => format!(
                    "connecting to {host}:{port} inside session {session} timed out after {} s",
                    CONNECT_TIMEOUT.as_secs()
                ),
                _ => format!("cannot connect to {host}:{port} inside session {session}: {e}"),
            };
            debug!(session = %container.session_id, ?host, port, error = %e, "Forward refused.");
            let _ = outgoing.send(Frame::Error(message)).await;
            return;
        }
    };
    if outgoing.send(Frame::Ready).await.is_err() {
        return;
    }
    info!(session = %container.session_id, ?host, port, "Forwarded connection opened.");
    let (reader, writer) = stream.into_split();
    let outcome = pump(reader, writer, incoming, &outgoing, &shutdown).await;
    if let Err(message) = outcome {
        let message = format!("the connection to {host}:{port} inside session {session} {message}");
        let _ = outgoing.send(Frame::Error(message)).await;
    }
    debug!(session = %container.session_id, ?host, port, "Forwarded connection closed.");
}

/// Moves bytes both ways until both sides have sent EOF (`Ok`), the gateway is gone (`Ok`), or
/// the connection breaks (`Err`, the end of a sentence for the user).
async fn pump(
    mut reader: OwnedReadHalf,
    mut writer: OwnedWriteHalf,
    mut incoming: mpsc::Receiver<Frame>,
    outgoing: &mpsc::Sender<Frame>,
    shutdown: &CancellationToken,
) -> Result<(), String> {
    let (client_eof, mut client_eof_seen) = oneshot::channel();
    let upstream = async move {
        let mut client_eof = Some(client_eof);
        while let Some(frame) = incoming.recv().await {
            match frame {
                Frame::Data(bytes) if client_eof.is_some() => {
                    writer
                        .write_all(&bytes)
                        .await
                        .map_err(|e| format!("broke: {e}"))?;
                }
                Frame::Eof => {
                    if let Some(eof) = client_eof.take() {
                        let _ = writer.shutdown().await;
                        let _ = eof.send(());
                    }
                }
                _ => {}
            }
        }
        Ok::<(), String>(())
    };
    let downstream = async move {
        let mut buffer = vec![0; READ_BUFFER];
        loop {
            let n = reader
                .read(&mut buffer)
                .await
                .map_err(|e| format!("broke: {e}"))?;
            if n == 0 {
                return Ok(outgoing.send(Frame::Eof).await.is_ok());
            }
            if send_chunked(outgoing, &buffer[..n], Frame::Data)
                .await
                .is_err()
            {
                return Ok(false);
            }
        }
    };
    tokio::pin!(upstream, downstream);
    let (mut server_done, mut client_done) = (false, false);
    loop {
        tokio::select! {
            biased;
            // The gateway is gone (or writing to the server failed): nothing more to do.
            result = &mut upstream => return result,
            result = &mut downstream, if !server_done => match result {
                Ok(true) => server_done = true,
                Ok(false) => return Ok(()),
                Err(message) => return Err(message),
            },
            seen = &mut client_eof_seen, if !client_done => {
                if seen.is_ok() {
                    client_done = true;
                }
            }
            () = shutdown.cancelled() => {
                let _ = outgoing.send(Frame::Error(SHUTTING_DOWN.to_owned())).await;
                return Ok(());
            }
        }
        if server_done && client_done {
            return Ok(());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_containers_loopback_is_a_destination() {
        let v4 = |s: &str| IpAddr::V4(s.parse().unwrap());
        assert_eq!(
            destination("localhost").unwrap(),
            vec![v4("127.0.0.1"), IpAddr::V6(Ipv6Addr::LOCALHOST)]
        );
        assert_eq!(destination("LocalHost").unwrap().len(), 2);
        assert_eq!(destination("127.0.0.1").unwrap(), vec![v4("127.0.0.1")]);
        assert_eq!(destination("127.3.2.1").unwrap(), vec![v4("127.3.2.1")]);
        assert_eq!(
            destination("::1").unwrap(),
            vec![IpAddr::V6(Ipv6Addr::LOCALHOST)]
        );
        assert_eq!(
            destination("[::1]").unwrap(),
            vec![IpAddr::V6(Ipv6Addr::LOCALHOST)]
        );
        assert_eq!(
            destination("::ffff:127.0.0.1").unwrap(),
            vec![v4("127.0.0.1")]
        );
        for outside in [
            "10.0.0.1",
            "0.0.0.0",
            "172.17.0.1",
            "192.168.1.10",
            "::",
            "fe80::1",
            "example.org",
            "localhost.example.org",
            "metadata.google.internal",
            "169.254.169.254",
            "",
        ] {
            let message = destination(outside).unwrap_err();
            assert!(
                message.starts_with(
                    "only destinations inside the container (localhost) can be forwarded"
                ),
                "{outside}: {message}"
            );
        }
    }
}
