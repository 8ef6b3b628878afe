//! The messages of a WebSocket whose HTTP upgrade is done: what the gateway and the agents
//! exchange on a stream (`ongrid_core::stream`).
//!
//! tungstenite does the upgrade on both ends (it checks every header); after it, the connection
//! goes to [`split`], whose halves read and write frames with `fastwebsockets`. tungstenite
//! copies every frame it sends into its own write buffer, then moves what the TLS layer did not
//! take yet to the front of that buffer, and zero-fills its read buffer before each read: a
//! quarter of the agent's CPU under a bulk transfer. Here a frame's header and payload go to TLS
//! in one vectored write, a payload is read into its own buffer and handed on without a copy,
//! and a client masks its payload in place.
//!
//! The upgrade must leave nothing unread: neither side sends a message before the other's
//! upgrade ended (the gateway waits for the `101`, the agent for the gateway's first message),
//! so the stream handed over holds no frame tungstenite already read.
//!
//! Only what the stream protocol uses is supported: whole binary and text messages (a
//! fragmented one is refused), and the close. Pings and pongs are skipped: neither side sends
//! them.
//!
//! A read or write dropped before it finished (a `select!` that took another branch) leaves its
//! frame half read or half written, which fastwebsockets cannot resume. The half remembers it:
//! every later read or write is refused ([`MessageError::Interrupted`]), the close included (it
//! would land inside the cut frame): the owner then drops the connection, and the peer sees it
//! end instead of reading garbage.

use bytes::Bytes;
use fastwebsockets::{OpCode, Payload, Role, WebSocketError, WebSocketRead, WebSocketWrite};
use tokio::io::{AsyncRead, AsyncWrite, ReadHalf, WriteHalf};

/// Which end of the upgrade this is: a client masks what it sends, a server refuses what was
/// not masked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Client,
    Server,
}

/// One message read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Incoming {
    Binary(Bytes),
    Text(String),
    /// The peer's close: nothing follows it.
    Close,
}

#[derive(Debug, thiserror::Error)]
pub enum MessageError {
    #[error("the connection ended without a close")]
    Ended,
    #[error("an earlier read or write was cut off in the middle of a frame")]
    Interrupted,
    #[error("a message over the limit of {limit} bytes")]
    TooLarge { limit: usize },
    #[error("a frame masked by a server or unmasked by a client (RFC 6455, section 5.1)")]
    Masking,
    #[error("a fragmented message (the stream protocol sends every message whole)")]
    Fragmented,
    #[error("a text message that is not UTF-8")]
    NotUtf8,
    #[error("the close was already sent")]
    Closed,
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Protocol(String),
}

impl From<WebSocketError> for MessageError {
    fn from(error: WebSocketError) -> Self {
        match error {
            WebSocketError::UnexpectedEOF => Self::Ended,
            WebSocketError::IoError(e) => Self::Io(e),
            WebSocketError::ConnectionClosed => Self::Closed,
            WebSocketError::InvalidUTF8 => Self::NotUtf8,
            other => Self::Protocol(other.to_string()),
        }
    }
}

/// The reading half of a connection after its upgrade.
pub struct MessageReader<S> {
    frames: WebSocketRead<ReadHalf<S>>,
    side: Side,
    limit: usize,
    /// A read was under way and was dropped.
    cut: bool,
}

/// The writing half of a connection after its upgrade.
pub struct MessageWriter<S> {
    frames: WebSocketWrite<WriteHalf<S>>,
    /// A write was under way and was dropped.
    cut: bool,
}

impl<S> std::fmt::Debug for MessageReader<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MessageReader")
            .field("limit", &self.limit)
            .finish_non_exhaustive()
    }
}

impl<S> std::fmt::Debug for MessageWriter<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MessageWriter").finish_non_exhaustive()
    }
}

/// The two halves of `stream`, whose upgrade is done; messages of more than `limit` bytes are
/// refused when read.
pub fn split<S>(stream: S, side: Side, limit: usize) -> (MessageReader<S>, MessageWriter<S>)
where
    S: AsyncRead + AsyncWrite,
{
    let role = match side {
        Side::Client => Role::Client,
        Side::Server => Role::Server,
    };
    let (read, write) = tokio::io::split(stream);
    let (mut reader, writer) = fastwebsockets::after_handshake_split(read, write, role);
    // Both are answered here rather than by the reader, which cannot write.
    reader.set_auto_close(false);
    reader.set_auto_pong(false);
    // fastwebsockets refuses a frame of `max` bytes or more.
    reader.set_max_message_size(limit.saturating_add(1));
    (
        MessageReader {
            frames: reader,
            side,
            limit,
            cut: false,
        },
        MessageWriter {
            frames: writer,
            cut: false,
        },
    )
}

