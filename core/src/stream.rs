//! The stream protocol between the SSH gateway and a node agent: one WebSocket over TLS per SSH
//! channel, so flow control is per channel. Modelled on Kubernetes' exec/port-forward streams.
//!
//! The gateway connects to the agent's `wss://<agent>/v1/streams` with
//! `Authorization: Bearer <gateway token>` and sends one text message, the JSON [`StreamOpen`].
//! The agent answers with a [`Frame::Ready`] once the process (or TCP connection) is up, or an
//! [`Frame::Error`] and a close. After that both sides send binary messages, each one [`Frame`]:
//! a tag byte and a payload. Gateway → agent: `Data` (stdin / bytes to the TCP peer), `Eof`,
//! `Resize`, `Signal`. Agent → gateway: `Data` (stdout / bytes from the TCP peer), `Stderr`,
//! `Eof` (stdout ended), then `Exit` once, then the agent closes the WebSocket. A
//! `DirectTcpip` stream has no `Exit`: it ends when both sides have sent `Eof`. The gateway keeps
//! SSH's order — data, exit-status, EOF, close — by holding the agent's `Eof` until `Exit`.

use serde::{Deserialize, Serialize};

use crate::names::{Dn, SessionId};

/// The path of the agent's stream endpoint.
pub const STREAM_PATH: &str = "/v1/streams";

/// The largest payload of one frame; senders split larger writes.
pub const MAX_FRAME_PAYLOAD: usize = 64 * 1024;

/// What TLS reads of a stream's connection go through, on both ends: rustls asks its socket
/// for at most 4 KiB at a time, so without this buffer a stream's bulk bytes cost a system call
/// per 4 KiB (two TLS records of 16 KiB fit).
pub const TLS_READ_BUFFER: usize = 32 * 1024;

/// What the gateway asks for on one SSH channel.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamOpen {
    pub session_id: SessionId,
    /// The owner the gateway authenticated; the agent refuses a container of anyone else.
    pub owner: Dn,
    pub kind: StreamKind,
    /// Environment from the client's `env` requests, already filtered by the gateway's
    /// allow-list (LANG, LC_*, TERM).
    #[serde(default)]
    pub env: Vec<(String, String)>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum StreamKind {
    /// The user's login shell.
    Shell { pty: Option<Pty> },
    /// A command run by the user's shell (`sh -c` semantics, as sshd does).
    Exec { command: String, pty: Option<Pty> },
    /// An SSH subsystem; only `sftp` exists.
    Subsystem { name: String },
    /// A TCP connection made inside the container's network namespace.
    DirectTcpip { host: String, port: u16 },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pty {
    pub term: String,
    pub cols: u32,
    pub rows: u32,
}

/// How the process ended, as SSH's `exit-status` or `exit-signal` carries it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "by", rename_all = "snake_case")]
pub enum ExitStatus {
    Code {
        code: u32,
    },
    /// `signal` without the `SIG` prefix, as SSH names signals (`TERM`, `KILL`, `INT`).
    Signal {
        signal: String,
        core_dumped: bool,
    },
}

/// One binary message of an open stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    Ready,
    Data(Vec<u8>),
    Stderr(Vec<u8>),
    Eof,
    Resize {
        cols: u32,
        rows: u32,
    },
    /// A signal name without `SIG` (`INT`, `TERM`, `HUP`, ...).
    Signal(String),
    Exit(ExitStatus),
    /// Something went wrong; the text is for the user. The stream closes after it.
    Error(String),
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("empty stream frame")]
    Empty,
    #[error("unknown stream frame tag {0:#04x}")]
    UnknownTag(u8),
    #[error("stream frame {0} has a malformed payload")]
    Malformed(&'static str),
}

/// Which output a `Data` or `Stderr` message carries (see [`output_of`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Output {
    /// `Data`: stdout, everything with a terminal, or a forward's bytes.
    Stdout,
    Stderr,
}