impl<S: AsyncRead + AsyncWrite> MessageReader<S> {
    /// The next message; pings and pongs are skipped.
    pub async fn next(&mut self) -> Result<Incoming, MessageError> {
        if self.cut {
            return Err(MessageError::Interrupted);
        }
        self.cut = true;
        let next = self.read().await;
        self.cut = false;
        next
    }

    async fn read(&mut self) -> Result<Incoming, MessageError> {
        let limit = self.limit;
        loop {
            // Nothing is ever owed to the peer (no automatic pong or close).
            let mut frame = self
                .frames
                .read_frame(&mut |_| async { Ok::<(), std::io::Error>(()) })
                .await
                .map_err(|e| match e {
                    WebSocketError::FrameTooLarge => MessageError::TooLarge { limit },
                    other => other.into(),
                })?;
            if !frame.fin {
                return Err(MessageError::Fragmented);
            }
            // fastwebsockets does not refuse a frame masked the wrong way, nor say whether it
            // was masked but in the header it formats for it.
            let mut head = [0_u8; 14];
            frame.fmt_head(&mut head);
            if (head[1] & 0x80 != 0) != (self.side == Side::Server) {
                return Err(MessageError::Masking);
            }
            let payload = match frame.payload {
                Payload::Bytes(bytes) => bytes.freeze(),
                other => Bytes::from(Vec::from(other)),
            };
            return Ok(match frame.opcode {
                OpCode::Binary => Incoming::Binary(payload),
                OpCode::Text => match String::from_utf8(payload.into()) {
                    Ok(text) => Incoming::Text(text),
                    Err(_) => return Err(MessageError::NotUtf8),
                },
                OpCode::Close => Incoming::Close,
                OpCode::Ping | OpCode::Pong => continue,
                OpCode::Continuation => return Err(MessageError::Fragmented),
            });
        }
    }
}

impl<S: AsyncRead + AsyncWrite> MessageWriter<S> {
    /// Sends one binary message (a client masks it in place).
    pub async fn binary(&mut self, message: Vec<u8>) -> Result<(), MessageError> {
        self.write(fastwebsockets::Frame::binary(Payload::Owned(message)))
            .await
    }

    pub async fn text(&mut self, text: String) -> Result<(), MessageError> {
        self.write(fastwebsockets::Frame::text(Payload::Owned(
            text.into_bytes(),
        )))
        .await
    }

    async fn write(&mut self, frame: fastwebsockets::Frame<'_>) -> Result<(), MessageError> {
        if self.cut {
            return Err(MessageError::Interrupted);
        }
        self.cut = true;
        self.frames.write_frame(frame).await?;
        self.cut = false;
        Ok(())
    }

    /// Sends the close (normal closure) and pushes out everything written; a second close does
    /// nothing. After a cut-off write it is refused like any write: drop the connection then.
    pub async fn close(&mut self) -> Result<(), MessageError> {
        if !self.frames.is_closed() {
            self.write(fastwebsockets::Frame::close(1000, b"")).await?;
        }
        self.flush().await
    }

    /// Pushes out what the layers below still hold (each message is handed to them at once).
    pub async fn flush(&mut self) -> Result<(), MessageError> {
        Ok(self.frames.flush().await?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{duplex, AsyncReadExt, AsyncWriteExt, DuplexStream};

    const LIMIT: usize = 64 * 1024 + 1;

    type Halves = (MessageReader<DuplexStream>, MessageWriter<DuplexStream>);

    fn pair() -> (Halves, Halves) {
        let (a, b) = duplex(256 * 1024);
        (split(a, Side::Client, LIMIT), split(b, Side::Server, LIMIT))
    }

    #[tokio::test]
    async fn messages_cross_both_ways_whole_and_in_order() {
        let ((mut client_in, mut client_out), (mut server_in, mut server_out)) = pair();
        let big: Vec<u8> = (0..LIMIT).map(|i| (i % 251) as u8).collect();
        client_out.text("{\"open\":1}".into()).await.unwrap();
        client_out.binary(big.clone()).await.unwrap();
        client_out.binary(vec![1]).await.unwrap();
        assert_eq!(
            server_in.next().await.unwrap(),
            Incoming::Text("{\"open\":1}".into())
        );
        assert_eq!(
            server_in.next().await.unwrap(),
            Incoming::Binary(big.into())
        );
        assert_eq!(
            server_in.next().await.unwrap(),
            Incoming::Binary(vec![1].into())
        );
        server_out.binary(vec![0; 300]).await.unwrap();
        server_out.close().await.unwrap();
        assert_eq!(
            client_in.next().await.unwrap(),
            Incoming::Binary(vec![0; 300].into())
        );
        assert_eq!(client_in.next().await.unwrap(), Incoming::Close);
        assert!(matches!(
            server_out.binary(vec![2]).await,
            Err(MessageError::Closed)
        ));
    }

    /// What goes on the wire is RFC 6455: a client's frames masked, a server's not.
    #[tokio::test]
    async fn a_client_masks_and_a_server_does_not() {
        let (client, mut wire) = duplex(4096);
        let (_, mut out) = split(client, Side::Client, LIMIT);
        out.binary(b"abc".to_vec()).await.unwrap();
        let mut frame = [0_u8; 9];
        wire.read_exact(&mut frame).await.unwrap();
        assert_eq!(frame[0], 0x82, "FIN and the binary opcode");
        assert_eq!(frame[1], 0x80 | 3, "masked, 3 bytes");
        let mask = &frame[2..6];
        let payload: Vec<u8> = frame[6..]
            .iter()
            .zip(mask.iter().cycle())
            .map(|(b, m)| b ^ m)
            .collect();
        assert_eq!(payload, b"abc");

        let (server, mut wire) = duplex(4096);
        let (_, mut out) = split(server, Side::Server, LIMIT);
        out.binary(b"abc".to_vec()).await.unwrap();
        let mut frame = [0_u8; 5];
        wire.read_exact(&mut frame).await.unwrap();
        assert_eq!(frame, [0x82, 3, b'a', b'b', b'c']);
    }

    #[tokio::test]
    async fn a_server_refuses_unmasked_frames_and_both_refuse_what_the_protocol_never_sends() {
        // Unmasked, to a server.
        let (server, mut wire) = duplex(4096);
        let (mut reader, _) = split(server, Side::Server, LIMIT);
        wire.write_all(&[0x82, 1, 7]).await.unwrap();
        assert!(matches!(reader.next().await, Err(MessageError::Masking)));
        // Masked, to a client.
        let (client, mut wire) = duplex(4096);
        let (mut reader, _) = split(client, Side::Client, LIMIT);
        wire.write_all(&[0x82, 0x81, 1, 2, 3, 4, 7]).await.unwrap();
        assert!(matches!(reader.next().await, Err(MessageError::Masking)));

        // A fragment, a message over the limit, and pings skipped.
        let (client, mut wire) = duplex(1 << 20);
        let (mut reader, _) = split(client, Side::Client, 10);
        wire.write_all(&[0x89, 0, 0x82, 1, 5]).await.unwrap();
        assert_eq!(
            reader.next().await.unwrap(),
            Incoming::Binary(vec![5].into())
        );
        wire.write_all(&[0x02, 1, 5]).await.unwrap();
        assert!(matches!(reader.next().await, Err(MessageError::Fragmented)));

        let (client, mut wire) = duplex(1 << 20);
        let (mut reader, _) = split(client, Side::Client, 10);
        wire.write_all(&[0x82, 11]).await.unwrap();
        wire.write_all(&[0; 11]).await.unwrap();
        assert!(matches!(
            reader.next().await,
            Err(MessageError::TooLarge { limit: 10 })
        ));

        // A write dropped in the middle of its frame: nothing more goes out, not even the close.
        let (client, mut wire) = duplex(1024);
        let (_, mut out) = split(client, Side::Client, LIMIT);
        let cut = tokio::time::timeout(
            std::time::Duration::from_millis(50),
            out.binary(vec![7; 4096]),
        )
        .await;
        assert!(cut.is_err(), "the duplex holds 1 KiB: the write waits");
        assert!(matches!(
            out.binary(vec![1]).await,
            Err(MessageError::Interrupted)
        ));
        assert!(matches!(out.close().await, Err(MessageError::Interrupted)));
        drop(out);
        let mut sent = Vec::new();
        wire.read_to_end(&mut sent).await.unwrap();
        assert_eq!(sent.len(), 1024, "only the cut frame's first KiB went out");

        // A read dropped after the header: the next read is refused rather than taking the
        // payload for a header.
        let (client, mut wire) = duplex(1 << 20);
        let (mut reader, _) = split(client, Side::Client, LIMIT);
        wire.write_all(&[0x82, 126, 0x10, 0x00, 1, 2, 3])
            .await
            .unwrap();
        let cut = tokio::time::timeout(std::time::Duration::from_millis(50), reader.next()).await;
        assert!(cut.is_err(), "4096 bytes announced, 3 sent: the read waits");
        wire.write_all(&[0x82, 1, 9]).await.unwrap();
        assert!(matches!(
            reader.next().await,
            Err(MessageError::Interrupted)
        ));

        // The connection ends in the middle of a message.
        let (client, mut wire) = duplex(1 << 20);
        let (mut reader, _) = split(client, Side::Client, LIMIT);
        wire.write_all(&[0x82, 5, 1, 2]).await.unwrap();
        drop(wire);
        assert!(matches!(reader.next().await, Err(MessageError::Ended)));
    }
}