/// For a binary message that is a `Data` or `Stderr` frame: which; its payload is
/// `message[1..]`. Lets a receiver pass a bulk payload on without copying it out of the
/// message, as [`Frame::decode`] must. `None` for any other frame (decode those).
pub fn output_of(message: &[u8]) -> Option<Output> {
    match message.first() {
        Some(&TAG_DATA) => Some(Output::Stdout),
        Some(&TAG_STDERR) => Some(Output::Stderr),
        _ => None,
    }
}

/// The binary message of a `Data` frame whose payload is the concatenation of `parts`, built
/// in one allocation (what `Frame::Data(parts.concat()).encode()` gives, without the copy in
/// between).
pub fn data_message(parts: &[&[u8]]) -> Vec<u8> {
    let len = parts.iter().map(|part| part.len()).sum::<usize>();
    let mut message = Vec::with_capacity(1 + len);
    message.push(TAG_DATA);
    for part in parts {
        message.extend_from_slice(part);
    }
    message
}

const TAG_READY: u8 = 0x00;
const TAG_DATA: u8 = 0x01;
const TAG_STDERR: u8 = 0x02;
const TAG_EOF: u8 = 0x03;
const TAG_RESIZE: u8 = 0x04;
const TAG_SIGNAL: u8 = 0x05;
const TAG_EXIT: u8 = 0x06;
const TAG_ERROR: u8 = 0x07;

impl Frame {
    pub fn encode(&self) -> Vec<u8> {
        let mut out;
        match self {
            Frame::Ready => out = vec![TAG_READY],
            Frame::Data(bytes) | Frame::Stderr(bytes) => {
                out = Vec::with_capacity(bytes.len() + 1);
                out.push(if matches!(self, Frame::Data(_)) {
                    TAG_DATA
                } else {
                    TAG_STDERR
                });
                out.extend_from_slice(bytes);
            }
            Frame::Eof => out = vec![TAG_EOF],
            Frame::Resize { cols, rows } => {
                out = vec![TAG_RESIZE];
                out.extend_from_slice(&cols.to_be_bytes());
                out.extend_from_slice(&rows.to_be_bytes());
            }
            Frame::Signal(name) => {
                out = vec![TAG_SIGNAL];
                out.extend_from_slice(name.as_bytes());
            }
            Frame::Exit(status) => {
                out = vec![TAG_EXIT];
                // Serialising a plain enum of strings and numbers cannot fail.
                out.extend_from_slice(&serde_json::to_vec(status).unwrap_or_default());
            }
            Frame::Error(message) => {
                out = vec![TAG_ERROR];
                out.extend_from_slice(message.as_bytes());
            }
        }
        out
    }

    /// [`Frame::encode`] of a frame the caller gives up: the payload of a `Data` or `Stderr`
    /// frame becomes the message itself, the tag put in front of it in place (no new buffer
    /// when the payload's has room for one more byte).
    pub fn into_encoded(self) -> Vec<u8> {
        match self {
            Frame::Data(mut bytes) => {
                bytes.insert(0, TAG_DATA);
                bytes
            }
            Frame::Stderr(mut bytes) => {
                bytes.insert(0, TAG_STDERR);
                bytes
            }
            other => other.encode(),
        }
    }

    pub fn decode(bytes: &[u8]) -> Result<Frame, FrameError> {
        let (&tag, payload) = bytes.split_first().ok_or(FrameError::Empty)?;
        let text =
            |what| String::from_utf8(payload.to_vec()).map_err(|_| FrameError::Malformed(what));
        Ok(match tag {
            TAG_READY if payload.is_empty() => Frame::Ready,
            TAG_READY => return Err(FrameError::Malformed("ready")),
            TAG_DATA => Frame::Data(payload.to_vec()),
            TAG_STDERR => Frame::Stderr(payload.to_vec()),
            TAG_EOF if payload.is_empty() => Frame::Eof,
            TAG_EOF => return Err(FrameError::Malformed("eof")),
            TAG_RESIZE => {
                let raw: [u8; 8] = payload
                    .try_into()
                    .map_err(|_| FrameError::Malformed("resize"))?;
                let cols = u32::from_be_bytes([raw[0], raw[1], raw[2], raw[3]]);
                let rows = u32::from_be_bytes([raw[4], raw[5], raw[6], raw[7]]);
                Frame::Resize { cols, rows }
            }
            TAG_SIGNAL => Frame::Signal(text("signal")?),
            TAG_EXIT => Frame::Exit(
                serde_json::from_slice(payload).map_err(|_| FrameError::Malformed("exit"))?,
            ),
            TAG_ERROR => Frame::Error(text("error")?),
            other => return Err(FrameError::UnknownTag(other)),
        })
    }
}

/// The environment variables a client may set with SSH `env` requests (as OpenSSH's
/// `AcceptEnv LANG LC_*` plus TERM): everything else is dropped.
pub fn env_allowed(name: &str) -> bool {
    name == "LANG" || name == "TERM" || name.starts_with("LC_")
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn frames_roundtrip() {
        let frames = [
            Frame::Ready,
            Frame::Data(b"hello".to_vec()),
            Frame::Data(vec![]),
            Frame::Stderr(vec![0, 255]),
            Frame::Eof,
            Frame::Resize {
                cols: 120,
                rows: 40,
            },
            Frame::Signal("INT".into()),
            Frame::Exit(ExitStatus::Code { code: 3 }),
            Frame::Exit(ExitStatus::Signal {
                signal: "KILL".into(),
                core_dumped: false,
            }),
            Frame::Error("session train1 is HELD: devctl session release train1".into()),
        ];
        for frame in frames {
            let message = frame.encode();
            assert_eq!(Frame::decode(&message).unwrap(), frame);
            assert_eq!(frame.into_encoded(), message);
        }
        assert_eq!(Frame::decode(&[]), Err(FrameError::Empty));
        assert_eq!(Frame::decode(&[0x99]), Err(FrameError::UnknownTag(0x99)));
        assert_eq!(
            Frame::decode(&[TAG_RESIZE, 1, 2]),
            Err(FrameError::Malformed("resize"))
        );
        assert_eq!(
            Frame::decode(&[TAG_EOF, 1]),
            Err(FrameError::Malformed("eof"))
        );
    }

    #[test]
    fn bulk_payloads_are_found_without_decoding() {
        let data = Frame::Data(b"out".to_vec()).encode();
        let stderr = Frame::Stderr(b"err".to_vec()).encode();
        assert_eq!(output_of(&data), Some(Output::Stdout));
        assert_eq!(&data[1..], b"out");
        assert_eq!(output_of(&stderr), Some(Output::Stderr));
        assert_eq!(&stderr[1..], b"err");
        for other in [Frame::Ready, Frame::Eof, Frame::Signal("INT".into())] {
            assert_eq!(output_of(&other.encode()), None, "{other:?}");
        }
        assert_eq!(output_of(&[]), None);
        assert_eq!(
            data_message(&[b"hello ", b"", b"world"]),
            Frame::Data(b"hello world".to_vec()).encode()
        );
        assert_eq!(data_message(&[]), Frame::Data(vec![]).encode());
    }

    #[test]
    fn open_message_shape() {
        let open = StreamOpen {
            session_id: SessionId(uuid::Uuid::nil()),
            owner: Dn::parse("/DC=org/CN=Alice").unwrap(),
            kind: StreamKind::DirectTcpip {
                host: "127.0.0.1".into(),
                port: 8888,
            },
            env: vec![],
        };
        let json = serde_json::to_string(&open).unwrap();
        assert!(
            json.contains(r#""kind":{"kind":"direct_tcpip","host":"127.0.0.1","port":8888}"#),
            "{json}"
        );
        assert_eq!(serde_json::from_str::<StreamOpen>(&json).unwrap(), open);
    }

    #[test]
    fn env_allow_list() {
        assert!(env_allowed("LANG"));
        assert!(env_allowed("LC_ALL"));
        assert!(env_allowed("TERM"));
        assert!(!env_allowed("LD_PRELOAD"));
        assert!(!env_allowed("PATH"));
    }

    proptest! {
        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = Frame::decode(&bytes);
        }

        #[test]
        fn data_roundtrips(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let frame = Frame::Data(bytes);
            prop_assert_eq!(Frame::decode(&frame.encode()).unwrap(), frame);
        }
    }
}
